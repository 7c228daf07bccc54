"""The overlapped step loop (the next batch launched before this one's tokens are read back)
returns exactly what the plain loop returns: same tokens and logprobs with seeds, stops at
max_tokens, stop tokens and the context length, frees every block, and survives aborts and
finish_sample while a step is in flight."""

from pathlib import Path

import pytest

from tandem.inference.config import InferenceConfig
from tandem.inference.engine.api import SampleUpdate, SamplingParams
from tandem.inference.engine.core import EngineCore
from tandem.inference.engine.sequence import PLACEHOLDER

Requests = dict[str, tuple[list[int], SamplingParams, int]]


def make_core(model: Path, **engine: object) -> EngineCore:
    engine = {"kv_cache_memory_gb": 0.1, **engine}  # (on CUDA, not most of the device: several cores live)
    return EngineCore(InferenceConfig.model_validate({"model": {"name": str(model)}, "engine": engine}))


def run(core: EngineCore, requests: Requests, lookahead: bool) -> tuple[dict, dict, int]:
    """Step until done; (tokens by (request, index), finish reasons, steps taken)."""
    for rid, (ids, params, n) in requests.items():
        core.add_request(rid, ids, params, n)
    tokens: dict[tuple[str, int], SampleUpdate] = {}
    reasons: dict[tuple[str, int], str] = {}
    steps = 0
    while core.has_work():
        steps += 1
        assert steps < 2_000
        for rid, updates in core.step(lookahead=lookahead):
            for u in updates:
                assert (rid, u.index) not in reasons, "an update after the sample finished"
                tokens.setdefault((rid, u.index), SampleUpdate(u.index)).extend(u)
                if u.finish_reason:
                    reasons[(rid, u.index)] = u.finish_reason
    assert core.blocks.num_free == core.blocks.num_usable, "blocks leaked"
    assert not core.scheduler.running and not core.scheduler.waiting and not core.requests
    return tokens, reasons, steps


@pytest.fixture(scope="module")
def stop_token(tiny_model: Path) -> tuple[int, list[int]]:
    """A token that a seeded sample draws at its 6th position (and the sample's first tokens)."""
    core = make_core(tiny_model)
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=3)
    tokens, _, _ = run(core, {"probe": ([5, 6, 7, 8], params, 1)}, lookahead=False)
    drawn = tokens[("probe", 0)].token_ids
    return drawn[5], drawn[: drawn.index(drawn[5]) + 1]


def test_overlapped_steps_return_the_same_tokens_as_plain_steps(tiny_model: Path, stop_token) -> None:
    stop_id, until_stop = stop_token
    requests: Requests = {
        "one": ([5, 6, 7], SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True, seed=1), 1),
        "short": ([9, 10, 11, 12], SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True, seed=2), 3),
        "long": (
            list(range(3, 43)),
            SamplingParams(temperature=0.7, max_tokens=37, ignore_eos=True, seed=4),
            2,
        ),
        "greedy": ([20, 21], SamplingParams(temperature=0.0, max_tokens=19, ignore_eos=True), 1),
        "stops": (
            [5, 6, 7, 8],
            SamplingParams(
                temperature=1.0, max_tokens=24, ignore_eos=True, seed=3, stop_token_ids=(stop_id,)
            ),
            1,
        ),
        "fan1": ([30, 31, 32], SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True, seed=5), 4),
    }
    core = make_core(tiny_model, max_num_batched_tokens=32)  # prompts in chunks, steps mixed
    plain, plain_reasons, plain_steps = run(core, requests, lookahead=False)
    overlapped, reasons, steps = run(core, requests, lookahead=True)
    assert reasons == plain_reasons
    assert {key: v.token_ids for key, v in overlapped.items()} == {
        key: v.token_ids for key, v in plain.items()
    }
    for key, tokens in overlapped.items():
        assert tokens.logprobs == pytest.approx(plain[key].logprobs, abs=1e-5)
        assert PLACEHOLDER not in tokens.token_ids
    for (rid, _), tokens in overlapped.items():
        params = requests[rid][1]
        if rid != "stops":
            assert len(tokens.token_ids) == params.max_tokens and reasons[(rid, _)] == "length"
    assert overlapped[("stops", 0)].token_ids == until_stop and reasons[("stops", 0)] == "stop"
    assert steps <= plain_steps + 1


def test_context_length_ends_a_sample_on_time_while_overlapped(tiny_model: Path) -> None:
    core = make_core(tiny_model, max_model_len=40)
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    tokens, reasons, _ = run(core, {"r": (list(range(3, 33)), params, 2)}, lookahead=True)
    assert {k: len(v.token_ids) for k, v in tokens.items()} == {("r", 0): 10, ("r", 1): 10}
    assert set(reasons.values()) == {"length"}


def test_abort_and_finish_sample_while_a_step_is_in_flight(tiny_model: Path) -> None:
    core = make_core(tiny_model)
    params = SamplingParams(temperature=1.0, max_tokens=50, ignore_eos=True, seed=9)
    core.add_request("gone", [5, 6, 7], params, 2)
    core.add_request("cut", [8, 9], params, 2)
    core.add_request("kept", [10, 11, 12], params, 1)
    got: dict[tuple[str, int], list[int]] = {}
    reasons: dict[tuple[str, int], str] = {}

    def step() -> None:
        for rid, updates in core.step():
            assert rid != "gone" or not aborted, "updates of an aborted request"
            for u in updates:
                got.setdefault((rid, u.index), []).extend(u.token_ids)
                if u.finish_reason:
                    reasons[(rid, u.index)] = u.finish_reason

    aborted = False
    for _ in range(4):
        step()
    assert core._in_flight is not None  # the next step is on its way
    core.abort("gone")
    aborted = True
    core.finish_sample("cut", 1, "stop")
    cut_at = len(got[("cut", 1)])
    while core.has_work():
        step()
    assert core.blocks.num_free == core.blocks.num_usable
    assert reasons == {("cut", 0): "length", ("cut", 1): "stop", ("kept", 0): "length"}
    assert len(got[("cut", 1)]) == cut_at and len(got[("kept", 0)]) == 50


def test_a_stream_interval_sends_the_first_tokens_at_once_then_waits(tiny_model: Path) -> None:
    core = make_core(tiny_model)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    core.add_request("every", [5, 6, 7], params, 1)
    core.add_request("spaced", [5, 6, 8], params, 1, stream_interval_s=3600.0)
    sizes: dict[str, list[int]] = {"every": [], "spaced": []}
    while core.has_work():
        for rid, updates in core.step():
            sizes[rid].append(sum(len(u.token_ids) for u in updates))
    assert sum(sizes["every"]) == sum(sizes["spaced"]) == 30
    assert len(sizes["every"]) >= 29  # a delivery per step
    assert sizes["spaced"][0] == 1 and len(sizes["spaced"]) == 2  # the first token, then the rest at the end


def test_an_abort_while_the_prompts_last_step_is_in_flight_starts_no_samples(tiny_model: Path) -> None:
    # The step that finishes a prompt of n > 1 forks it into its samples when its tokens are read;
    # before, a request aborted while that step was in flight was still forked, and its samples ran
    # to max_tokens holding KV blocks (found by a randomized stress test of the core).
    core = make_core(tiny_model)
    params = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=3)
    core.add_request("kept", [5, 6, 7], params, 1)
    core.step()
    core.add_request("gone", list(range(3, 23)), params, 3)
    core.step()  # launches the next step, which prefills "gone", before reading this one's tokens
    assert core._in_flight is not None and core._in_flight.forks
    core.abort("gone")
    core.step()
    assert [s.request.request_id for s in core.scheduler.running + list(core.scheduler.waiting)] == ["kept"]
    (kept,) = core.scheduler.running
    assert core.blocks.num_usable - core.blocks.num_free == len(kept.block_table)
    _, reasons, _ = run(core, {}, lookahead=True)
    assert reasons == {("kept", 0): "length"}
