"""The sampler: exact distribution, filters, seeds; and seeded sampling through the engine."""

from pathlib import Path

import pytest
import torch

from tandem.inference.config import InferenceConfig
from tandem.inference.engine.api import SampleUpdate, SamplingParams
from tandem.inference.engine.core import EngineCore
from tandem.inference.engine.model_runner import rows_round_alike
from tandem.inference.engine.sampler import SamplingBatch, sample, sample_key


def batch_of(rows: int, **kw: object) -> SamplingBatch:
    base = {"temperatures": [1.0], "top_ps": [1.0], "top_ks": [0], "min_ps": [0.0]}
    base.update({k: [v] for k, v in kw.items()})
    return SamplingBatch(
        **{k: v * rows for k, v in base.items()},
        keys=[sample_key(123, i) for i in range(rows)],
        positions=[5] * rows,
    )


@pytest.mark.parametrize("seeded", [True, False])
def test_draws_follow_the_softmax_distribution(seeded: bool) -> None:
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    rows = 20_000
    batch = batch_of(rows)
    if not seeded:
        batch.keys = [None] * rows
        batch.generator = torch.Generator().manual_seed(0)
    result = sample(probs.log().expand(rows, -1).contiguous(), batch)
    freq = torch.bincount(torch.tensor(result.token_ids), minlength=4).double() / rows
    assert torch.allclose(freq, probs.double(), atol=0.015), freq
    assert result.logprobs[0] == pytest.approx(probs.log()[result.token_ids[0]].item(), abs=1e-6)


@pytest.mark.parametrize(
    ("filters", "allowed"),
    [({"top_k": 2}, {0, 1}), ({"top_p": 0.7}, {0, 1}), ({"min_p": 0.4}, {0, 1}), ({"top_p": 0.1}, {0})],
)
def test_filters_restrict_the_support(filters: dict, allowed: set[int]) -> None:
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    rows = 2_000
    result = sample(
        probs.log().expand(rows, -1).contiguous(), batch_of(rows, **{f + "s": v for f, v in filters.items()})
    )
    assert set(result.token_ids) == allowed
    # logprobs are of the unfiltered tempered distribution, not the renormalised one
    assert result.logprobs[result.token_ids.index(0)] == pytest.approx(probs[0].log().item(), abs=1e-6)


def test_temperature_scales_logprobs_and_greedy_rows_take_argmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0]])
    batch = SamplingBatch([0.5, 0.0], [1.0, 1.0], [0, 0], [0.0, 0.0], [1, 2], [3, 3])
    result = sample(logits, batch)
    assert result.token_ids[1] == 1
    expected = torch.log_softmax(logits[0] / 0.5, dim=-1)[result.token_ids[0]].item()
    assert result.logprobs[0] == pytest.approx(expected, abs=1e-6)
    assert result.logprobs[1] == pytest.approx(torch.log_softmax(logits[1], -1)[1].item(), abs=1e-6)


def test_noise_depends_on_seed_sample_and_position_only() -> None:
    logits = torch.zeros(4, 50)
    keys = [sample_key(1, 0), sample_key(1, 1), sample_key(2, 0), sample_key(1, 0)]
    rows = SamplingBatch([1.0] * 4, [1.0] * 4, [0] * 4, [0.0] * 4, keys, [9, 9, 9, 10])
    a = sample(logits, rows).token_ids
    b = sample(logits[:1], SamplingBatch([1.0], [1.0], [0], [0.0], keys[:1], [9])).token_ids
    assert a[0] == b[0]
    assert len(set(a)) > 2


def _outputs(core: EngineCore, requests: dict) -> dict[str, dict[int, SampleUpdate]]:
    for rid, (ids, params, n) in requests.items():
        core.add_request(rid, ids, params, n)
    out: dict[str, dict[int, SampleUpdate]] = {rid: {} for rid in requests}
    while core.has_work():
        for rid, updates in core.step():
            for u in updates:
                out[rid].setdefault(u.index, SampleUpdate(u.index)).extend(u)
    return out


def _tokens(core: EngineCore, requests: dict) -> dict[str, dict[int, list[int]]]:
    outputs = _outputs(core, requests)
    return {rid: {i: u.token_ids for i, u in out.items()} for rid, out in outputs.items()}


def test_seeded_sampling_is_reproducible_across_batches(tiny_model: Path) -> None:
    config = {"model": {"name": str(tiny_model)}, "engine": {"kv_cache_memory_gb": 0.25}}
    core = EngineCore(InferenceConfig.model_validate(config))
    ids = core.tokenizer.encode("seeded sampling")
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, ignore_eos=True, seed=42)
    alone = _tokens(core, {"a": (ids, params, 3)})["a"]
    other = SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True, seed=1)
    crowded = _tokens(core, {"x": (core.tokenizer.encode("noise"), other, 2), "a": (ids, params, 3)})["a"]
    assert alone == crowded
    assert len({tuple(v) for v in alone.values()}) == 3  # the n samples differ from each other
    reseeded = _tokens(core, {"a": (ids, SamplingParams(**{**params.__dict__, "seed": 43}), 3)})["a"]
    assert reseeded != alone


def test_one_cpu_thread_gives_logprobs_independent_of_the_batch(tiny_model: Path) -> None:
    """What a reproducible run needs (docs/async.md): on one CPU thread a sequence's logprobs are
    the same bits alone, with one or two others (decode steps of 2-3 rows) or with many."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        config = {
            "model": {"name": str(tiny_model)},
            "engine": {"kv_cache_memory_gb": 0.25, "prefix_caching": False},
        }
        core = EngineCore(InferenceConfig.model_validate(config))
        if not rows_round_alike(core.runner.model):
            pytest.skip(
                "this CPU's matrix products round a row by batch size (rows_round_alike): see docs/async.md"
            )
        ids = core.tokenizer.encode("the same bits")
        params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=7)
        other = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=3)
        crowds = [{}, {"x": (core.tokenizer.encode("one other"), other, 1)}]
        crowds.append({"x": (core.tokenizer.encode("many others"), other, 6), "y": (ids[:3], other, 2)})
        runs = [_outputs(core, {**crowd, "a": (ids, params, 1)})["a"][0] for crowd in crowds]
        for run in runs[1:]:
            assert (run.token_ids, run.logprobs) == (runs[0].token_ids, runs[0].logprobs)
    finally:
        torch.set_num_threads(threads)
