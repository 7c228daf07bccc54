"""Qwen3-MoE in the engine: the same numbers as the trainer's MoE layer, and weight updates from
checkpoints that name every expert's tensors."""

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tandem.inference.config import InferenceConfig
from tandem.inference.engine.api import SamplingParams
from tandem.inference.engine.core import EngineCore
from tandem.inference.engine.models.moe import SparseMoeBlock
from tandem.inference.engine.weights import read_checkpoint
from tandem.models.layers.moe import MoE
from tandem.models.qwen3_moe.model import router_spec
from tandem.models.tiny import build_tiny_model

SHAPE = {"num_experts": 8, "experts_per_token": 2, "moe_intermediate_size": 64, "num_layers": 2}


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(out=tmp_path_factory.mktemp("moe") / "step_0", **SHAPE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_block_computes_what_the_trainers_moe_layer_computes(moe_model: Path, dtype: torch.dtype) -> None:
    config = AutoConfig.from_pretrained(moe_model)
    torch.manual_seed(0)
    trainer = MoE(config.hidden_size, config.moe_intermediate_size, router_spec(config)).to(dtype)
    for p in trainer.parameters():
        p.data.normal_(std=0.1)
    block = SparseMoeBlock(config.hidden_size, config.moe_intermediate_size, router_spec(config)).to(dtype)
    block.gate.weight.data.copy_(trainer.router.weight)
    size = config.moe_intermediate_size
    for e, expert in enumerate(block.experts):
        expert.gate_proj.weight.data.copy_(trainer.experts.w_gate_up[e, :size])
        expert.up_proj.weight.data.copy_(trainer.experts.w_gate_up[e, size:])
        expert.down_proj.weight.data.copy_(trainer.experts.w_down[e])
    block.fuse()
    x = torch.randn(37, config.hidden_size, dtype=dtype)
    with torch.no_grad():
        assert torch.equal(block(x), trainer(x))


def greedy(core: EngineCore, ids: list[int]) -> list[int]:
    core.add_request("g", ids, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), 1)
    out = []
    while core.has_work():
        out += [t for _, updates in core.step() for u in updates for t in u.token_ids]
    return out


def hf_greedy(path: Path, ids: list[int]) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    return out[0, len(ids) :].tolist()


def test_a_checkpoint_with_per_expert_tensors_updates_the_experts(moe_model: Path, tmp_path: Path) -> None:
    other = build_tiny_model(out=tmp_path / "step_1", seed=1, **SHAPE)
    core = EngineCore(
        InferenceConfig.model_validate(
            {"model": {"name": str(moe_model), "dtype": "float32"}, "engine": {"kv_cache_memory_gb": 0.1}}
        )
    )
    ids = [5, 6, 7, 8, 9]
    assert greedy(core, ids) == hf_greedy(moe_model, ids)
    core.apply_weights(read_checkpoint(other, core.model), 1)  # transformers wrote experts.{e}.gate_proj ...
    assert greedy(core, ids) == hf_greedy(other, ids) != hf_greedy(moe_model, ids)
