"""Master weights in the optimizer (optim.master_weights = "optimizer", trainer/master_weights.py):
the fused AdamW kernel, equivalence with fp32 parameters, fp32 gradient accumulation, exact
resume, bf16 moments (optim.moments_dtype: stochastic rounding), 2 ranks against 1 (expert parallelism: test_expert_parallel.py; the RL trainer:
test_rl_train.py)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.distributed.tensor import DTensor
from triton_interpreter import run_interpreted

from tandem.cli import UserError
from tandem.config import build_config
from tandem.config.base import ModelConfig
from tandem.config.loader import ConfigError, split_args
from tandem.monitor.metrics import read_metrics
from tandem.trainer import stochastic_round
from tandem.trainer.config import LoRAConfig, OptimConfig, ParallelConfig
from tandem.trainer.master_weights import MasterAdamW, local
from tandem.trainer.model import build_trainer_model
from tandem.trainer.optim import build_optimizer, gradient
from tandem.trainer.parallel import init_distributed, shutdown
from tandem.trainer.sft.config import SFTConfig
from tandem.trainer.sft.train import train

sys.path.insert(0, str(Path(__file__).parent))
from test_sft_helpers import ENV, sft_args, tiny_model  # noqa: E402

KERNEL_SCRIPT = """
import torch
from tandem.trainer.adamw_kernel import adamw_
from tandem.trainer.master_weights import adamw_torch_
from tandem.trainer.stochastic_round import noise, round_stochastic

gen = torch.Generator().manual_seed(0)
cases = [(2500, torch.bfloat16, torch.bfloat16, torch.float32), (37, torch.float32, torch.bfloat16, torch.float32),
         (4096, torch.float32, torch.float32, torch.float32), (2500, torch.bfloat16, torch.bfloat16, torch.bfloat16),
         (37, torch.float32, torch.float32, torch.bfloat16)]
for numel, grad_dtype, param_dtype, moments in cases:
    master = torch.randn(numel, generator=gen)
    ref = torch.nn.Parameter(master.clone())
    adamw = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    got = [master.to(param_dtype, copy=True), master.clone(), torch.zeros(numel, dtype=moments), torch.zeros(numel, dtype=moments)]
    want = [t.clone() for t in got]
    for step in range(1, 4):
        grad = torch.randn(numel, generator=gen).to(grad_dtype)
        scale = torch.tensor(0.5)
        seed = 1000 * step + numel
        args = (scale, 1e-2, 0.9, 0.95, 1e-8, 0.1, step)
        before = [t.clone() for t in want]
        exact = [t.to(torch.float32 if i > 1 else t.dtype, copy=True) for i, t in enumerate(before)]
        adamw_(got[0], grad, *got[1:], *args, seed)
        adamw_torch_(want[0], grad, *want[1:], *args, seed)
        adamw_torch_(exact[0], grad, *exact[1:], *args)
        ref.grad = grad.float() * 0.5
        adamw.step()
        assert got[2].dtype == got[3].dtype == moments
        for a, b in zip(got[1:], want[1:]):  # the same operations in fp32: bit for bit
            assert torch.equal(a, b), (numel, step, (a != b).sum())
        if moments == torch.float32:
            torch.testing.assert_close(got[1], ref.detach(), rtol=1e-5, atol=1e-6)
        else:  # a bf16 moment is off by up to 2^-8 of itself: each update by up to ~1 % of its size (lr)
            torch.testing.assert_close(got[1], ref.detach(), rtol=0, atol=5e-4)
        if moments == torch.bfloat16:  # the fp32 moments, rounded with noise(seed): low 16 bits, high 16 bits
            bits = noise(seed, numel, torch.device("cpu"))
            assert torch.equal(got[2], round_stochastic(exact[2], bits & 0xFFFF))
            assert torch.equal(got[3], round_stochastic(exact[3], bits >> 16))
            assert not torch.equal(got[3], exact[3].bfloat16())  # not rounded to nearest
            other = [t.clone() for t in before]
            adamw_torch_(other[0], grad, *other[1:], *args, seed + 1)
            assert not torch.equal(other[3], want[3])  # the seed draws the noise
        # the parameter is its master rounded (the interpreter truncates where the GPU rounds to nearest)
        ulp = 2**-7 if param_dtype == torch.bfloat16 else 0.0
        torch.testing.assert_close(got[0].float(), got[1], rtol=ulp, atol=0)
        torch.testing.assert_close(want[0], want[1].to(param_dtype), rtol=0, atol=0)
print("ok")
"""


def test_kernel_matches_torch_in_interpreter() -> None:
    """The Triton pass equals its torch form bit for bit, fp32 or bf16 moments (their stochastic
    rounding included), and torch's AdamW to rounding (clipping scale included)."""
    pytest.importorskip("triton")
    run_interpreted(KERNEL_SCRIPT)


@pytest.mark.parametrize(
    "value", [1 + 0.3 * 2**-7, -(1 + 0.3 * 2**-7), 2 - 0.1 * 2**-7, 3e-30 * (1 + 0.7 * 2**-7)]
)
def test_stochastic_rounding_is_unbiased(value: float) -> None:
    """Rounded 2^16 times with the noise of one seed, an fp32 value between two bf16 neighbours
    becomes one of the two, each as often as makes the mean the value (either sign, just below a
    power of two, tiny); inf and nan stay as they are."""
    x = torch.full((2**16,), value)
    assert not torch.equal(x, x.bfloat16().float())  # between two bf16 numbers
    bits = stochastic_round.noise(seed=7, numel=x.numel(), device=x.device)
    low, high = (
        stochastic_round.round_stochastic(x, bits & 0xFFFF),
        stochastic_round.round_stochastic(x, bits >> 16),
    )
    for rounded in (low.float(), high.float()):
        neighbours = rounded.unique()
        assert len(neighbours) == 2 and neighbours[0] < value < neighbours[1], neighbours
        ulp = (neighbours[1] - neighbours[0]).item()
        # the mean of 2^16 draws: standard deviation at most ulp / 2 / 256
        assert abs(rounded.double().mean().item() - value) < 0.01 * ulp
    # inf, -inf, a nan the bit trick would make inf, one it would wrap to +0
    special = torch.tensor([0x7F800000, -0x800000, 0x7F800001, -1], dtype=torch.int32).view(torch.float32)
    rounded = stochastic_round.round_stochastic(special, torch.tensor([0xFFFF, 0xFFFF, 0, 0xFFFF]))
    assert rounded[:2].tolist() == [float("inf"), -float("inf")] and rounded[2:].isnan().all()


def test_bf16_moments_track_fp32() -> None:
    """The point of stochastic rounding: 3,000 MasterAdamW steps with beta2 = 0.999 and a constant
    gradient leave bf16 exp_avg_sq within ~1 % of the fp32 one (on average; each element within
    15 %), where bf16 rounded to nearest stalls at a fraction of it (computed directly)."""
    grad = torch.linspace(0.5, 2.0, 256)
    optimizers = []
    for dtype in (torch.float32, torch.bfloat16):
        param = nn.Parameter(torch.zeros(256))
        optimizer = MasterAdamW([{"params": [param]}], lr=1e-3, betas=(0.9, 0.999), moments_dtype=dtype)
        optimizers.append((param, optimizer))
    for _ in range(3000):
        for param, optimizer in optimizers:
            optimizer.grads[param] = grad
            optimizer.step()
    (p32, fp32), (p16, bf16) = optimizers
    want, got = fp32.state[p32]["exp_avg_sq"], bf16.state[p16]["exp_avg_sq"]
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(want, (1 - 0.999**3000) * grad**2, rtol=1e-4, atol=0)
    error = got.float() / want - 1
    assert error.mean().abs() < 0.01 and error.abs().max() < 0.15, (error.mean(), error.abs().max())
    torch.testing.assert_close(bf16.state[p16]["exp_avg"].float(), grad, rtol=0.02, atol=0)
    nearest = torch.zeros(256, dtype=torch.bfloat16)
    for _ in range(3000):
        nearest = (nearest.float() * 0.999 + 0.001 * grad**2).bfloat16()
    assert (nearest.float() / want - 1).abs().min() > 0.5


@pytest.mark.parametrize("where", ["model", "optimizer"])
def test_bf16_moments_need_master_weights_in_optimizer(where: str) -> None:
    overrides = [("optim.moments_dtype", "bfloat16"), ("optim.master_weights", where)]
    if where == "optimizer":
        assert build_config(SFTConfig, overrides=overrides).optim.moments_dtype == "bfloat16"
        return
    with pytest.raises(ConfigError) as info:
        build_config(SFTConfig, overrides=overrides)
    message = str(info.value)
    assert "moments_dtype = 'bfloat16'" in message and "master_weights = 'optimizer'" in message
    assert "'optim'" in message and "\n" not in message


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("master"))


def sft(
    model: Path, run_dir: Path, master_weights: str, compute: str = "float32", **extra: object
) -> list[str]:
    """Arguments of a 4-step SFT run on CPU (16 examples a step in micro-batches of 2 rows; clipping
    active: the gradient norms exceed 0.5)."""
    options = {"optim.master-weights": master_weights, "compute-dtype": compute, "optim.max-grad-norm": 0.5}
    return sft_args(model, run_dir, steps=4, **options, **extra)


def run(args: list[str]) -> None:
    _, overrides, _ = split_args(args)
    train(build_config(SFTConfig, overrides=overrides))


def metrics(run_dir: Path) -> dict[int, dict]:
    """Per step its last record (a step logged twice, before and after a resume, keeps the last)."""
    return {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl", "sft") if "loss" in r}


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "final" / "model.safetensors")


def assert_same_weights(got: Path, want: Path, model: Path, compute: str, atol: float) -> None:
    """fp32 compute: the final weights agree to `atol`; bf16: their updates from the initial
    weights differ by at most 5% (in norm, per tensor)."""
    initial, reference, weights = (
        load_file(model / "model.safetensors"),
        final_weights(want),
        final_weights(got),
    )
    assert reference.keys() == weights.keys()
    for name, weight in weights.items():
        assert weight.dtype == torch.float32
        if compute == "float32":
            torch.testing.assert_close(weight, reference[name], rtol=0, atol=atol, msg=name)
        else:
            update = (reference[name] - initial[name].float()).norm()
            assert (weight - reference[name]).norm() <= 0.05 * update, name


@pytest.mark.parametrize(("compute", "tolerance"), [("float32", 1e-6), ("bfloat16", 2e-3)])
def test_master_in_optimizer_matches_master_in_model(
    model: Path, tmp_path: Path, compute: str, tolerance: float
) -> None:
    """fp32 compute: the same steps as torch's AdamW over fp32 parameters, to rounding. bf16
    compute: close (the masters start from the bf16-rounded checkpoint, and the gradients of each
    micro-batch are rounded to bf16 once), and the export holds the fp32 masters."""
    run(sft(model, tmp_path / "model", "model", compute))
    run(sft(model, tmp_path / "optimizer", "optimizer", compute))
    want, got = metrics(tmp_path / "model"), metrics(tmp_path / "optimizer")
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    assert want[1]["grad_norm"] > 0.5
    for step in want:
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], abs=tolerance), step
        assert got[step]["grad_norm"] == pytest.approx(want[step]["grad_norm"], rel=tolerance), step
    assert_same_weights(tmp_path / "optimizer", tmp_path / "model", model, compute, atol=1e-6)
    if compute == "bfloat16":  # the export holds the masters, which carry more than bf16's 8 bits
        exported = final_weights(tmp_path / "optimizer")
        assert any(not torch.equal(w, w.bfloat16().float()) for w in exported.values())


def test_micro_batches_accumulate_in_fp32(model: Path) -> None:
    """Eight micro-batches' bf16 gradients sum in fp32: the step's gradient is their exact sum to
    fp32 rounding, where a bf16 running sum is off by far more."""
    world = init_distributed("cpu")
    try:
        net = build_trainer_model(
            ModelConfig(name=str(model), device="cpu"), world, ParallelConfig(), "bfloat16",
            master_weights="optimizer",
        )  # fmt: skip
        optimizer = build_optimizer(net, OptimConfig(master_weights="optimizer"))
        params = [p for group in optimizer.param_groups for p in group["params"]]
        assert {p.dtype for p in params} == {torch.bfloat16}
        assert not any(isinstance(p, DTensor) for p in params)  # one rank: no FSDP
        generator = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, net.hf_config.vocab_size, (1, 32), generator=generator) for _ in range(8)]
        positions = torch.arange(32)[None]

        def backward(ids: torch.Tensor) -> None:
            logprobs, _ = net.sequence_logprobs(ids, positions)
            (-logprobs.sum()).backward()

        single = []
        for ids in batches:
            optimizer.zero_grad()
            backward(ids)
            single.append([local(gradient(optimizer, p)).clone() for p in params])
        optimizer.zero_grad()
        for ids in batches:
            backward(ids)
        worst_fp32, worst_bf16 = 0.0, 0.0
        for i, p in enumerate(params):
            got = local(gradient(optimizer, p))
            assert got.dtype == torch.float32 and p.grad is None
            parts = [grads[i] for grads in single]
            assert parts[0].dtype == torch.bfloat16
            exact = torch.stack([g.double() for g in parts]).sum(0)
            bf16 = parts[0].clone()
            for g in parts[1:]:
                bf16 += g
            scale = exact.abs().max().item()
            worst_fp32 = max(worst_fp32, (got.double() - exact).abs().max().item() / scale)
            worst_bf16 = max(worst_bf16, (bf16.double() - exact).abs().max().item() / scale)
        assert worst_fp32 < 1e-6 < 1e-3 < worst_bf16, (worst_fp32, worst_bf16)
    finally:
        shutdown()


def resume_from_step_2(model: Path, whole: Path, resumed: Path, moments: tuple[str, str]) -> None:
    """A 4-step run with a checkpoint every 2 steps in `whole`, and its copy resumed from step 2 in
    `resumed`; each with optim.moments_dtype from `moments` (whole's, resumed's)."""
    args = [sft(model, run, "optimizer", "bfloat16", **{"ckpt.interval": 2, "optim.moments-dtype": dtype})
            for run, dtype in zip((whole, resumed), moments, strict=True)]  # fmt: skip
    run(args[0])
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_4")
    shutil.rmtree(resumed / "final")
    run([*args[1], "--resume"])


@pytest.mark.parametrize("moments", ["float32", "bfloat16"])
def test_resume_continues_bit_identically(model: Path, tmp_path: Path, moments: str) -> None:
    """A run resumed from its step-2 checkpoint (bf16 parameters, fp32 masters and the moments
    through DCP) takes exactly the steps of the uninterrupted run (bf16 moments: the same
    rounding noise too)."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    resume_from_step_2(model, whole, resumed, (moments, moments))
    want, got = metrics(whole), metrics(resumed)
    assert [got[s]["loss"] for s in (3, 4)] == [want[s]["loss"] for s in (3, 4)]
    assert [got[s]["grad_norm"] for s in (3, 4)] == [want[s]["grad_norm"] for s in (3, 4)]
    reference = final_weights(whole)
    for name, weight in final_weights(resumed).items():
        assert torch.equal(weight, reference[name]), name
    assert any(not torch.equal(w, w.bfloat16().float()) for w in reference.values())


@pytest.mark.parametrize("moments", [("bfloat16", "float32"), ("float32", "bfloat16")])
def test_resume_converts_the_moments(model: Path, tmp_path: Path, moments: tuple[str, str]) -> None:
    """A checkpoint written with one moments_dtype resumes under the other (DCP and
    load_state_dict copy the saved moments into the optimizer's own dtype): step 3 runs on the
    checkpoint's weights exactly, step 4's update differs by the moments' rounding only."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    resume_from_step_2(model, whole, resumed, moments)
    want, got = metrics(whole), metrics(resumed)
    assert got[3]["loss"] == want[3]["loss"] and got[3]["grad_norm"] == want[3]["grad_norm"]
    assert got[4]["loss"] == pytest.approx(want[4]["loss"], rel=1e-3)
    assert_same_weights(resumed, whole, model, "bfloat16", atol=0)


@pytest.mark.parametrize(("compute", "tolerance"), [("float32", 1e-5), ("bfloat16", 2e-3)])
def test_two_ranks_match_one(model: Path, tmp_path: Path, compute: str, tolerance: float) -> None:
    """FSDP over 2 gloo ranks (gradients reduced in fp32, then held as bf16 micro-batch gradients
    under bf16 compute) takes the steps of one rank."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    two = subprocess.run(
        [*launch, "-m", "tandem.trainer.sft.cli", *sft(model, tmp_path / "two", "optimizer", compute)],
        capture_output=True, text=True, env=ENV, timeout=400,
    )  # fmt: skip
    assert two.returncode == 0, (two.stdout + two.stderr)[-3000:]
    run(sft(model, tmp_path / "one", "optimizer", compute))
    one, both = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert sorted(one) == sorted(both) == [1, 2, 3, 4]
    for step in one:
        assert both[step]["loss"] == pytest.approx(one[step]["loss"], abs=tolerance), step
        assert both[step]["grad_norm"] == pytest.approx(one[step]["grad_norm"], rel=tolerance), step
    assert_same_weights(tmp_path / "two", tmp_path / "one", model, compute, atol=1e-5)


def test_one_rank_checkpoint_resumes_on_two(model: Path, tmp_path: Path) -> None:
    """One rank runs without FSDP (nothing to shard or cast); its step-2 checkpoint resumes on 2
    FSDP ranks (DCP reshards the plain tensors) and ends where the uninterrupted run does."""
    run(sft(model, tmp_path / "one", "optimizer", **{"ckpt.interval": 2}))
    shutil.copytree(tmp_path / "one", tmp_path / "moved")
    shutil.rmtree(tmp_path / "moved" / "checkpoints" / "step_4")
    shutil.rmtree(tmp_path / "moved" / "final")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    args = sft(model, tmp_path / "moved", "optimizer", **{"ckpt.interval": 2})
    moved = subprocess.run(
        [*launch, "-m", "tandem.trainer.sft.cli", *args, "--resume"],
        capture_output=True, text=True, env=ENV, timeout=400,
    )  # fmt: skip
    assert moved.returncode == 0, (moved.stdout + moved.stderr)[-3000:]
    one, both = metrics(tmp_path / "one"), metrics(tmp_path / "moved")
    assert sorted(both) == [1, 2, 3, 4]
    for step in (3, 4):
        assert both[step]["loss"] == pytest.approx(one[step]["loss"], abs=1e-5), step
    assert_same_weights(tmp_path / "moved", tmp_path / "one", model, "float32", atol=1e-5)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"lora": LoRAConfig()}, "does not support LoRA"),
        ({"cfg": {"impl": "hf"}}, "model.impl = 'tandem'"),
        ({"cfg": {"dtype": "bfloat16"}}, "model.dtype must be auto or float32"),
    ],
)
def test_unsupported_settings_are_refused(model: Path, change: dict, message: str) -> None:
    world = init_distributed("cpu")
    try:
        cfg = ModelConfig(name=str(model), device="cpu", **change.get("cfg", {}))
        with pytest.raises(UserError, match=message):
            build_trainer_model(
                cfg, world, ParallelConfig(), lora=change.get("lora"), master_weights="optimizer"
            )
    finally:
        shutdown()
