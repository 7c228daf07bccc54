"""The prefix cache of the native engine (CPU, float32): a prompt that repeats or extends an earlier
one computes only its new tokens, and every answer equals the answer of an engine without it.

Each case runs the same requests, one after the other, through an engine with the cache and one
without, and compares token ids (exactly) and logprobs (to 1e-5: a cached prefix changes how
the prompt is split into chunks, not what is computed)."""

from pathlib import Path

import pytest
import torch
from test_engine_numerics import engine_config, run_sync
from transformers import AutoModelForCausalLM

from tandem.inference.engine.api import SampleUpdate, SamplingParams
from tandem.inference.engine.core import EngineCore
from tandem.inference.engine.model_runner import kv_bytes_per_block
from tandem.inference.engine.weights import read_checkpoint

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + 31 * i) % 300 + 10 for i in range(length)]


def serve(
    core: EngineCore, ids: list[int], params: SamplingParams = GREEDY, n: int = 1
) -> list[SampleUpdate]:
    """One request run to the end; its samples' tokens."""
    result = run_sync(core, {"r": (ids, params, n)})["tokens"]["r"]
    return [result[i] for i in range(n)]


def step_tokens(core: EngineCore) -> dict[str, list[int]]:
    """One engine step: the token ids it delivered, by request."""
    return {rid: [t for u in updates for t in u.token_ids] for rid, updates in core.step()}


def assert_same(got: list[SampleUpdate], want: list[SampleUpdate]) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5


@pytest.fixture(scope="module")
def engines(tiny_model: Path) -> tuple[EngineCore, EngineCore]:
    cached = EngineCore(engine_config(tiny_model, block_size=BLOCK))
    plain = EngineCore(engine_config(tiny_model, block_size=BLOCK, prefix_caching=False))
    return cached, plain


def hits(core: EngineCore, work) -> tuple[int, object]:  # noqa: ANN001
    before = core.blocks.hit_tokens_total
    result = work()
    return core.blocks.hit_tokens_total - before, result


def test_multi_turn_prompt_reuses_the_previous_turn(engines: tuple[EngineCore, EngineCore]) -> None:
    cached, plain = engines
    turn0 = prompt(1, 45)
    hit, first = hits(cached, lambda: serve(cached, turn0))
    assert hit == 0
    assert_same(first, serve(plain, turn0))
    # the next turn: the whole conversation so far plus the environment's reply
    turn1 = turn0 + first[0].token_ids + prompt(2, 9)  # 45 + 20 + 9 = 74 tokens
    hit, second = hits(cached, lambda: serve(cached, turn1))
    # the first turn computed 45 + 19 = 64 tokens' keys and values (the last sampled token was
    # never fed back): 4 full blocks are reusable
    assert hit == 4 * BLOCK
    assert_same(second, serve(plain, turn1))
    assert cached.blocks.num_free == cached.blocks.num_usable  # cached blocks count as free


def test_repeated_prompt_leaves_one_token_to_compute(engines: tuple[EngineCore, EngineCore]) -> None:
    cached, plain = engines
    ids = prompt(3, 2 * BLOCK)  # exactly two blocks: the second is recomputed for the logits
    serve(cached, ids)
    hit, again = hits(cached, lambda: serve(cached, ids, n=3))
    assert hit == BLOCK
    assert_same(again, serve(plain, ids, n=3))


def test_requests_admitted_together_share_their_prompt(engines: tuple[EngineCore, EngineCore]) -> None:
    """8 requests of one prompt in one step (what a client that does not use `n` sends): the
    first one's full blocks are registered as it is admitted, the other seven reuse them."""
    cached, plain = engines
    ids = prompt(7, 3 * BLOCK + 5)
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=3)
    requests = {f"s{i}": (ids, params, 1) for i in range(8)}
    hits, computed = cached.blocks.hit_tokens_total, cached.scheduler.prefill_tokens_total
    got = run_sync(cached, requests)["tokens"]
    assert cached.blocks.hit_tokens_total - hits == 7 * 3 * BLOCK
    assert cached.scheduler.prefill_tokens_total - computed == len(ids) + 7 * 5
    computed = plain.scheduler.prefill_tokens_total
    want = run_sync(plain, requests)["tokens"]
    assert plain.scheduler.prefill_tokens_total - computed == 8 * len(ids)
    for rid in requests:
        assert_same([got[rid][0]], [want[rid][0]])


def test_new_weights_make_the_cache_stale(
    engines: tuple[EngineCore, EngineCore], tiny_model: Path, tmp_path: Path
) -> None:
    cached, plain = engines
    ids = prompt(4, 50)
    serve(cached, ids)
    assert hits(cached, lambda: serve(cached, ids))[0] == 3 * BLOCK
    other = AutoModelForCausalLM.from_pretrained(tiny_model)
    for param in other.parameters():
        param.data.mul_(1.1)
    other.save_pretrained(tmp_path / "other")
    # a request that straddles the update: prefilled (and cached) with the old weights
    straddling = prompt(5, 40)
    cached.add_request("s", straddling, GREEDY, 1)
    tokens = {"s": [t for _ in range(3) for t in step_tokens(cached)["s"]]}
    try:
        for core in (cached, plain):
            core.apply_weights(read_checkpoint(tmp_path / "other", core.model), 1)
        # meanwhile a request on the new weights caches the straddling prompt's first two blocks
        cached.add_request("t", straddling[: 2 * BLOCK] + prompt(6, 10), GREEDY, 1)
        while cached.has_work():
            for rid, new in step_tokens(cached).items():
                tokens.setdefault(rid, []).extend(new)
        # the straddling request's later blocks mix two versions: only the new two may be reused
        hit, reply = hits(cached, lambda: serve(cached, straddling + tokens["s"]))
        assert hit == 2 * BLOCK
        assert_same(reply, serve(plain, straddling + tokens["s"]))
        hit, after = hits(cached, lambda: serve(cached, ids))
        assert hit == 0
        assert_same(after, serve(plain, ids))
        assert hits(cached, lambda: serve(cached, ids))[0] == 3 * BLOCK  # cached again, new weights
    finally:
        for core in (cached, plain):
            core.apply_weights(read_checkpoint(tiny_model, core.model), 0)


def test_eviction_under_a_small_cache_keeps_answers_right(tiny_model: Path) -> None:
    """6 conversations of 3 turns, run side by side in a 16-block cache with 32-token steps:
    cached blocks are evicted, reused and matched while samples get preempted, and every turn's
    answer still equals the answer of the same engine without the cache."""
    per_block = kv_bytes_per_block(
        AutoModelForCausalLM.from_pretrained(tiny_model).config, BLOCK, torch.float32
    )
    engine = {"block_size": BLOCK, "max_num_batched_tokens": 32, "kv_cache_memory_gb": 16 * per_block / 2**30}
    cached = EngineCore(engine_config(tiny_model, **engine))
    plain = EngineCore(engine_config(tiny_model, **engine, prefix_caching=False))
    assert cached.blocks.num_usable == 16
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    conversations = {f"c{i}": prompt(10 + i, 20 + 3 * i) for i in range(6)}
    for turn in range(3):
        requests = {cid: (ids, params, 1) for cid, ids in conversations.items()}
        got = run_sync(cached, requests)["tokens"]
        want = run_sync(plain, requests)["tokens"]
        for cid in conversations:
            assert_same([got[cid][0]], [want[cid][0]])
            conversations[cid] = conversations[cid] + got[cid][0].token_ids + prompt(turn, 4)
    assert cached.blocks.hit_tokens_total > 0
    assert cached.scheduler.num_preemptions > 0
    assert cached.blocks.num_free == cached.blocks.num_usable
    assert len(cached.blocks.evictable) + len(cached.blocks.free_blocks) == 16
