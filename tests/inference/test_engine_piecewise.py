"""Steps with prompts run as pieces between attention calls (`engine.prompt_graphs`, piecewise.py)
give what the plain forward gives. On CPU the pieces run eagerly over the padded rows of their
bucket; the CUDA graphs of the same pieces are checked in tests/gpu/test_engine_cuda.py."""

from pathlib import Path

import pytest
from test_engine_families import SHAPES
from test_engine_numerics import FAMILIES, engine_config, run_sync

from tandem.inference.engine.api import SamplingParams
from tandem.inference.engine.core import EngineCore
from tandem.inference.engine.piecewise import token_buckets
from tandem.models.tiny import build_tiny_model

# every family over the shared attention: per-head q/k norm (Qwen3), MoE MLPs, partial rotary (GLM-4.5),
# q/k norm over the whole projection (MiniMax-M2)
SPLITTING = {**FAMILIES, **{name: SHAPES[name] for name in ("Glm4MoeForCausalLM", "MiniMaxM2ForCausalLM")}}


@pytest.fixture(scope="module", params=list(SPLITTING))
def family_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(out=tmp_path_factory.mktemp("family") / "model", **SPLITTING[request.param])


def test_pieces_are_off_by_default_on_cpu(family_model: Path) -> None:
    """On by default only on CUDA (where the graphs pay); asked for, they run on CPU too."""
    assert EngineCore(engine_config(family_model, max_num_batched_tokens=64)).runner.piecewise is None
    asked = EngineCore(engine_config(family_model, max_num_batched_tokens=64, prompt_graphs=True))
    assert asked.runner.piecewise is not None


def test_token_buckets_cover_the_step_budget() -> None:
    assert token_buckets(8192) == [16, 32, 64, 128, 256, 512, *range(1024, 8192, 512), 8192]
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(600) == [16, 32, 64, 128, 256, 512, 600]
    assert token_buckets(10) == [10]


def test_prompt_steps_as_pieces_match_the_plain_forward(family_model: Path) -> None:
    """Prompts alone, prompts joining running decodes (sampled at temperature 1, so their input
    tokens are fed from the previous step's draws on the device), n = 3 samples, and a second round
    whose prompts extend the first round's (prefix-cache hits: chunks over the cache): the same
    tokens and logprobs with and without pieces, and the pieces ran at padded buckets."""
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True, seed=11)
    prompts = [list(range(3, 3 + n)) for n in (37, 5, 20, 50, 1, 33)]
    rounds = [
        {f"a{i}": (ids, greedy if i % 2 else sampled, 3 if i == 2 else 1) for i, ids in enumerate(prompts)},
        {f"b{i}": (ids + [7, 8, 9] if i % 2 else ids[::-1], sampled, 1) for i, ids in enumerate(prompts)},
    ]
    runs = {}
    for pieces in (False, True):
        core = EngineCore(engine_config(family_model, max_num_batched_tokens=64, prompt_graphs=pieces))
        runs[pieces] = []
        for requests in rounds:
            runs[pieces].append(run_sync(core, requests)["tokens"])
        assert core.blocks.hit_tokens_total >= 48  # round 2's extended prompts: 3 full blocks of 16
        if pieces:
            used = sorted(core.runner.piecewise.buckets)
            assert used and all(size in token_buckets(64) for size in used), used
            assert any(size < 64 for size in used), used  # a step of fewer rows ran at a smaller bucket
        else:
            assert core.runner.piecewise is None
    for plain, pieced in zip(runs[False], runs[True], strict=True):
        assert plain.keys() == pieced.keys()
        for rid, samples in plain.items():
            for index, want in samples.items():
                got = pieced[rid][index]
                assert got.token_ids == want.token_ids, (rid, index)
                diff = max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True))
                assert diff < 1e-5, (rid, index, diff)


def test_models_that_do_not_split_run_without_pieces(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """GLM-5's latent attention has no q/k/v of the shared kind: prompt_graphs is refused with a
    warning that says why, and the engine serves as without it."""
    model = build_tiny_model(out=tmp_path / "glm5", **SHAPES["GlmMoeDsaForCausalLM"])
    with caplog.at_level("WARNING", logger="tandem.inference"):
        core = EngineCore(engine_config(model, max_num_batched_tokens=64, prompt_graphs=True))
    assert core.runner.piecewise is None
    assert "do not split at attention" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="tandem.inference"):  # by default: no pieces on CPU, no warning
        assert EngineCore(engine_config(model, max_num_batched_tokens=64)).runner.piecewise is None
    assert "prompt_graphs" not in caplog.text
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    result = run_sync(core, {"r": ([5, 6, 7], params, 1)})["tokens"]
    assert len(result["r"][0].token_ids) == 3
