"""A prompt's keys and values moved from one engine to another (kv_prefix.py; CPU, float32): the
importing engine computes only what it did not receive, answers as an engine that computed the
whole prompt, and refuses blocks that do not fit it, changing nothing."""

import time
from pathlib import Path

import pytest
import torch
from test_engine_families import SHAPES
from test_engine_numerics import FAMILIES, engine_config
from test_prefix_cache import BLOCK, assert_same, hits, prompt, serve
from transformers import AutoModelForCausalLM

from tandem.inference.engine.api import SamplingParams
from tandem.inference.engine.core import EngineCore
from tandem.inference.engine.model_runner import kv_bytes_per_block
from tandem.models.tiny import build_tiny_model


@pytest.fixture(scope="module")
def cores(tiny_model: Path) -> tuple[EngineCore, EngineCore, EngineCore]:
    """A prefill engine, a decode engine, and an engine without a prefix cache (the reference)."""
    return (
        EngineCore(engine_config(tiny_model, block_size=BLOCK)),
        EngineCore(engine_config(tiny_model, block_size=BLOCK)),
        EngineCore(engine_config(tiny_model, block_size=BLOCK, prefix_caching=False)),
    )


def prefill(core: EngineCore, ids: list[int]) -> None:
    serve(core, ids, SamplingParams(max_tokens=1))


def test_the_decode_engine_computes_only_the_last_tokens(cores: tuple[EngineCore, ...]) -> None:
    prefiller, decoder, plain = cores
    ids = prompt(1, 70)  # 4 reusable blocks of 16, then 6 tokens
    prefill(prefiller, ids)
    data = prefiller.export_prompt(ids, skip_tokens=0)
    assert decoder.cached_prompt_tokens(ids) == 0
    assert decoder.import_prompt(ids, data) == 4 * BLOCK
    computed = decoder.scheduler.prefill_tokens_total
    hit, reply = hits(decoder, lambda: serve(decoder, ids))
    assert hit == 4 * BLOCK
    assert decoder.scheduler.prefill_tokens_total - computed == 6
    assert_same(reply, serve(plain, ids))


def test_only_the_blocks_the_decode_engine_lacks_travel(cores: tuple[EngineCore, ...]) -> None:
    """A second turn: the decode engine holds the first turn's blocks, the export skips them."""
    prefiller, decoder, plain = cores
    first = prompt(2, 40)
    reply = serve(decoder, first)[0].token_ids  # the decode engine ran turn 1 itself
    second = first + reply + prompt(3, 30)  # 90 tokens: 5 reusable blocks
    held = decoder.cached_prompt_tokens(second)
    assert held == 3 * BLOCK  # turn 1's 60 tokens: 3 full blocks (the last token of a reply is not cached)
    prefill(prefiller, second)
    data = prefiller.export_prompt(second, skip_tokens=held)
    whole = prefiller.export_prompt(second, skip_tokens=0)
    assert len(data) < len(whole) * 0.5  # 2 of 5 blocks
    assert decoder.import_prompt(second, data) == 5 * BLOCK
    hit, got = hits(decoder, lambda: serve(decoder, second))
    assert hit == 5 * BLOCK
    assert_same(got, serve(plain, second))


def test_blocks_that_do_not_fit_are_refused_and_change_nothing(
    cores: tuple[EngineCore, ...], tiny_model: Path
) -> None:
    prefiller, decoder, _ = cores
    ids = prompt(4, 50)
    prefill(prefiller, ids)
    data = prefiller.export_prompt(ids, skip_tokens=0)
    registered = dict(decoder.blocks.cached)
    with pytest.raises(ValueError, match="other tokens"):
        decoder.import_prompt(prompt(5, 50), data)
    with pytest.raises(ValueError, match="other tokens"):
        decoder.import_prompt(ids[:30], data)  # blocks beyond what this prompt can reuse
    with pytest.raises(ValueError, match="not an exported prefix"):
        decoder.import_prompt(ids, b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(ValueError, match="not an exported prefix"):
        decoder.import_prompt(ids, data[: len(data) // 2])
    decoder.weight_version = 3
    try:
        with pytest.raises(ValueError, match="weight version 0"):
            decoder.import_prompt(ids, data)
    finally:
        decoder.weight_version = 0
    other = EngineCore(engine_config(tiny_model, block_size=8))
    with pytest.raises(ValueError, match="block size 16 there, 8 here"):
        other.import_prompt(ids, data)
    with pytest.raises(ValueError, match="multiple of the block size"):
        prefiller.export_prompt(ids, skip_tokens=5)
    assert decoder.blocks.cached == registered
    assert other.blocks.cached == {}


def test_a_full_cache_adopts_what_fits(tiny_model: Path, cores: tuple[EngineCore, ...]) -> None:
    """With every block held by a running request, nothing is adopted and the answer is still
    right; once the blocks are free (evictable), adoption takes them."""
    prefiller, _, plain = cores
    per_block = kv_bytes_per_block(
        AutoModelForCausalLM.from_pretrained(tiny_model).config, BLOCK, torch.float32
    )
    small = EngineCore(engine_config(tiny_model, block_size=BLOCK, kv_cache_memory_gb=16 * per_block / 2**30))
    assert small.blocks.num_usable == 16
    ids = prompt(6, 60)  # 3 reusable blocks
    prefill(prefiller, ids)
    data = prefiller.export_prompt(ids, skip_tokens=0)
    small.add_request("busy", prompt(7, 250), SamplingParams(max_tokens=6, ignore_eos=True), 1)
    small.step()  # its 16 blocks are taken
    assert small.blocks.num_free == 0
    assert small.import_prompt(ids, data) == 0
    while small.has_work():
        small.step()
    assert small.import_prompt(ids, data) == 3 * BLOCK
    hit, got = hits(small, lambda: serve(small, ids))
    assert hit == 3 * BLOCK
    assert_same(got, serve(plain, ids))


@pytest.mark.parametrize("family", ["Qwen3MoeForCausalLM", "GlmMoeDsaForCausalLM", "MiniMaxM2ForCausalLM"])
def test_every_cache_layout_moves(family: str, tmp_path: Path) -> None:
    """Other cache layouts: MoE (keys and values), latent attention (a latent and indexer keys)."""
    shape = {**FAMILIES, **SHAPES}[family]
    model = build_tiny_model(out=tmp_path / "model", **shape)
    prefiller, decoder, plain = (
        EngineCore(engine_config(model, block_size=BLOCK, prefix_caching=cached))
        for cached in (True, True, False)
    )
    ids = prompt(8, 40)
    prefill(prefiller, ids)
    assert decoder.import_prompt(ids, prefiller.export_prompt(ids, skip_tokens=0)) == 2 * BLOCK
    hit, got = hits(decoder, lambda: serve(decoder, ids))
    assert hit == 2 * BLOCK
    assert_same(got, serve(plain, ids))


def test_a_staging_buffer_carries_a_prompt(tiny_model: Path, cores: tuple[EngineCore, ...]) -> None:
    """kv_staging.py on CPU: the blocks packed into the prefill engine's shared memory, mapped and
    copied by the decode engine; too large, stale or malformed answers are refused."""
    prefiller, _, plain = cores
    decoder = EngineCore(engine_config(tiny_model, block_size=BLOCK))
    ids = prompt(9, 90)  # 5 reusable blocks
    prefill(prefiller, ids)
    try:
        staged = prefiller.export_prompt_staged(ids, 0, 1)
        assert staged["buffer"] == 1 and staged["token_ids"] == ids[: 5 * BLOCK]
        with pytest.raises(ValueError, match="waited more than 30 s"):
            decoder.import_prompt_staged(ids, {**staged, "received": time.monotonic() - 31})
        with pytest.raises(ValueError, match="not a dtype"):
            decoder.import_prompt_staged(
                ids, {**staged, "received": time.monotonic(), "parts": [[0, [1], "load"]]}
            )
        with pytest.raises(ValueError, match="outside the staging buffer"):
            decoder.import_prompt_staged(
                ids, {**staged, "received": time.monotonic(), "parts": [[1 << 40, [1], "float32"]]}
            )
        assert decoder.blocks.cached == {}
        assert decoder.import_prompt_staged(ids, {**staged, "received": time.monotonic()}) == 5 * BLOCK
        hit, got = hits(decoder, lambda: serve(decoder, ids))
        assert hit == 5 * BLOCK
        assert_same(got, serve(plain, ids))
        small = EngineCore(engine_config(tiny_model, block_size=BLOCK, prefix_caching=True))
        small.staging.nbytes = 1024
        prefill(small, ids)
        with pytest.raises(ValueError, match="do not fit a staging buffer of 1024"):
            small.export_prompt_staged(ids, 0, 0)
        small.close_staging()
    finally:
        prefiller.close_staging()
        decoder.close_staging()
