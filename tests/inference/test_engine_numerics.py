"""The native engine against transformers on a tiny model of every family (CPU, float32)."""

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.inference.config import InferenceConfig
from tandem.inference.engine import AsyncEngine
from tandem.inference.engine.api import SampleUpdate, SamplingParams
from tandem.inference.engine.core import EngineCore
from tandem.inference.engine.model_runner import kv_bytes_per_block
from tandem.inference.engine.models import ARCHITECTURES
from tandem.models.tiny import build_tiny_model

FAMILIES = {  # a tiny shape per architecture the engine serves (the rest of the shape: tiny.py's defaults)
    "Qwen3ForCausalLM": {},
    "Qwen3MoeForCausalLM": {"num_experts": 8, "experts_per_token": 2, "moe_intermediate_size": 64},
}
PROMPTS = ["hello world", "abc", "the quick brown fox jumps over the lazy dog", "x", "reverse: tandem"]


def engine_config(model: Path, **engine: object) -> InferenceConfig:
    engine = {"kv_cache_memory_gb": 0.25, **engine}  # (on CUDA, several engines live in one process)
    return InferenceConfig.model_validate(
        {"model": {"name": str(model), "dtype": "float32"}, "engine": engine}
    )


def run_sync(core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams, int]]) -> dict:
    """Add all requests, step until done; {request_id: {index: its tokens as one SampleUpdate}} and finish reasons."""
    for rid, (ids, params, n) in requests.items():
        core.add_request(rid, ids, params, n)
    out: dict[str, dict[int, SampleUpdate]] = {rid: {} for rid in requests}
    reasons: dict[tuple[str, int], str] = {}
    for _ in range(10_000):
        if not core.has_work():
            break
        for rid, updates in core.step():
            for u in updates:
                out[rid].setdefault(u.index, SampleUpdate(u.index)).extend(u)
                if u.finish_reason:
                    reasons[(rid, u.index)] = u.finish_reason
    assert not core.has_work()
    return {"tokens": out, "reasons": reasons}


def test_every_architecture_has_a_tiny_shape_here() -> None:
    """(The GLM and MiniMax families have a lighter check of their own: test_engine_families.py.)"""
    from test_engine_families import SHAPES

    assert set(FAMILIES) | set(SHAPES) == set(ARCHITECTURES)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = build_tiny_model(out=tmp_path_factory.mktemp("family") / "model", **FAMILIES[request.param])
    assert AutoModelForCausalLM.from_pretrained(path).config.architectures == [request.param]
    return path


@pytest.fixture(scope="module")
def hf_model(family_model: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(family_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def core(family_model: Path) -> EngineCore:
    return EngineCore(engine_config(family_model, max_num_batched_tokens=64))


def hf_greedy(hf_model: torch.nn.Module, ids: list[int], new: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None
        )
    return out[0, len(ids) :].tolist()


def hf_logprobs(
    hf_model: torch.nn.Module, ids: list[int], completion: list[int], temperature: float
) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids + completion])).logits[0].double()
    logprobs = torch.log_softmax(logits[len(ids) - 1 : -1] / temperature, dim=-1)
    return logprobs.gather(1, torch.tensor(completion)[:, None])[:, 0]


def test_greedy_matches_transformers_batched_with_shared_prompts(core, hf_model) -> None:
    tok = core.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    requests = {f"r{i}": (tok.encode(p), params, 3 if i % 2 else 1) for i, p in enumerate(PROMPTS)}
    result = run_sync(core, requests)["tokens"]
    for rid, (ids, _, n) in requests.items():
        expected = hf_greedy(hf_model, ids, 24)
        assert sorted(result[rid]) == list(range(n))
        for index in range(n):
            assert result[rid][index].token_ids == expected, (rid, index)
    assert core.blocks.num_free == core.blocks.num_usable  # everything freed


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_logprobs_match_transformers_forward(core, hf_model, temperature: float) -> None:
    tok = core.tokenizer
    params = SamplingParams(temperature=temperature, max_tokens=20, ignore_eos=True, seed=7, top_logprobs=3)
    requests = {f"p{i}": (tok.encode(p), params, 2) for i, p in enumerate(PROMPTS[:3])}
    result = run_sync(core, requests)["tokens"]
    for rid, (ids, _, n) in requests.items():
        for index in range(n):
            tokens = result[rid][index]
            completion = tokens.token_ids
            reference = hf_logprobs(hf_model, ids, completion, temperature or 1.0)
            got = torch.tensor(tokens.logprobs, dtype=torch.float64)
            assert torch.allclose(got, reference, atol=1e-4, rtol=0), (got - reference).abs().max()
            # alternatives: the 3 best tokens of the same distribution, best first
            first = tokens.top_logprobs[0]
            assert len(first) == 3 and first[0][1] >= first[1][1] >= first[2][1]
            if temperature == 0.0:
                assert first[0][0] == completion[0]


def test_chunked_prefill_and_preemption_keep_greedy_outputs(family_model, hf_model) -> None:
    """A 16-block cache and 8-token steps: prompts are prefilled in chunks and running samples
    get preempted and recomputed, yet every sample equals transformers' greedy output."""
    per_block = kv_bytes_per_block(hf_model.config, 16, torch.float32)
    cfg = engine_config(family_model, max_num_batched_tokens=8, kv_cache_memory_gb=16 * per_block / 2**30)
    core = EngineCore(cfg)
    assert core.blocks.num_usable == 16
    tok = core.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    long_prompt = "a long prompt that takes several chunks to prefill"
    requests = {f"r{i}": (tok.encode(p), params, 2) for i, p in enumerate([*PROMPTS[:3], long_prompt])}
    result = run_sync(core, requests)["tokens"]
    assert core.scheduler.num_preemptions > 0
    for rid, (ids, _, n) in requests.items():
        expected = hf_greedy(hf_model, ids, 40)
        for index in range(n):
            assert result[rid][index].token_ids == expected, (rid, index)
    assert core.blocks.num_free == core.blocks.num_usable


def test_async_engine_streams_and_stops(family_model, hf_model) -> None:
    async def main() -> tuple[dict[int, list[SampleUpdate]], list[int]]:
        engine = AsyncEngine(engine_config(family_model))
        try:
            ids = engine.tokenizer.encode("hello")
            expected = hf_greedy(hf_model, ids, 12)
            stop_at = expected[5]
            params = SamplingParams(
                temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=(stop_at,)
            )
            updates: dict[int, list[SampleUpdate]] = {}
            async for u in engine.generate("a", ids, params, n=2):
                updates.setdefault(u.index, []).append(u)
            return updates, expected
        finally:
            await engine.shutdown()

    updates, expected = asyncio.run(main())
    stop = expected.index(expected[5]) + 1
    for index in (0, 1):
        tokens = [t for u in updates[index] for t in u.token_ids]
        assert tokens == expected[:stop]
        assert updates[index][-1].finish_reason == "stop"
        assert all(u.finish_reason is None for u in updates[index][:-1])


def test_a_one_token_prompt_chunk_next_to_decodes(family_model, hf_model) -> None:
    """A step budget of 4 with three samples decoding leaves one token for a new prompt: that
    step holds only one-token rows, yet the prompt's row is a chunk, not a decode."""
    core = EngineCore(engine_config(family_model, max_num_batched_tokens=4))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    early = {f"e{i}": ([5 + i, 6, 7], params, 1) for i in range(3)}
    for rid, (ids, p, n) in early.items():
        core.add_request(rid, ids, p, n)
    got: dict[str, list[int]] = {}

    def step() -> None:
        for rid, updates in core.step(lookahead=False):
            got.setdefault(rid, []).extend(t for u in updates for t in u.token_ids)

    for _ in range(4):
        step()
    late = list(range(20, 30))
    core.add_request("late", late, params, 1)
    while core.has_work():
        step()
    for rid, (ids, _, _) in {**early, "late": (late, params, 1)}.items():
        assert got[rid] == hf_greedy(hf_model, ids, 16), rid


def test_prompts_of_one_length_beside_decodes(family_model, hf_model) -> None:
    """A step's rows are its decodes, then its whole prompts: three prompts of one length that
    join two running samples fill a 32-token step and are attended as a view of their rows (no
    padded batch); a longer prompt that waited runs alone beside five decodes next."""
    core = EngineCore(engine_config(family_model, max_num_batched_tokens=32))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    requests = {"e0": list(range(5, 12)), "e1": list(range(40, 49))}
    got: dict[str, list[int]] = {}

    def step() -> None:
        for rid, updates in core.step(lookahead=False):
            got.setdefault(rid, []).extend(t for u in updates for t in u.token_ids)

    for rid, ids in requests.items():
        core.add_request(rid, ids, params, 1)
    step()
    step()
    late = {f"l{i}": [60 + i] + list(range(70, 79)) for i in range(3)} | {"long": list(range(90, 110))}
    for rid, ids in late.items():
        core.add_request(rid, ids, params, 1)
    while core.has_work():
        step()
    for rid, ids in {**requests, **late}.items():
        assert got[rid] == hf_greedy(hf_model, ids, 12), rid


def test_a_prompt_that_fits_the_next_step_waits_instead_of_splitting(family_model, hf_model) -> None:
    """A 32-token step with a 20-token prompt in it: a second 20-token prompt waits for the next
    step (whole), while a 40-token prompt, which no step holds, is split as before; the tokens
    are transformers' either way."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    cases = {
        "fits": {"a": list(range(3, 23)), "b": list(range(30, 50))},
        "too long": {"a": list(range(3, 23)), "c": list(range(60, 100))},
    }
    for case, requests in cases.items():
        core = EngineCore(engine_config(family_model, max_num_batched_tokens=32))
        for rid, ids in requests.items():
            core.add_request(rid, ids, params, 1)
        got: dict[str, list[int]] = {}

        def step(core: EngineCore = core, got: dict = got) -> None:
            for rid, updates in core.step(lookahead=False):
                got.setdefault(rid, []).extend(t for u in updates for t in u.token_ids)

        step()
        cached = sorted(s.num_cached for s in core.scheduler.running)
        if case == "fits":
            assert cached == [20] and len(core.scheduler.waiting) == 1, cached
        else:
            assert cached == [12, 20] and not core.scheduler.waiting, cached
        while core.has_work():
            step()
        for rid, ids in requests.items():
            assert got[rid] == hf_greedy(hf_model, ids, 6), (case, rid)


def test_varlen_prompts_match_the_padded_batch(family_model: Path) -> None:
    """engine.prompt_attention = varlen lays whole prompts out as segments of the step's rows (one
    SDPA call per prompt on CPU) instead of a padded batch: the same greedy tokens and logprobs in a
    step of prompts alone, in steps where prompts join running decodes, and beside prefix-cache hits
    (chunks) in a second round that extends the first round's prompts."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [list(range(3, 3 + n)) for n in (37, 5, 20, 50, 1, 33)]
    rounds = [
        {f"a{i}": (ids, params, 1) for i, ids in enumerate(prompts)},
        {f"b{i}": (ids + [7, 8, 9] if i % 2 else ids[::-1], params, 1) for i, ids in enumerate(prompts)},
    ]
    runs = {}
    for attention in ("auto", "varlen"):
        core = EngineCore(engine_config(family_model, max_num_batched_tokens=64, prompt_attention=attention))
        runs[attention] = [run_sync(core, requests)["tokens"] for requests in rounds]
        assert core.blocks.hit_tokens_total >= 48  # round 2's extended prompts: 3 full blocks of 16
    for padded, varlen in zip(runs["auto"], runs["varlen"], strict=True):
        for rid, samples in padded.items():
            want, got = samples[0], varlen[rid][0]
            assert got.token_ids == want.token_ids, rid
            assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True)) < 1e-4, rid
