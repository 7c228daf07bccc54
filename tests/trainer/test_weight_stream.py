"""iter_hf_weights on an FSDP2-sharded model (a world of one): Hugging Face names in module order,
full tensors cast to the serving dtype, the tied head left out, and specs that match one to one."""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tandem.models.tiny import build_tiny_model
from tandem.trainer.parallel import apply_fsdp, init_distributed, mixed_precision, shutdown
from tandem.trainer.weight_stream import hf_weight_specs, iter_hf_weights


def test_full_tensors_per_layer_with_matching_specs(tmp_path: Path) -> None:
    path = build_tiny_model(
        out=tmp_path / "m", num_layers=2, hidden_size=64, head_dim=16, intermediate_size=128
    )
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    world = init_distributed("cpu")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        apply_fsdp(model, mixed_precision(world.device, torch.float32))
        specs = hf_weight_specs(model, torch.bfloat16)
        tensors = list(iter_hf_weights(model, torch.bfloat16))
    finally:
        shutdown()
    names = [name for name, _ in tensors]
    assert names == [s.name for s in specs] and "lm_head.weight" not in names  # tied to the embedding
    assert names[0] == "model.embed_tokens.weight" and names[-1] == "model.norm.weight"
    assert set(names) == set(reference) - {"lm_head.weight"}
    for spec, (name, tensor) in zip(specs, tensors, strict=True):
        assert tensor.shape == spec.shape and tensor.dtype == spec.dtype == torch.bfloat16
        assert not hasattr(tensor, "placements")  # a plain tensor, not a DTensor shard
        assert torch.equal(tensor, reference[name].to(torch.bfloat16)), name


def test_tandem_models_stream_checkpoint_tensors(tmp_path: Path) -> None:
    """tandem's Qwen3-MoE: fused q/k/v and stacked experts come out as the checkpoint's own tensors."""
    from safetensors.torch import load_file

    from tandem.config.base import ModelConfig
    from tandem.trainer.config import ParallelConfig
    from tandem.trainer.model import build_trainer_model

    path = build_tiny_model(
        out=tmp_path / "moe", num_layers=2, hidden_size=64, head_dim=16, intermediate_size=128,
        num_experts=4, moe_intermediate_size=32,
    )  # fmt: skip
    checkpoint = load_file(path / "model.safetensors")
    world = init_distributed("cpu")
    try:
        model = build_trainer_model(ModelConfig(name=str(path), device="cpu"), world, ParallelConfig())
        specs = hf_weight_specs(model, torch.bfloat16)
        tensors = dict(iter_hf_weights(model, torch.bfloat16))
    finally:
        shutdown()
    assert [s.name for s in specs] == list(tensors)
    assert set(tensors) == set(checkpoint) - {"lm_head.weight"}
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in tensors
    for spec in specs:
        assert tensors[spec.name].shape == spec.shape and tensors[spec.name].dtype == torch.bfloat16
        assert torch.equal(tensors[spec.name], checkpoint[spec.name].to(torch.bfloat16)), spec.name
