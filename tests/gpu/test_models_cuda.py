"""tandem's trainer models on CUDA: the packed-attention backends agree (whole rows, and ring
context parallelism's query columns against whole rows), the fused SwiGLU follows the plain
form, grouped-GEMM experts equal the per-expert loop, the bf16 model follows transformers, the
trainer path (FSDP2, compile, fused AdamW) trains, and the memory settings (selective and full
checkpointing, activation offload) keep the gradients and lower peak memory. Marked `gpu`;
skipped without CUDA. (Context parallelism across ranks is tested with gloo on CPU:
tests/trainer/test_context_parallel.py.)"""

import functools
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.config.base import ModelConfig
from tandem.models.layers.attention import PackedDocs, packed_attention
from tandem.models.layers.mlp import MLP
from tandem.models.layers.moe import GroupedExperts
from tandem.models.tiny import build_tiny_model
from tandem.trainer.config import OptimConfig, ParallelConfig
from tandem.trainer.master_weights import local
from tandem.trainer.model import build_trainer_model
from tandem.trainer.optim import build_optimizer, clip_grad_norm
from tandem.trainer.parallel import init_distributed
from tandem.trainer.weight_stream import persistent_tensors

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")
# cuDNN's variable-length kernels need NVIDIA's optional cuDNN frontend package
CUDNN = pytest.param(
    "cudnn",
    marks=pytest.mark.skipif(find_spec("cudnn") is None, reason="nvidia-cudnn-frontend not installed"),
)
# FlashAttention 4's kernels need its optional package (flash-attn-4)
FLASH = pytest.param(
    "flash",
    marks=pytest.mark.skipif(find_spec("flash_attn") is None, reason="flash-attn-4 not installed"),
)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def assert_training_lowers_the_loss(
    model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor
) -> None:
    """Five AdamW steps on one batch lower its loss."""
    optimizer = build_optimizer(model, OptimConfig(lr=1e-3))
    losses = []
    for _ in range(5):
        loss = -model.sequence_logprobs(ids, positions)[0].mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    assert losses[-1] < losses[0], losses


def packed_positions(lengths: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths]).to(CUDA)


def assert_backend_matches_masked_sdpa(
    positions: torch.Tensor, backend: str, shared_prompts: bool = False
) -> None:
    """Attention forward and backward of `backend` against the dense-mask SDPA, bf16."""
    torch.manual_seed(0)
    q = torch.randn(2, 512, 8, 64, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 512, 2, 64, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    grad = torch.randn_like(q)
    results = {}
    for name in ("sdpa", backend):
        docs = PackedDocs.from_positions(positions, name, shared_prompts=shared_prompts)
        out = packed_attention(q, k, v, docs, 0.125)
        out.backward(grad)
        results[name] = [out.detach(), *(t.grad.clone() for t in (q, k, v))]
        q.grad = k.grad = v.grad = None
    for name, want, got in zip(["out", "q", "k", "v"], results["sdpa"], results[backend], strict=True):
        assert rel(got, want) < 2e-2, (name, rel(got, want))


@pytest.mark.parametrize("backend", ["flex", "varlen", CUDNN, FLASH, "sdpa_docs"])
def test_attention_backends_match_masked_sdpa(backend: str) -> None:
    assert_backend_matches_masked_sdpa(packed_positions([[100, 300, 112], [512]]), backend)


@pytest.mark.parametrize("backend", ["varlen", CUDNN, FLASH])
def test_many_short_documents_match_masked_sdpa(backend: str) -> None:
    """23 documents of 1 to 300 tokens: cudnn pads them to 32 with empty ones and rounds the
    longest up to 512 (layers/cudnn_attention.py); neither may change a value."""
    rows = [[1, 37, 2, 90, 5, 1, 64, 3, 300, 9], [7, 120, 1, 1, 33, 250, 11, 6, 13, 1, 19, 11, 39]]
    assert_backend_matches_masked_sdpa(packed_positions(rows), backend)


def test_flex_attends_shared_prompts_as_masked_sdpa() -> None:
    """Rows holding shared prompts (a prompt, then branches whose positions continue from it):
    flex's compiled block mask gives what the dense mask gives, forward and backward."""
    prompt, branches = 40, [30, 70, 5, 120]
    row = [torch.arange(prompt - 1)] + [torch.arange(prompt - 1, prompt - 1 + n) for n in branches]
    first = torch.cat(row)
    positions = torch.stack([torch.cat([first, torch.arange(512 - len(first))]), torch.arange(512)]).to(CUDA)
    assert_backend_matches_masked_sdpa(positions, "flex", shared_prompts=True)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fused_swiglu_follows_the_plain_form(compiled: bool) -> None:
    """The MLP's fused activation and down projection on CUDA (layers/swiglu.py) against the
    plain form with the same weights, bf16, forward and every gradient."""
    torch.manual_seed(0)
    mlp = MLP(256, 640).to(CUDA, torch.bfloat16)
    x = torch.randn(3, 100, 256, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)

    def plain(inputs: torch.Tensor) -> torch.Tensor:
        gate, up = mlp.w_gate_up(inputs).chunk(2, dim=-1)
        return mlp.w_down(torch.nn.functional.silu(gate) * up)

    results = []
    for forward in (plain, torch.compile(mlp) if compiled else mlp):
        out = forward(x)
        out.backward(grad)
        results.append([out.detach(), x.grad, mlp.w_gate_up.weight.grad, mlp.w_down.weight.grad])
        x.grad = mlp.w_gate_up.weight.grad = mlp.w_down.weight.grad = None
    for name, got, want in zip(["out", "x", "w_gate_up", "w_down"], results[1], results[0], strict=True):
        assert rel(got, want) < 1e-2, (name, rel(got, want))


def test_grouped_experts_equal_the_loop() -> None:
    torch.manual_seed(0)
    experts = GroupedExperts(8, 64, 32).to(CUDA)
    experts.init_weights(0.1)
    counts = torch.tensor([5, 0, 17, 3, 0, 40, 1, 6], device=CUDA)
    x = torch.randn(int(counts.sum()), 64, device=CUDA)
    loop = experts.compute(x, counts)  # fp32: the exact loop
    grouped = experts.to(torch.bfloat16).compute(x.bfloat16(), counts)
    assert rel(grouped, loop) < 2e-2


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(out=tmp_path_factory.mktemp("moe") / "m", num_experts=8, moe_intermediate_size=64)


@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16], ids=["fp32-moments", "bf16-moments"])
def test_adamw_kernel_follows_its_torch_form_on_cuda(moments: torch.dtype) -> None:
    """The Triton AdamW pass on the GPU against its torch form on the GPU over 5 steps. The two
    round differently in fp32 (fused multiply-adds, the square root): on the H200 ~3 % of fp32
    moments differ, by up to 6e-8, and a few masters by up to 7e-6 (under 1 % of a step's update,
    lr = 1e-3). bf16 moments, rounded with the same noise, are the same bf16 numbers but where such
    a difference moved a value across its rounding threshold (a few dozen of 1 M elements there): one bf16
    step apart, or near zero (exp_avg's cancellations) a few 1e-9."""
    from tandem.trainer.adamw_kernel import adamw_
    from tandem.trainer.master_weights import adamw_torch_

    gen = torch.Generator(device=CUDA).manual_seed(0)
    numel = 1 << 20
    master = torch.randn(numel, device=CUDA, generator=gen)
    got = [master.bfloat16(), master.clone(), *(torch.zeros(numel, device=CUDA, dtype=moments) for _ in "mv")]
    want = [t.clone() for t in got]
    for step in range(1, 6):
        grad = torch.randn(numel, device=CUDA, generator=gen).bfloat16()
        args = (torch.tensor(0.7, device=CUDA), 1e-3, 0.9, 0.999, 1e-8, 0.1, step, 1234 + step)
        adamw_(got[0], grad, *got[1:], *args)
        adamw_torch_(want[0], grad, *want[1:], *args)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[0], got[1].bfloat16())  # the parameter is its master rounded to nearest
    for a, b in zip(got[2:], want[2:], strict=True):
        assert a.dtype == moments
        if moments == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        else:
            apart = a != b
            assert apart.float().mean() < 1e-3, apart.float().mean()
            torch.testing.assert_close(a[apart].float(), b[apart].float(), rtol=2**-7, atol=1e-8)


@pytest.mark.parametrize("master", ["model", "optimizer"], ids=["fp32-params", "fp32-masters"])
@pytest.mark.parametrize("keep", [False, True], ids=["reshard", "keep-gathered"])
@pytest.mark.parametrize("attention", ["flex", "varlen", CUDNN, FLASH])
def test_bf16_trainer_model_follows_transformers_and_trains(
    tiny_moe: Path, attention: str, keep: bool, master: str
) -> None:
    """keep-gathered (reshard_after_forward = false): the check's forward below has no backward
    and leaves the gathered weights in place; on the H200 (torch 2.11) they then outlived the
    optimizer steps and the loss stood still, before build_optimizer dropped them after each step.
    fp32-masters (optim.master_weights = "optimizer"): bf16 shards, updated by the Triton kernel,
    each equal to its fp32 master rounded to nearest after every step."""
    world = init_distributed("cuda")
    parallel = ParallelConfig(reshard_after_forward=not keep)
    model = build_trainer_model(
        ModelConfig(name=str(tiny_moe), attention=attention), world, parallel, master_weights=master
    )
    reference = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32).to(CUDA)
    positions = packed_positions([[40, 60, 28], [128]])
    ids = torch.randint(0, reference.config.vocab_size, positions.shape, device=CUDA)
    logprobs, _ = model.sequence_logprobs(ids, positions)
    starts = [0, 40, 100, 128]
    with torch.no_grad():
        want = []
        for row, bounds in enumerate([starts, [0, 128]]):
            for a, b in zip(bounds[:-1], bounds[1:], strict=True):
                lp = reference(input_ids=ids[row : row + 1, a:b]).logits.log_softmax(-1)
                want.append(lp[0, :-1].gather(1, ids[row, a + 1 : b, None]).squeeze(1))
    got = torch.cat([logprobs[0, 1:40], logprobs[0, 41:100], logprobs[0, 101:128], logprobs[1, 1:]])
    error = float((got - torch.cat(want)).abs().mean())
    assert error < 0.05, error  # bf16 compute against an fp32 reference

    optimizer = build_optimizer(model, OptimConfig(lr=1e-3, master_weights=master))
    losses = []
    for _ in range(5):
        logprobs, _ = model.sequence_logprobs(ids, positions)
        loss = -logprobs.mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    assert losses[-1] < losses[0], losses
    if master == "optimizer":
        optimizer.settle()  # (the step runs on a stream of its own: optim.overlap_step)
        for param, state in optimizer.state.items():
            shard, master = local(param), local(state["master"])
            assert shard.dtype == torch.bfloat16 and master.dtype == torch.float32
            assert torch.equal(shard, master.to(torch.bfloat16))


def test_overlapped_optimizer_step_trains_as_the_inline_step(tiny_moe: Path) -> None:
    """optim.overlap_step: the step on a stream of its own, unit by unit beside the next forward,
    takes the same steps as the step in line (the same kernels on the same tensors; only the
    backward's atomics may differ between runs), and what is read after it, the tensors a
    publisher sends and the masters, are the updated ones."""
    world = init_distributed("cuda")
    positions = packed_positions([[40, 60, 28], [128]])
    ids = torch.randint(0, 512, positions.shape, device=CUDA, generator=torch.Generator(CUDA).manual_seed(0))
    runs = {}
    for overlap in (False, True):
        model = build_trainer_model(
            ModelConfig(name=str(tiny_moe)), world, ParallelConfig(), master_weights="optimizer"
        )
        optimizer = build_optimizer(
            model,
            OptimConfig(lr=1e-3, master_weights="optimizer", moments_dtype="bfloat16", overlap_step=overlap),
        )
        assert (optimizer.step_stream is not None) == overlap
        losses = []
        for _ in range(4):
            logprobs, _ = model.sequence_logprobs(ids, positions)
            loss = -logprobs.mean()
            loss.backward()
            clip_grad_norm(optimizer, 1.0)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss))
        published = {name: t.detach().clone() for name, t in persistent_tensors(model).items()}
        masters = [optimizer.master(p).clone() for p in model.parameters()]
        for param, master in zip(model.parameters(), masters, strict=True):
            assert torch.equal(local(param), local(master).to(param.dtype))
        runs[overlap] = losses, published, masters
    (losses, published, masters), (losses_o, published_o, masters_o) = runs[False], runs[True]
    assert losses_o == pytest.approx(losses, rel=1e-4) and losses[-1] < losses[0], (losses, losses_o)
    for name, tensor in published.items():
        torch.testing.assert_close(published_o[name], tensor, rtol=1e-2, atol=1e-5, msg=name)
    for a, b in zip(masters_o, masters, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("backend", ["flex", "varlen", CUDNN, FLASH, "sdpa_docs", "sdpa"])
def test_query_columns_attend_like_the_whole_row(backend: str) -> None:
    """Rank 1 of ring cp = 2 (chunks 1 and 2 of 4) against the whole rows' keys equals those
    columns of whole-row attention, for documents that cross the chunk boundaries."""
    positions = packed_positions([[100, 300, 112], [512]])
    columns = torch.arange(128, 384, device=CUDA)
    torch.manual_seed(0)
    q = torch.randn(2, 512, 8, 64, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 512, 2, 64, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    grad = torch.randn(2, 256, 8, 64, device=CUDA, dtype=torch.bfloat16)
    whole = PackedDocs.from_positions(positions, "sdpa").attend(q, k, v, 0.125)[:, columns]
    whole.backward(grad)
    want = [whole.detach(), *(t.grad.clone() for t in (q, k, v))]
    q.grad = k.grad = v.grad = None
    part = PackedDocs.from_positions(positions, backend, columns).attend(q[:, columns], k, v, 0.125)
    part.backward(grad)
    for name, a, b in zip(["out", "q", "k", "v"], [part, q.grad, k.grad, v.grad], want, strict=True):
        assert rel(a, b) < 2e-2, (name, rel(a, b))


@pytest.mark.parametrize("backend", ["varlen", CUDNN, FLASH])
def test_selective_checkpointing_keeps_custom_attention_outputs(backend: str) -> None:
    """varlen's, cudnn's and flash's kernels are custom operators, opaque to selective checkpointing: the
    policy names them (models/parallelism.py), so the backward's recomputation of a block runs
    its elementwise work again but not attention (and the gradients stay those of no checkpoint)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from tandem.models.parallelism import _keep_matmuls

    class Attentions(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            Attentions.calls += str(func) in (
                "torch_attn._varlen_attn.default",
                "cudnn.sdpa_fwd.default",
                "tandem.flash_varlen_fwd.default",
            )
            return func(*args, **(kwargs or {}))

    docs = PackedDocs.from_positions(packed_positions([[100, 300, 112], [512]]), backend)
    torch.manual_seed(0)
    q = torch.randn(2, 512, 8, 64, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 512, 2, 64, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    grad = torch.randn_like(q)

    def block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return packed_attention(torch.nn.functional.silu(q), k * 2, v, docs, 0.125)

    block(q, k, v).backward(grad)
    want = [t.grad.clone() for t in (q, k, v)]
    q.grad = k.grad = v.grad = None
    with Attentions():
        context = functools.partial(create_selective_checkpoint_contexts, _keep_matmuls)
        out = checkpoint(block, q, k, v, use_reentrant=False, context_fn=context)
        assert Attentions.calls == 1
        out.backward(grad)
    assert Attentions.calls == 1, "the recomputation ran attention again"
    for name, a, b in zip(["q", "k", "v"], [q.grad, k.grad, v.grad], want, strict=True):
        assert rel(a, b) < 1e-2, (name, rel(a, b))  # (the kernels' backward may add in any order)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wide enough that a block's activations, not the weights, set the peak at 8k tokens."""
    return build_tiny_model(
        out=tmp_path_factory.mktemp("tiny") / "m", num_layers=4, hidden_size=512, num_heads=8, num_kv_heads=4,
        intermediate_size=2048, max_position_embeddings=8192,
    )  # fmt: skip


@pytest.mark.parametrize(
    "options",
    [
        {"activation_checkpointing": "selective"},
        {"activation_checkpointing": "full"},
        {"activation_offload": True},
        {"activation_checkpointing": "full", "activation_offload": True},
    ],
    ids=["selective", "full", "offload", "full-offload"],
)
def test_memory_settings_keep_the_gradients_and_save_memory(tiny: Path, options: dict) -> None:
    world = init_distributed("cuda")
    positions = torch.cat([torch.arange(n) for n in (3000, 5192)])[None].to(CUDA)
    ids = torch.randint(0, 500, positions.shape, device=CUDA, generator=torch.Generator(CUDA).manual_seed(0))
    results = {}
    for name, parallel in (("plain", ParallelConfig()), ("setting", ParallelConfig(**options))):
        model = build_trainer_model(ModelConfig(name=str(tiny)), world, parallel)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        logprobs, _ = model.sequence_logprobs(ids, positions)
        (-logprobs.sum()).backward()
        torch.cuda.synchronize()
        grads = [p.grad.full_tensor().float() for p in model.parameters()]
        results[name] = (float(logprobs.sum()), grads, torch.cuda.max_memory_allocated() - base)
        del model, logprobs
    (loss, grads, peak), (loss_s, grads_s, peak_s) = results["plain"], results["setting"]
    assert loss_s == pytest.approx(loss, rel=1e-3)
    # bf16 both ways, the setting's backward reading recomputed (or offloaded) activations through
    # other compiled kernels: one small tensor's gradient differed by 2.2 % in a whole-file run on an
    # H100 (2026-12-06; < 2 % run alone), so 3 %: a wrong gradient is off by far more
    for a, b in zip(grads_s, grads, strict=True):
        assert rel(a, b) < 3e-2
    print(
        f"{options}: peak above the weights {peak_s / 2**20:.0f} MiB, without the setting {peak / 2**20:.0f} MiB"
    )
    # Selective saves less than the others: the fused SwiGLU (layers/swiglu.py) already keeps only
    # gate_up of the MLP without any setting, so selective drops the norms' and rotary outputs
    # (H200, 2026-12-05: 564 against 677 MiB).
    most = 0.9 if options == {"activation_checkpointing": "selective"} else 0.8
    assert peak_s < most * peak, (
        f"peak memory {peak_s / 2**20:.0f} MiB, without the setting {peak / 2**20:.0f} MiB"
    )


@pytest.fixture(scope="module")
def tiny_glm5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(
        out=tmp_path_factory.mktemp("glm5") / "m", family="glm_moe_dsa", num_experts=8, moe_intermediate_size=64,
        index_topk=64,
    )  # fmt: skip


def test_glm5_sparse_attention_follows_the_dense_mask_and_trains(tiny_glm5: Path) -> None:
    """GLM-5 on CUDA: the sparse path (flex → sparse, bf16, compiled blocks) gives the dense
    mask's logprobs, and five AdamW steps lower the loss."""
    world = init_distributed("cuda")
    positions = packed_positions([[200, 300, 12], [512]])
    ids = torch.randint(0, 512, positions.shape, device=CUDA, generator=torch.Generator(CUDA).manual_seed(0))
    results = {}
    for attention in ("sdpa", "flex"):
        model = build_trainer_model(
            ModelConfig(name=str(tiny_glm5), attention=attention), world, ParallelConfig()
        )
        assert model.layers[0].attention.sparse == (attention == "flex")
        results[attention] = model.sequence_logprobs(ids, positions)[0].detach()
    assert rel(results["flex"], results["sdpa"]) < 2e-2
    assert_training_lowers_the_loss(model, ids, positions)


def test_glm5_sparse_attention_memory_grows_linearly() -> None:
    """Forward + backward of one GLM-5-shaped latent attention layer (64 heads, ranks 2048/512,
    an indexer keeping 2,048 keys) at 8k and 16k tokens in one row: the sparse path's peak memory
    at most ~2× from doubling the tokens (the dense mask's grows ~4×)."""
    from tandem.models.layers.dsa import Indexer, TokenDocuments
    from tandem.models.layers.mla import LatentAttention
    from tandem.models.layers.rotary import RotaryEmbedding

    torch.manual_seed(0)
    with torch.device(CUDA):
        layer = LatentAttention(6144, 64, 2048, 512, 192, 64, 256, 0.0625, False,
                                Indexer(6144, 2048, 32, 128, 64, 2048), sparse=True).bfloat16()  # fmt: skip
        rotary = RotaryEmbedding(1.0 / (1e6 ** (torch.arange(0, 64, 2, device=CUDA).float() / 64)))
    peaks = []
    for width in (8192, 16384):
        positions = torch.arange(width, device=CUDA)[None]
        x = torch.randn(1, width, 6144, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
        cos, sin = rotary(positions, x.dtype)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out, _ = layer(x, cos, sin, TokenDocuments.from_positions(positions), None)
        out.float().square().mean().backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        del x, out
    assert peaks[1] < 2.6 * peaks[0], [p / 2**30 for p in peaks]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_glm5_sparse_scores_stay_fp32_on_cuda(compiled: bool) -> None:
    """GLM-5's sparse scores on CUDA (`bmm` with an fp32 output from bf16 inputs, its backward
    written by hand): the products equal float64's within fp32 rounding and the gradients the
    float64 ones of the bf16-rounded incoming gradient, eager and under torch.compile."""
    from tandem.models.layers.dsa import fp32_scores

    generator = torch.Generator(CUDA).manual_seed(3)
    q = (torch.randn(32, 64, 576, device=CUDA, generator=generator) * 2).bfloat16().requires_grad_()
    k = (torch.randn(32, 256, 576, device=CUDA, generator=generator) * 2).bfloat16().requires_grad_()
    scores = (torch.compile(fp32_scores) if compiled else fp32_scores)(q, k)
    exact = torch.bmm(q.double(), k.double().transpose(1, 2))
    assert scores.dtype == torch.float32
    assert (scores.double() - exact).abs().max() < 1e-5 * exact.abs().max()
    grad = torch.randn(scores.shape, device=CUDA, generator=generator)
    scores.backward(grad)
    g = grad.bfloat16().double()
    for got, want in ((q.grad, torch.bmm(g, k.double())), (k.grad, torch.bmm(g.transpose(1, 2), q.double()))):
        assert got.dtype == torch.bfloat16
        assert (got.double() - want).abs().max() < 1e-2 * want.abs().max()


@pytest.mark.parametrize("checkpointing", ["none", "selective"])
def test_bf16_glm_keeps_its_router_in_fp32_and_trains(tmp_path: Path, checkpointing: str) -> None:
    """model.dtype = bfloat16 on GLM-4.5: the router weight and its score-correction bias stay fp32
    (as transformers keeps them), the router an FSDP unit of its own inside the compiled block;
    the logprobs follow transformers' and five AdamW steps lower the loss."""
    path = build_tiny_model(
        out=tmp_path / "glm", family="glm4_moe", num_experts=8, moe_intermediate_size=64, num_layers=2,
    )  # fmt: skip
    world = init_distributed("cuda")
    model = build_trainer_model(
        ModelConfig(name=str(path), dtype="bfloat16"),
        world,
        ParallelConfig(activation_checkpointing=checkpointing),
    )
    routers = [m for n, m in model.named_modules() if n.endswith(".router")]
    assert routers and all(local(r.weight).dtype == torch.float32 for r in routers)
    assert all(r.e_score_correction_bias.dtype == torch.float32 for r in routers)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(CUDA)
    positions = packed_positions([[60, 68], [128]])
    ids = torch.randint(0, 500, positions.shape, device=CUDA, generator=torch.Generator(CUDA).manual_seed(0))
    logprobs, _ = model.sequence_logprobs(ids, positions)
    with torch.no_grad():
        want = reference(input_ids=ids[1:2]).logits.log_softmax(-1)[0, :-1].gather(1, ids[1, 1:, None])[:, 0]
    assert float((logprobs[1, 1:] - want).abs().mean()) < 0.05  # bf16 weights against fp32
    assert_training_lowers_the_loss(model, ids, positions)
