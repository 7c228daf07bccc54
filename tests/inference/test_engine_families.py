"""GLM-4.5, MiniMax-M2 and GLM-5 in the native engine equal transformers (CPU, float32).

One tiny model and one engine per family: random score-correction biases (and, for GLM-4.5,
grouped routing: 2 groups, the best one), a step budget of 16 tokens so the longest prompt is
prefilled in chunks over the cache, and for GLM-5 an indexer keeping 8 keys per query so the
sparse selection decides what is attended to (its second layer sharing the first's choice). Every greedy token is transformers' argmax
given the tokens before it (so the samples are its greedy output; one forward each, where
transformers' own generate is slow and, for GLM-5, breaks index-score ties unlike its forward),
and greedy and sampled tokens' logprobs equal transformers' within 1e-4. A config field the
engine does not implement is refused at load in one line.
"""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tandem.cli import UserError
from tandem.inference.config import InferenceConfig
from tandem.inference.engine.api import SampleUpdate, SamplingParams
from tandem.inference.engine.core import EngineCore
from tandem.models.tiny import build_tiny_model

TINY = {"num_layers": 2, "hidden_size": 64, "head_dim": 16, "intermediate_size": 128, "num_experts": 8,
        "moe_intermediate_size": 32}  # fmt: skip
SHAPES = {
    "Glm4MoeForCausalLM": {"family": "glm4_moe", **TINY},
    "MiniMaxM2ForCausalLM": {"family": "minimax_m2", **TINY},
    "GlmMoeDsaForCausalLM": {"family": "glm_moe_dsa", "index_topk": 8, **TINY},
}
PROMPTS = [[5, 6, 7], list(range(40, 49)), list(range(100, 130))]
NEW = 16


@pytest.fixture(scope="module", params=list(SHAPES))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = build_tiny_model(out=tmp_path_factory.mktemp("family") / "model", **SHAPES[request.param])
    config = AutoConfig.from_pretrained(path)
    if config.model_type == "glm4_moe":
        config.n_group, config.topk_group = 2, 1
    if config.model_type == "glm_moe_dsa":
        config.indexer_types = ["full", "shared"]  # layer 1 attends to what layer 0's indexer chose
    hf = AutoModelForCausalLM.from_pretrained(path, config=config)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.5)
    hf.save_pretrained(path)
    assert hf.config.architectures == [request.param]
    return path


def run(core: EngineCore, params: SamplingParams) -> dict[str, SampleUpdate]:
    for i, ids in enumerate(PROMPTS):
        core.add_request(str(i), ids, params, 2 if i == 1 else 1)
    out: dict[str, SampleUpdate] = {}
    while core.has_work():
        for rid, updates in core.step():
            for u in updates:
                out.setdefault(f"{rid}.{u.index}", SampleUpdate(u.index)).extend(u)
    return out


def test_greedy_and_logprobs_equal_transformers(model: Path) -> None:
    core = EngineCore(
        InferenceConfig.model_validate(
            {
                "model": {"name": str(model), "dtype": "float32"},
                "engine": {"kv_cache_memory_gb": 0.05, "max_num_batched_tokens": 16},
            }
        )  # fmt: skip
    )
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    greedy = run(core, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    sampled = run(core, SamplingParams(temperature=1.0, max_tokens=NEW, ignore_eos=True, seed=3))
    for kind, samples in (("greedy", greedy), ("sampled", sampled)):
        for key, tokens in samples.items():
            ids, completion = PROMPTS[int(key.split(".")[0])], tokens.token_ids
            with torch.no_grad():
                logprobs = (
                    hf(torch.tensor([ids + completion])).logits[0, len(ids) - 1 : -1].double().log_softmax(-1)
                )
            if kind == "greedy":  # each token transformers' argmax after the ones before: its greedy output
                assert logprobs.argmax(-1).tolist() == completion, key
            want = logprobs.gather(1, torch.tensor(completion)[:, None])[:, 0]
            got = torch.tensor(tokens.logprobs, dtype=torch.float64)
            assert torch.allclose(got, want, atol=1e-4, rtol=0), (kind, key, (got - want).abs().max())
    assert core.blocks.num_free == core.blocks.num_usable


def test_an_unsupported_config_field_is_refused_in_one_line(tmp_path: Path) -> None:
    path = build_tiny_model(out=tmp_path / "m", family="minimax_m2", num_experts=4, num_layers=1,
                            hidden_size=64, head_dim=16, moe_intermediate_size=32)  # fmt: skip
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "qk_norm_type": "per_head"}))
    with pytest.raises(UserError, match="config field qk_norm_type = 'per_head' is not supported") as error:
        EngineCore(
            InferenceConfig.model_validate(
                {"model": {"name": str(path)}, "engine": {"kv_cache_memory_gb": 0.05}}
            )
        )
    assert "\n" not in str(error.value)
