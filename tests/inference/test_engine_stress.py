"""Randomized stress test of `EngineCore` on CPU: random requests, aborts and finishes against a tight KV cache.

Each seed builds a small engine with random settings (block size, context length, max_num_seqs,
token budget, prefix cache and prompt graphs on or off) and a cache only a few blocks larger than
one full-length sequence, so preemption, eviction, chunked prefill and forking all happen. It then
runs a few hundred random actions: add requests (repeated and shared prefixes, next turns, n up to
4, greedy / seeded / sampled, stop ids, ignore_eos, whole responses, stream intervals), abort them
(before admission, mid-prefill, while decoding, while a step is in flight), `finish_sample`, load
the model's own weights (at once, or holding new requests until the engine is idle), and step with
or without lookahead, or drain. After every action it checks:

- the block manager: each block's refcount equals its users' count; free + evictable + used =
  usable; block 0 is never handed out; tables rows match block tables; waiting, finished and
  gone sequences hold no blocks; shared blocks hold the same tokens at the same position; the
  prefix cache maps (cached, block_keys, evictable) agree with each other and the tokens;
- the scheduler holds only live sequences of live requests (an aborted request forks nothing);
- the outputs: no update after a sample's finish or for an aborted request, at most max_tokens
  and no stop id but last, one update per sample for whole responses, no token after
  `finish_sample`, and an engine whose `has_work()` is False leaves no request unfinished;
- at the end, drained: every request finished, every block free, nothing left scheduled; and a
  greedy or seeded prompt gives the same tokens every time it is asked within the seed (where
  this CPU's products give a row the same bits in any batch: `rows_round_alike`).

It found two bugs (a request aborted while its prompt's last step was in flight was still
forked; a sample ended by `finish_sample` while waiting was never delivered by an idle engine).
"""

import math
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from tandem.inference.config import InferenceConfig
from tandem.inference.engine.api import SampleUpdate, SamplingParams
from tandem.inference.engine.core import EngineCore
from tandem.inference.engine.model_runner import kv_bytes_per_block, rows_round_alike
from tandem.inference.engine.sequence import PLACEHOLDER, Sequence, Status
from tandem.inference.engine.weights import read_checkpoint
from tandem.models.tiny import build_tiny_model

SEEDS = range(12)
STEPS = 400
SHAPE = {"num_layers": 2, "hidden_size": 64, "num_heads": 2, "num_kv_heads": 1, "head_dim": 32}


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tinier model than `tiny_model` (2 layers, width 64): the test is about bookkeeping."""
    out = tmp_path_factory.mktemp("model") / "tiny"
    return build_tiny_model(out=out, intermediate_size=128, max_position_embeddings=128, **SHAPE)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny matrices: one thread is faster, and leaves the other cores alone."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass
class Tracked:
    """What the test knows of one request: what it asked for and what it was delivered."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    n: int
    stream: bool
    interval: float
    seqs: list[Sequence]  # every sequence of it seen so far
    tokens: dict[int, list[int]] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)
    updates: Counter[int] = field(default_factory=Counter)
    cut: dict[int, int | None] = field(default_factory=dict)  # finish_sample: tokens by then (None: unknown)
    aborted: bool = False

    @property
    def live(self) -> bool:
        return not self.aborted and len(self.reasons) < self.n


class World:
    def __init__(self, seed: int, model: Path) -> None:
        rng = self.rng = random.Random(seed)
        hf = AutoConfig.from_pretrained(model)
        self.vocab = hf.vocab_size
        bs, mml = rng.choice([1, 2, 4, 8]), rng.choice([24, 32, 48, 64])
        usable = math.ceil(mml / bs) + rng.randint(0, 6)
        engine = {
            "kv_cache_memory_gb": (usable + 0.5) * kv_bytes_per_block(hf, bs, torch.float32) / 2**30,
            "block_size": bs,
            "max_model_len": mml,
            "max_num_seqs": rng.randint(1, 8),
            "max_num_batched_tokens": rng.choice([1, 2, 3, 5, 8, 13, 16, 32, 64]),
            "max_n": 4,
            "prefix_caching": rng.random() < 0.75,
            "prompt_graphs": rng.random() < 0.2,
        }
        model_cfg = {"name": str(model), "dtype": "float32"}
        cfg = {"model": model_cfg, "engine": engine, "seed": rng.randint(0, 99)}
        self.core = core = EngineCore(InferenceConfig.model_validate(cfg))
        assert core.blocks.num_usable == usable, engine
        self.tensors = read_checkpoint(model, core.model) if rng.random() < 0.5 else None
        self.eos = set(core.eos_token_ids)
        self.tracked: dict[str, Tracked] = {}
        self.prompts: list[list[int]] = []
        self.seen_tokens: list[int] = []
        self.reference: dict[tuple, list[int]] = {}  # greedy/seeded prompt → its longest tokens
        # (where this CPU's products round a row by batch size, the engine warns: tokens may differ)
        self.repeats_alike = rows_round_alike(core.runner.model)
        self.holding = False  # new requests held until the engine is idle, then weights load
        self.abort_p, self.finish_p = rng.choice([0.02, 0.08, 0.3]), rng.choice([0.02, 0.08, 0.3])
        self.adds = rng.choice([[0, 0, 1, 1, 1, 2, 4], [0, 0, 0, 0, 0, 1], [0] * 20 + [3]])
        self.interval_p = rng.choice([0.0, 0.3])

    def live(self) -> list[str]:
        return [rid for rid, t in self.tracked.items() if t.live]

    def pick(self, ids: list[str], *prefer: tuple[float, list[Sequence]]) -> str:
        """One of `ids`; with each probability in turn, one of those with a sequence in the list."""
        for p, seqs in prefer:
            among = [s.request.request_id for s in seqs if s.request.request_id in ids]
            if among and self.rng.random() < p:
                return self.rng.choice(among)
        return self.rng.choice(ids)

    # ---- actions -------------------------------------------------------------------------------

    def new_prompt(self) -> list[int]:
        rng, kind = self.rng, self.rng.random()
        length = rng.choice([0, 1, 2, 3, 5, 8, 15, 16, 17, 30, 40])
        fresh = [rng.randrange(3, self.vocab) for _ in range(length)]
        if self.prompts and kind < 0.25:
            prompt = list(rng.choice(self.prompts))  # a repeat
        elif self.prompts and kind < 0.6:  # a shared prefix
            base = rng.choice(self.prompts)
            prompt = base[: rng.randint(1, len(base))] + fresh[:12]
        elif self.tracked and kind < 0.75:  # a next turn: a prompt, one of its answers, more
            t = rng.choice(list(self.tracked.values()))
            answer = rng.choice(list(t.tokens.values())) if t.tokens else []
            prompt = t.prompt + answer + fresh[:4] + [5]
        else:
            prompt = fresh
        return prompt[: self.core.max_model_len - 1] or [5]

    def add(self) -> str:
        rng = self.rng
        rid = f"r{len(self.tracked)}"
        prompt = self.new_prompt()
        greedy = rng.random() < 0.5
        stop: tuple[int, ...] = ()
        if self.seen_tokens and rng.random() < 0.3:
            stop = tuple(rng.sample(self.seen_tokens, min(len(self.seen_tokens), rng.randint(1, 2))))
        seeded = not greedy and rng.random() < 0.6
        params = SamplingParams(
            temperature=0.0 if greedy else rng.choice([0.7, 1.0]),
            top_k=0 if greedy else rng.choice([0, 5]),
            max_tokens=rng.randint(1, 40),
            stop_token_ids=stop,
            ignore_eos=rng.random() < 0.7,
            seed=rng.choice([1, 2, 3]) if seeded else None,
            top_logprobs=rng.choice([0, 0, 0, 2]),
        )
        n, stream = rng.randint(1, 4), rng.random() < 0.85
        interval = 0.002 if stream and rng.random() < self.interval_p else 0.0
        self.core.add_request(rid, prompt, params, n, stream=stream, stream_interval_s=interval)
        if rng.random() < 0.5:
            self.prompts.append(prompt)
        seqs = list(self.core.requests[rid].sequences.values())
        self.tracked[rid] = Tracked(rid, prompt, params, n, stream, interval, seqs)
        return rid

    def abort(self, rid: str | None = None) -> None:
        ids, running = self.live(), self.core.scheduler.running
        if rid is None and ids:  # mostly a prompt not forked yet (its last step may be in flight)
            prompts = [s for s in running if s.fan_out > 1 or s.num_cached < s.num_prompt_tokens]
            rid = self.pick(ids, (0.5, prompts), (0.6, running))
        if rid is not None:
            self.core.abort(rid)
            self.tracked[rid].aborted = True

    def finish_sample(self, rid: str | None = None) -> None:
        ids, scheduler = self.live(), self.core.scheduler
        if rid is None and not ids:
            return
        if rid is None:  # mostly a running sample, else often a waiting one
            rid = self.pick(ids, (0.6, scheduler.running), (0.6, list(scheduler.waiting)))
        t = self.tracked[rid]
        i = self.rng.randrange(t.n)
        if i not in t.reasons:
            self.core.finish_sample(t.rid, i, "stop")
            t.cut.setdefault(i, len(t.tokens.get(i, [])) if t.stream and not t.interval else None)

    def load_held_weights(self) -> None:
        assert self.tensors is not None
        self.core.apply_weights(self.tensors, self.core.weight_version + 1)
        self.core.release_held()
        self.holding = False

    def step(self, drain: bool = False) -> None:
        core = self.core
        self.deliver(core.drain() if drain else core.step(lookahead=self.rng.random() < 0.85))
        self.check_blocks()

    # ---- checks --------------------------------------------------------------------------------

    def deliver(self, out: list[tuple[str, list[SampleUpdate]]]) -> None:
        for rid, updates in out:
            t = self.tracked[rid]
            assert t.live, f"update for {'aborted' if t.aborted else 'finished'} {rid}"
            for u in updates:
                assert 0 <= u.index < t.n and u.index not in t.reasons, (
                    f"{rid}/{u.index}: update after finish"
                )
                assert len(u.token_ids) == len(u.logprobs) == len(u.weight_versions)
                assert all(0 <= x < self.vocab for x in u.token_ids), u.token_ids
                assert t.stream or u.finish_reason is not None, f"{rid}: whole response before its finish"
                t.updates[u.index] += 1
                t.tokens.setdefault(u.index, []).extend(u.token_ids)
                self.seen_tokens.extend(u.token_ids[:2])
                if u.finish_reason is not None:
                    t.reasons[u.index] = u.finish_reason
                    self.check_sample(t, u.index)
            if not t.live:
                assert rid not in self.core.requests, f"{rid} done but still in the core"

    def check_sample(self, t: Tracked, i: int) -> None:
        p, toks, reason = t.params, t.tokens[i], t.reasons[i]
        cut = t.cut.get(i, -1)  # -1: not ended by finish_sample
        name = f"{t.rid}/{i} ({toks})"
        assert len(toks) <= p.max_tokens, f"{name}: more than max_tokens {p.max_tokens}"
        assert len(t.prompt) + len(toks) <= self.core.max_model_len, f"{name}: past the context"
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos)
        assert not stops & set(toks[:-1]), f"{name}: a stop token {stops} before the last"
        if reason == "length":
            assert len(toks) == p.max_tokens or len(t.prompt) + len(toks) == self.core.max_model_len, name
            assert not toks or toks[-1] not in stops, f"{name}: length, but it ends with a stop token"
        else:
            assert reason == "stop", f"{name}: finish reason {reason}"
            if cut == -1:
                assert toks and toks[-1] in stops, f"{name}: stop without a stop token"
            elif cut is not None:
                assert len(toks) == cut, f"{name}: {len(toks) - cut} tokens after finish_sample"
        assert t.stream or t.updates[i] == 1, f"{name}: whole response in {t.updates[i]} updates"
        if (
            cut == -1 and self.repeats_alike and (p.temperature == 0 or p.seed is not None)
        ):  # same prompt → same tokens
            key = (tuple(t.prompt), p.temperature, p.top_k, p.seed, i if p.seed is not None else 0)
            ref = self.reference.setdefault(key, toks)
            m = min(len(ref), len(toks))  # (a stop token or max_tokens may cut either short)
            assert ref[:m] == toks[:m], f"{name}: not the tokens of the same prompt before ({ref})"
            if len(toks) > len(ref):
                self.reference[key] = toks

    def check_blocks(self) -> None:
        core, bm = self.core, self.core.blocks
        seqs: dict[int, Sequence] = {}
        for r in core.requests.values():
            for s in r.sequences.values():
                seqs[id(s)] = s
                if all(x is not s for x in self.tracked[r.request_id].seqs):
                    self.tracked[r.request_id].seqs.append(s)
        for s in list(core.scheduler.running) + list(core.scheduler.waiting):
            name = f"scheduled {s.request.request_id}/{s.index}"
            assert core.requests.get(s.request.request_id) is s.request, f"{name}: request gone"
            assert s.request.sequences.get(s.index) is s and s.finish_reason is None, f"{name}: not live"
            seqs[id(s)] = s
        for t in self.tracked.values():  # sequences gone from the core hold nothing
            for s in t.seqs:
                if id(s) not in seqs:
                    assert not s.block_table and s.table_row < 0, f"gone {t.rid}/{s.index} holds blocks"
        counts: Counter[int] = Counter()
        users: dict[int, list[tuple[Sequence, int]]] = {}
        rows: set[int] = set()
        for s in seqs.values():
            bt = s.block_table
            assert len(set(bt)) == len(bt) and 0 not in bt, f"block table {bt}"
            if s.status is Status.WAITING or s.finish_reason is not None:
                assert not bt, f"{s.status} seq ({s.finish_reason}) holds blocks {bt}"
            if bt:
                assert s.table_row >= 0 and s.table_row not in rows, "table row missing or shared"
                rows.add(s.table_row)
                assert list(bm.tables[s.table_row, : len(bt)]) == bt, "tables row != block_table"
                assert len(bt) * bm.block_size >= s.num_cached, "more cached tokens than blocks"
            assert s.num_cached <= len(s.token_ids), "more cached tokens than tokens"
            for i, b in enumerate(bt):
                counts[b] += 1
                users.setdefault(b, []).append((s, i))
        free, evictable = set(bm.free_blocks), set(bm.evictable)
        assert not rows & set(bm.free_rows), "a used table row is also free"
        assert len(free) == len(bm.free_blocks) and not free & evictable and 0 not in free | evictable
        assert not free & set(bm.block_keys) and evictable <= set(bm.block_keys), "registration"
        assert len(bm.cached) == len(bm.block_keys), "cached and block_keys differ"
        assert all(bm.block_keys[b][0] == k for k, b in bm.cached.items()), "cached and block_keys differ"
        for b in range(1, bm.num_blocks):
            rc = bm.ref_counts[b]
            assert rc == counts[b], f"block {b}: refcount {rc}, {counts[b]} users"
            assert (rc == 0) == (b in free or b in evictable), f"block {b}: refcount {rc}, free state wrong"
        assert len(free) + len(evictable) + len(users) == bm.num_usable, "free + evictable + used != usable"
        for b, holders in users.items():
            assert len({i for _, i in holders}) == 1, f"block {b} at different table positions"
            i, size = holders[0][1], bm.block_size
            contents = set()
            for s, _ in holders:
                if (i + 1) * size <= s.num_cached:
                    toks = tuple(s.token_ids[i * size : (i + 1) * size])
                    if PLACEHOLDER not in toks:
                        contents.add(toks)
                else:  # the sequence writes into this block: it must be its own
                    assert len(holders) == 1, f"block {b} written by one of {len(holders)} users"
            assert len(contents) <= 1, f"shared block {b} holds different tokens {contents}"
            if b in bm.block_keys and contents:
                assert bm.block_keys[b][1] in contents, f"registered block {b}: key tokens != tokens"

    def check_not_stuck(self) -> None:
        core = self.core
        if not core.has_work():
            stuck = [r for r in self.live() if r in core.requests and core.requests[r] not in core.held]
            assert not stuck, f"engine idle (has_work() False) with live requests {stuck}"

    # ---- the run -------------------------------------------------------------------------------

    def run(self, steps: int) -> None:
        rng, core = self.rng, self.core
        for _ in range(steps):
            for _ in range(rng.choice(self.adds)):
                if len(self.live()) < 20:
                    self.add()
            if rng.random() < self.abort_p:
                self.abort()
            if rng.random() < self.finish_p:
                self.finish_sample()
            if rng.random() < 0.06:  # added, then aborted or one sample finished before any step
                rid, then = self.add(), rng.random()
                if then < 0.4:
                    self.abort(rid)
                elif then < 0.8:
                    self.finish_sample(rid)
            if self.tensors is not None and rng.random() < 0.02:
                if rng.random() < 0.5:
                    core.apply_weights(self.tensors, core.weight_version + 1)
                else:
                    core.hold_new = self.holding = True
            if self.holding and core.num_active_requests == 0:
                self.load_held_weights()
            self.check_blocks()
            if rng.random() < 0.05:
                self.step(drain=True)
            elif core.has_work():
                self.step()
            self.check_not_stuck()
        if self.holding:
            self.load_held_weights()
        for _ in range(5000):
            if not core.has_work():
                break
            self.step()
        assert not core.has_work() and not core.requests, f"not drained: {list(core.requests)}"
        unfinished = [t.rid for t in self.tracked.values() if t.live]
        assert not unfinished, f"never finished: {unfinished}"
        bm = core.blocks
        assert bm.num_free == bm.num_usable and not any(bm.ref_counts), "blocks held after draining"
        assert not core.scheduler.running and not core.scheduler.waiting, "scheduler not empty"


@pytest.mark.parametrize("seed", SEEDS)
def test_random_requests_keep_the_engine_consistent(small_model: Path, seed: int) -> None:
    World(seed, small_model).run(STEPS)
