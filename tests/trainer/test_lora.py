"""LoRA in the trainer: only the adapters train and only they are in the optimizer state; the
saved adapter is PEFT's and, loaded with `peft` onto the transformers base model, gives the
trainer's outputs (tandem's fused model and transformers' model alike); two FSDP ranks train
the adapters exactly like one, and a LoRA run resumes on another world size from checkpoints
that hold only the adapters and their optimizer state."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from peft import PeftModel
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from tandem.cli import UserError
from tandem.config import build_config
from tandem.config.base import ModelConfig
from tandem.config.loader import split_args
from tandem.models.loading import load_tokenizer
from tandem.monitor.metrics import read_metrics
from tandem.trainer.config import LoRAConfig, OptimConfig, ParallelConfig
from tandem.trainer.hf_export import write_hf_model
from tandem.trainer.model import build_trainer_model
from tandem.trainer.optim import build_optimizer
from tandem.trainer.parallel import init_distributed
from tandem.trainer.sft.config import SFTConfig
from tandem.trainer.sft.train import train

sys.path.insert(0, str(Path(__file__).parent))
from test_sft_helpers import ENV, sft_args, tiny_model  # noqa: E402

LORA = LoRAConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"])


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("lora"))


def reference_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    return logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]


@pytest.mark.parametrize("impl", ["tandem", "hf"])
def test_only_adapters_train_and_the_saved_adapter_loads_in_peft(
    impl: str, base: Path, tmp_path: Path
) -> None:
    world = init_distributed("cpu")
    model = build_trainer_model(
        ModelConfig(name=str(base), device="cpu", impl=impl), world, ParallelConfig(), lora=LORA
    )
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith((".lora_a", ".lora_b")) for n in trainable)
    adapters = [p for n, p in model.named_parameters() if n in trainable]
    assert all(isinstance(p, DTensor) and p.placements[0].is_shard(0) for p in adapters)  # FSDP2 shards them
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2))
    ids = torch.randint(0, 400, (2, 16))
    positions = torch.arange(16).expand(2, 16)
    for _ in range(2):  # the first step moves B off zero, the second then moves A as well
        logprobs, _ = model.sequence_logprobs(ids, positions)
        (-logprobs.sum()).backward()
        optimizer.step()
        optimizer.zero_grad()
    state_of = {id(p): n for n, p in model.named_parameters()}
    assert {state_of[id(p)] for p in optimizer.state} == trainable
    for name, param in model.named_parameters():
        changed = not torch.equal(param.detach(), before[name])
        assert changed == (name in trainable), name

    write_hf_model(model, load_tokenizer(str(base)), tmp_path / "adapter", world)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA"
    names = set(load_file(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in names
    assert not any("k_proj" in n or "gate_proj" in n for n in names)  # not targeted
    assert len(names) == 2 * 5 * 2  # A and B of 5 modules in each of 2 layers
    with torch.no_grad():
        trained, _ = model.sequence_logprobs(ids, positions)
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), tmp_path / "adapter"
    )
    torch.testing.assert_close(trained[:, 1:], reference_logprobs(peft_model, ids), rtol=0, atol=2e-5)
    untrained = reference_logprobs(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), ids)
    assert (trained[:, 1:] - untrained).abs().max() > 1e-3  # the adapter changed the outputs


def test_two_ranks_match_one_and_resume_on_another_world_size(base: Path, tmp_path: Path) -> None:
    lora = {"lora.rank": 4, "lora.alpha": 8, "optim.max-grad-norm": 0.5, "ckpt.interval": 1}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    two = subprocess.Popen(
        [*launch, "-m", "tandem.trainer.sft.cli", *sft_args(base, tmp_path / "resumed", steps=1, **lora)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=ENV,
    )
    _, overrides, _ = split_args(sft_args(base, tmp_path / "one", steps=2, **lora))
    train(build_config(SFTConfig, overrides=overrides))
    out, _ = two.communicate(timeout=400)
    assert two.returncode == 0, out[-3000:]
    assert "(2 ranks)" in out

    stored = set(
        dcp.FileSystemReader(tmp_path / "resumed" / "checkpoints" / "step_1" / "dcp")
        .read_metadata()
        .state_dict_metadata
    )
    assert stored and all(
        ".lora_a" in k or ".lora_b" in k or k.startswith("optimizer.param_groups") for k in stored
    ), stored
    assert any(k.startswith("optimizer.state.") for k in stored)
    _, overrides, _ = split_args([*sft_args(base, tmp_path / "resumed", steps=2, **lora), "--resume"])
    train(build_config(SFTConfig, overrides=overrides))

    one = read_metrics(tmp_path / "one" / "metrics.jsonl", "sft")
    resumed = read_metrics(tmp_path / "resumed" / "metrics.jsonl", "sft")
    assert [r["step"] for r in resumed] == [1, 2]
    for a, b in zip(one, resumed, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5, (a, b)
    expected = load_file(tmp_path / "one" / "final" / "adapter_model.safetensors")
    got = load_file(tmp_path / "resumed" / "final" / "adapter_model.safetensors")
    assert expected.keys() == got.keys()
    assert all(t.abs().max() > 0 for n, t in expected.items() if "lora_B" in n)  # B left zero: it trained
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-5)
    # final-merged is the base with the adapter merged: what peft gives with the adapter
    ids = torch.randint(0, 400, (2, 16))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "one" / "final-merged", dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), tmp_path / "one" / "final"
    )
    torch.testing.assert_close(
        reference_logprobs(merged, ids), reference_logprobs(peft_model, ids), rtol=0, atol=2e-5
    )


@pytest.mark.parametrize(
    ("targets", "problem"),
    [(["nope"], "matches no linear module"), (".*", "matches the output head lm_head")],
)
def test_targets_that_match_nothing_or_the_head_stop_at_start(
    targets: object, problem: str, base: Path
) -> None:
    lora = LoRAConfig(target_modules=targets)
    with pytest.raises(UserError, match=problem):
        build_trainer_model(
            ModelConfig(name=str(base), device="cpu", impl="hf"),
            init_distributed("cpu"),
            ParallelConfig(),
            lora=lora,
        )


def test_a_transformers_moe_model_merges_into_the_checkpoints_own_tensors(tmp_path: Path, capsys) -> None:
    """model.impl = 'hf' on a MoE family: transformers' loader fuses the experts, so the merged
    export and the weight streams put the checkpoint's names and shapes back (they wrote the fused
    names, which transformers' loader dropped), and keep the router's score-correction bias (a
    buffer: it was left out, and a reload routed with zeros)."""
    from safetensors.torch import save_file

    from tandem.models.tiny import build_tiny_model
    from tandem.trainer.weight_stream import hf_weight_specs, iter_hf_weights

    base = build_tiny_model(
        out=tmp_path / "glm", family="glm4_moe", num_experts=4, num_layers=2, hidden_size=64,
        head_dim=16, intermediate_size=128,
    )  # fmt: skip
    tensors = load_file(base / "model.safetensors")
    biases = [n for n in tensors if n.endswith("e_score_correction_bias")]
    assert biases
    for name in biases:
        tensors[name] = torch.randn_like(tensors[name])  # (a real checkpoint's are not zero)
    save_file(tensors, base / "model.safetensors", {"format": "pt"})
    world = init_distributed("cpu")
    lora = LoRAConfig(rank=2, alpha=4.0, target_modules=["q_proj", "v_proj"])
    model = build_trainer_model(
        ModelConfig(name=str(base), device="cpu", impl="hf"), world, ParallelConfig(), lora=lora
    )
    for name, param in model.named_parameters():
        if name.endswith(".lora_b"):
            param.data.normal_()  # (a trained adapter)
    streamed = dict(iter_hf_weights(model))
    assert set(streamed) == set(tensors)  # what a weight update sends: the checkpoint's names
    assert [(s.name, s.shape) for s in hf_weight_specs(model, torch.float32)] == [
        (n, tuple(t.shape)) for n, t in streamed.items()
    ]
    write_hf_model(model, load_tokenizer(str(base)), tmp_path / "merged", world, merged=True)
    written = load_file(tmp_path / "merged" / "model.safetensors")
    assert set(written) == set(tensors)
    for name in tensors:
        changed = not torch.equal(written[name].float(), tensors[name].float())
        assert changed == name.endswith(("q_proj.weight", "v_proj.weight")), name
    ids = torch.randint(0, 400, (2, 16))
    with torch.no_grad():
        trained, _ = model.sequence_logprobs(ids, torch.arange(16).expand(2, 16))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    torch.testing.assert_close(trained[:, 1:], reference_logprobs(reloaded, ids), rtol=0, atol=2e-5)
    assert "warning" not in capsys.readouterr().out  # attention targets: peft loads them as they are
    mlp = LoRAConfig(rank=2, alpha=4.0, target_modules=["gate_proj", "up_proj"])
    build_trainer_model(ModelConfig(name=str(base), device="cpu"), world, ParallelConfig(), lora=mlp)
    assert "trainer: warning: LoRA on gate_proj, up_proj of a MoE model" in capsys.readouterr().out
