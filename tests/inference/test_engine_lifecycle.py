"""AsyncEngine lifecycle: block sharing, abort, pause/resume, weight updates, bad input."""

import asyncio
import contextlib
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tandem.inference.config import InferenceConfig
from tandem.inference.engine import AsyncEngine
from tandem.inference.engine.api import SampleUpdate, SamplingParams, WeightLoadError, WeightUpdateConflict
from tandem.inference.engine.core import EngineCore
from tandem.inference.engine.model_runner import kv_bytes_per_block
from tandem.models.tiny import build_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def config(model: Path, **engine: object) -> InferenceConfig:
    """float32 and a small KV cache everywhere (on CUDA several engines live in one process)."""
    engine = {"kv_cache_memory_gb": 0.25, **engine}
    return InferenceConfig.model_validate(
        {"model": {"name": str(model), "dtype": "float32"}, "engine": engine}
    )


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same shapes as `tiny_model`, different random weights, in a step_N directory."""
    return build_tiny_model(out=tmp_path_factory.mktemp("weights") / "step_5", seed=1)


def hf_greedy(path: Path, ids: list[int], new: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None
        )
    return out[0, len(ids) :].tolist()


async def collect(engine: AsyncEngine, rid: str, ids: list[int], params: SamplingParams, n: int = 1):
    updates: dict[int, list[SampleUpdate]] = {}
    async for u in engine.generate(rid, ids, params, n):
        updates.setdefault(u.index, []).append(u)
    return updates


def token_ids(updates: list[SampleUpdate]) -> list[int]:
    return [t for u in updates for t in u.token_ids]


async def wait_until(condition, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def test_samples_share_the_prompts_full_blocks(tiny_model: Path) -> None:
    core = EngineCore(config(tiny_model))
    prompt = list(range(3, 43))  # 40 tokens: 2 full blocks of 16 and a partial one
    core.add_request("r", prompt, GREEDY, n=4)
    core.step()  # prefill once, fork into 4 samples
    assert len(core.scheduler.running) == 4
    assert core.blocks.num_usable - core.blocks.num_free == 2 + 4  # shared full blocks + 4 partial ones
    shared = core.scheduler.running[0].block_table[:2]
    assert all(s.block_table[:2] == shared for s in core.scheduler.running)
    assert all(core.blocks.ref_counts[b] == 4 for b in shared)
    while core.has_work():
        core.step()
    assert core.blocks.num_free == core.blocks.num_usable


def test_prompts_not_yet_forked_count_their_samples_against_max_num_seqs(tiny_model: Path) -> None:
    # A prompt stays one running sequence until its prefill forks it into n samples; admission
    # counts it as n (before: 5 prompts of n = 4 joined one step, 20 rows where 8 were allowed;
    # in an RL run 256 rows overflowed the sampler's max_num_seqs + max_n).
    core = EngineCore(config(tiny_model, max_num_seqs=8, max_n=4))
    for i in range(6):
        core.add_request(f"r{i}", list(range(3 + i, 13 + i)), GREEDY, n=4)
    most = 0
    while core.has_work():
        core.step()
        most = max(most, len(core.scheduler.running))
    assert most <= 8
    assert core.blocks.num_free == core.blocks.num_usable


def test_abort_pause_resume_and_finish_sample(tiny_model: Path) -> None:
    async def main() -> None:
        engine = AsyncEngine(config(tiny_model))
        try:
            long = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
            ids = engine.tokenizer.encode("abort me")
            async with contextlib.aclosing(engine.generate("long", ids, long, n=2)) as stream:
                async for u in stream:
                    if u.index == 0 and u.token_ids and engine.stats().generated_tokens_total > 6:
                        break
            await wait_until(lambda: engine.stats().kv_blocks_used == 0 and engine.stats().running == 0)

            await engine.pause()
            task = asyncio.create_task(collect(engine, "p", ids, GREEDY))
            paused_at = engine.stats().generated_tokens_total
            await asyncio.sleep(0.3)
            assert engine.stats().paused and not task.done()
            assert engine.stats().generated_tokens_total == paused_at
            assert engine.stats().waiting == 1
            await engine.resume()
            updates = await asyncio.wait_for(task, 30)
            assert len(token_ids(updates[0])) == 12

            before = engine.stats().generated_tokens_total
            await asyncio.sleep(0.2)
            assert engine.stats().generated_tokens_total == before  # idle: nothing runs

            stream = engine.generate(
                "f", ids, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), n=2
            )
            first = await anext(stream)
            await engine.finish_sample("f", 1 - first.index, "stop")
            updates = [first] + [u async for u in stream]
            reasons = {u.index: u.finish_reason for u in updates if u.finish_reason}
            assert reasons == {1 - first.index: "stop", first.index: "length"}
            stopped = [t for u in updates if u.index != first.index for t in u.token_ids]
            assert len(stopped) < 40
            await engine.finish_sample("f", first.index, "abort")  # request gone: a no-op
        finally:
            await engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), 120))


def test_bad_requests_raise_value_errors(tiny_model: Path) -> None:
    async def main() -> None:
        engine = AsyncEngine(config(tiny_model, max_model_len=64))
        try:
            cases = [([], 1), ([5] * 64, 1), ([5], 0), ([5], 1000), ([10_000], 1)]
            for ids, n in cases:
                with pytest.raises(ValueError):
                    await collect(engine, "bad", ids, GREEDY, n)
            updates = await collect(engine, "ok", [5] * 60, GREEDY)  # stops at the context length
            assert len(token_ids(updates[0])) == 4 and updates[0][-1].finish_reason == "length"
        finally:
            await engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_weight_update_finish_old_and_bad_checkpoints(
    tiny_model: Path, other_model: Path, tmp_path: Path
) -> None:
    ids = [7, 8, 9, 10, 11]
    old_expected, new_expected = hf_greedy(tiny_model, ids, 12), hf_greedy(other_model, ids, 12)
    assert old_expected != new_expected

    corrupt = tmp_path / "corrupt"
    shutil.copytree(other_model, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    wrong_shape = tmp_path / "wrong_shape"
    wrong_shape.mkdir()
    tensors = load_file(other_model / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, wrong_shape / "model.safetensors")
    missing_tensor = tmp_path / "missing_tensor"
    missing_tensor.mkdir()
    save_file(
        {k: v for k, v in tensors.items() if "layers.0." not in k}, missing_tensor / "model.safetensors"
    )

    async def main() -> None:
        engine = AsyncEngine(config(tiny_model))
        try:
            for bad in (tmp_path / "nope", corrupt, wrong_shape, missing_tensor):
                with pytest.raises(WeightLoadError):
                    await engine.update_weights(bad)
                assert engine.weight_version == 0
                assert token_ids((await collect(engine, "x", ids, GREEDY))[0]) == old_expected

            long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
            stream = engine.generate("inflight", ids, long)
            first = await anext(stream)
            assert await engine.update_weights(other_model) == 5  # version from step_5
            rest = [u async for u in stream]
            versions = [v for u in [first, *rest] for v in u.weight_versions]
            assert versions[0] == 0 and versions[-1] == 5 and versions == sorted(versions)

            updates = await collect(engine, "y", ids, GREEDY)
            assert token_ids(updates[0]) == new_expected
            assert {v for u in updates[0] for v in u.weight_versions} == {5}
        finally:
            await engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), 120))


def test_weight_update_wait_mode_lets_running_requests_finish(tiny_model: Path, other_model: Path) -> None:
    async def main() -> None:
        engine = AsyncEngine(config(tiny_model, weight_update_mode="wait"))
        try:
            ids = [7, 8, 9]
            running = asyncio.create_task(
                collect(engine, "old", ids, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
            )
            await wait_until(lambda: engine.stats().generated_tokens_total > 0)
            update = asyncio.create_task(engine.update_weights(other_model, version=3))
            await asyncio.sleep(0.05)
            later = asyncio.create_task(collect(engine, "new", ids, GREEDY))
            stopped = engine.generate("held", ids, GREEDY)  # held back, then finished before it starts
            held_task = asyncio.create_task(anext(stopped))
            await wait_until(lambda: engine.stats().waiting == 2)
            await engine.finish_sample("held", 0, "stop")
            assert (await asyncio.wait_for(held_task, 30)).finish_reason == "stop"
            await stopped.aclose()
            old_updates = await asyncio.wait_for(running, 60)
            assert await asyncio.wait_for(update, 60) == 3
            assert {v for u in old_updates[0] for v in u.weight_versions} == {0}
            new_updates = await asyncio.wait_for(later, 60)
            assert {v for u in new_updates[0] for v in u.weight_versions} == {3}
        finally:
            await engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), 120))


def test_a_wait_mode_update_while_paused_with_requests_running_is_refused(
    tiny_model: Path, other_model: Path
) -> None:
    """It would wait for requests a paused engine never finishes (the caller hung, and the update
    landed later on its own); refused at once, the old weights live, and accepted once resumed."""

    async def main() -> None:
        engine = AsyncEngine(config(tiny_model, weight_update_mode="wait"))
        try:
            params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
            running = asyncio.create_task(collect(engine, "r", [7, 8, 9], params))
            await wait_until(lambda: engine.stats().generated_tokens_total > 0)
            await engine.pause()
            with pytest.raises(WeightUpdateConflict, match=r"paused with 1 running request\(s\)"):
                await asyncio.wait_for(engine.update_weights(other_model, version=3), 30)
            assert engine.weight_version == 0
            await engine.resume()
            assert await asyncio.wait_for(engine.update_weights(other_model, version=3), 60) == 3
            updates = await asyncio.wait_for(running, 60)
            assert {v for u in updates[0] for v in u.weight_versions} == {0}
        finally:
            await engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), 120))


def test_context_is_capped_by_the_cache_so_a_lone_sequence_always_fits(tiny_model: Path) -> None:
    per_block = kv_bytes_per_block(AutoModelForCausalLM.from_pretrained(tiny_model).config, 16, torch.float32)
    core = EngineCore(config(tiny_model, kv_cache_memory_gb=16 * per_block / 2**30))
    assert core.max_model_len == 16 * 16
    core.add_request(
        "r", list(range(3, 13)), SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True), 1
    )
    tokens, reason = 0, None
    for _ in range(400):
        for _, updates in core.step():
            tokens += sum(len(u.token_ids) for u in updates)
            reason = updates[-1].finish_reason or reason
        if not core.has_work():
            break
    assert (tokens, reason) == (256 - 10, "length")


def test_whole_response_requests_arrive_once_with_the_same_tokens(tiny_model: Path) -> None:
    """stream=False holds a request's tokens on the engine thread and delivers one update per
    sample when the whole request has finished; the tokens equal the streamed ones."""
    seeded = SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True, seed=7)
    short = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    async def main() -> None:
        engine = AsyncEngine(config(tiny_model, max_n=4))
        try:
            streamed = await collect(engine, "s", [5, 6, 7], seeded, 3)
            whole: dict[int, list[SampleUpdate]] = {}
            other = asyncio.create_task(collect(engine, "short", [9, 10], short))
            async for u in engine.generate("w", [5, 6, 7], seeded, 3, stream=False):
                whole.setdefault(u.index, []).append(u)
            assert (await other)[0][-1].finish_reason == "length"
        finally:
            await engine.shutdown()
        assert all(len(updates) > 1 for updates in streamed.values())
        assert sorted(whole) == [0, 1, 2]
        for index, updates in whole.items():
            assert len(updates) == 1 and updates[0].finish_reason == "length"
            assert token_ids(updates) == token_ids(streamed[index])
            streamed_logprobs = [lp for u in streamed[index] for lp in u.logprobs]
            # (another batch composition: equal up to float32 rounding)
            assert updates[0].logprobs == pytest.approx(streamed_logprobs, abs=1e-5)

    asyncio.run(main())


def test_a_slow_consumer_gets_the_steps_it_missed_merged(tiny_model: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    async def main() -> None:
        engine = AsyncEngine(config(tiny_model))
        try:
            expected = token_ids((await collect(engine, "fast", [5, 6, 7], params))[0])
            sizes, got = [], []
            total = engine.stats().generated_tokens_total + 40
            async for u in engine.generate("slow", [5, 6, 7], params):
                sizes.append(len(u.token_ids))
                got += u.token_ids
                if len(sizes) == 1:  # all steps queued meanwhile (the last one handed over too)
                    await wait_until(lambda: engine.stats().generated_tokens_total >= total)
                    await asyncio.sleep(0.1)
        finally:
            await engine.shutdown()
        assert got == expected
        assert len(sizes) <= 2 and sizes[-1] > 1  # (the first update may already hold several steps)

    asyncio.run(main())


def test_a_sample_finished_while_waiting_is_delivered_by_an_idle_engine(tiny_model: Path) -> None:
    # finish_sample of a sample that waits for a step (not started, or preempted) ends it at once;
    # before, with nothing else to run, has_work() was False, so no step delivered its end and
    # the request stayed in the core (found by a randomized stress test of the core).
    core = EngineCore(config(tiny_model))
    core.add_request("r", [5, 6, 7], GREEDY, n=1)
    core.finish_sample("r", 0, "stop")
    assert core.has_work()
    ((rid, (update,)),) = core.step()
    assert (rid, update.index, update.token_ids, update.finish_reason) == ("r", 0, [], "stop")
    assert not core.has_work() and not core.requests
