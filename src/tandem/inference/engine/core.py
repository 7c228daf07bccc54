"""The synchronous engine: requests in, one `step()` at a time, token updates out.

`CoreLoop` (loop.py) drives this from a thread of the server (engine.py) or of an engine process
(process.py); tests and benchmarks may call it directly. A step schedules a batch, runs the model, samples, forks the n samples of prompts that
just finished prefilling, appends tokens, and finishes samples that hit a stop condition.
"""

import importlib.util
import itertools
import random
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from tandem.inference.config import InferenceConfig
from tandem.inference.engine.api import (
    FinishReason,
    RequestLimits,
    SampleUpdate,
    SamplingParams,
)
from tandem.inference.engine.block_manager import BlockManager
from tandem.inference.engine.fp8 import check_device as check_fp8_device
from tandem.inference.engine.model_runner import Feed, ModelRunner, RunOutput, kv_cache_blocks
from tandem.inference.engine.models import build_model
from tandem.inference.engine.prompt_transfer import PromptTransfer
from tandem.inference.engine.sampler import (
    PendingSample,
    SampleResult,
    SamplingRows,
    launch_sample,
    sample_key,
    sampling_batch,
    sampling_rows,
)
from tandem.inference.engine.scheduler import ScheduledBatch, Scheduler
from tandem.inference.engine.sequence import PLACEHOLDER, Request, Sequence, Status
from tandem.inference.engine.transfer import to_device
from tandem.inference.engine.weights import apply_checkpoint
from tandem.models.loading import load_model, load_tokenizer, resolve_device, resolve_dtype


class EngineCore(PromptTransfer):
    def __init__(self, config: InferenceConfig) -> None:
        cfg = config.engine
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        if cfg.quantization == "fp8":
            check_fp8_device(self.device, cfg.fp8_kernel)  # (before loading the model: fail fast)
        self.tokenizer = load_tokenizer(config.model.name)
        hf_model = load_model(config.model, self.device)
        model_max = getattr(hf_model.config, "max_position_embeddings", None) or 4096
        self.max_model_len = min(cfg.max_model_len or model_max, model_max)
        self.model = build_model(
            hf_model, self.max_model_len, cfg.triton_kernels, cfg.quantization, cfg.fp8_kernel
        )
        self.vocab_size = hf_model.config.vocab_size
        self.eos_token_ids = _eos_ids(hf_model, self.tokenizer)
        self.eos_table = np.zeros(self.vocab_size, dtype=bool)  # token id → is an EOS id
        self.eos_table[[t for t in self.eos_token_ids if 0 <= t < self.vocab_size]] = True
        del hf_model
        self.block_size = cfg.block_size
        num_blocks = kv_cache_blocks(config, self.model.config, self.dtype, self.device, self.max_model_len)
        self.runner = ModelRunner(
            self.model,
            num_blocks,
            cfg.block_size,
            self.device,
            self.dtype,
            cfg.cuda_graphs,
            cfg.max_num_seqs,
            max_rows=cfg.max_num_seqs + cfg.max_n,  # a step draws at most this many rows (scheduler.py)
            prompt_attention=cfg.prompt_attention,
            prompt_graphs=cfg.prompt_graphs,
            max_tokens=cfg.max_num_batched_tokens,
        )
        self.blocks = BlockManager(
            num_blocks, cfg.block_size, -(-self.max_model_len // cfg.block_size), cfg.prefix_caching
        )
        # one sequence must always fit in the whole cache, or preemption could not make room for it
        self.max_model_len = min(self.max_model_len, self.blocks.num_usable * cfg.block_size)
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.limits = RequestLimits(
            cfg.max_n, self.max_model_len, self.blocks.num_usable * cfg.block_size, self.vocab_size
        )
        self.requests: dict[str, Request] = {}
        self.held: list[Request] = []  # added while new work is held back (a weight update waits)
        self.hold_new = False
        self.weight_version = 0
        self.generated_tokens_total = 0
        self.prompt_tokens_total = 0
        self.num_steps = 0
        self._arrivals = itertools.count()
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        # one-pass sampling on CUDA (triton_sample.py); its unseeded rows take a seed per step
        self.fused_sampling = (
            self.device.type == "cuda"
            and cfg.triton_kernels
            and importlib.util.find_spec("triton") is not None
        )
        self._noise = random.Random(config.seed)
        self._plan: _DecodePlan | None = None  # the per-row constants of the last decode batch
        self.timings = {"schedule": 0.0, "model": 0.0, "sample": 0.0, "append": 0.0}
        self._in_flight: _Launched | None = None  # the step queued on the device, tokens not read yet
        self._touched: dict[str, Request] = {}  # requests with undelivered updates
        self.init_prompt_transfer(config.prefill)

    # ---- requests ----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        n: int,
        stream: bool = True,
        stream_interval_s: float = 0.0,
    ) -> None:
        """With `stream=False` the request's updates are held until all its samples have
        finished, then delivered as one update per sample; with `stream_interval_s`, a
        streaming request's tokens are delivered at most that often (the first ones at once)."""
        self.limits.check(prompt_token_ids, params, n)
        if request_id in self.requests:
            raise ValueError(f"request id '{request_id}' is already running")
        keys = [None if params.seed is None else sample_key(params.seed, i) for i in range(n)]
        request = Request(request_id, list(prompt_token_ids), params, n, keys, next(self._arrivals), stream)
        request.stream_interval = stream_interval_s
        seq = Sequence(request, 0, list(prompt_token_ids), len(prompt_token_ids), fan_out=n)
        request.sequences[0] = seq
        self.requests[request_id] = request
        self.prompt_tokens_total += len(prompt_token_ids)
        if self.hold_new:
            self.held.append(request)
        else:
            self.scheduler.add(seq)

    def release_held(self) -> None:
        self.hold_new = False
        for request in self.held:
            if request.request_id in self.requests and 0 in request.sequences:  # not finished meanwhile
                self.scheduler.add(request.sequences[0])
        self.held.clear()

    def abort(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.sequences.values():
            seq.finish_reason = "abort"
            self.scheduler.remove(seq)
        request.sequences.clear()
        if request in self.held:
            self.held.remove(request)

    def finish_sample(self, request_id: str, index: int, reason: FinishReason) -> None:
        request = self.requests.get(request_id)
        if request is None or index in request.finished or not 0 <= index < request.n:
            return
        seq = request.sequences.get(index)
        if seq is None or seq.fan_out > 1:  # not forked yet: finish it when it is
            request.cancelled[index] = reason
            return
        self._finish(seq, reason)

    def has_work(self) -> bool:
        """A step to run, or updates to deliver (a sample that `finish_sample` ended while it
        waited for a step: with nothing else to run, only a step delivers its end)."""
        return self._in_flight is not None or self.scheduler.has_work() or bool(self._touched)

    @property
    def num_active_requests(self) -> int:
        return len(self.requests) - len(self.held)

    # ---- one step ----------------------------------------------------------------------------

    def step(self, lookahead: bool = True) -> list[tuple[str, list[SampleUpdate]]]:
        """Finish one batch; return the new updates of every request that got any.

        With `lookahead`, the next batch is launched before this one's tokens are read back, so
        the device works on it while the host appends tokens and checks stop conditions: the
        next batch's input tokens come straight from the device, a sequence that hits a stop
        token runs one step too many (that token is dropped), and `max_tokens` and the context
        length are known at launch, so those sequences leave the batch on time."""
        current = self._in_flight or self._launch(self._schedule(preempt=True), None)
        self._in_flight = None
        if lookahead and current.pending is not None and not current.forks:
            batch = self._schedule(preempt=False)
            if batch is not None and batch.seqs:
                self._in_flight = self._launch(batch, current)
        self._finish_step(current)
        return self._collect_updates()

    def drain(self) -> list[tuple[str, list[SampleUpdate]]]:
        """Finish the batch still on the device, if any, without launching another."""
        return self.step(lookahead=False) if self._in_flight is not None else []

    def _schedule(self, preempt: bool) -> ScheduledBatch | None:
        start = time.perf_counter()
        batch = self.scheduler.schedule(preempt=preempt)
        self.timings["schedule"] += time.perf_counter() - start
        return batch

    def _launch(self, batch: ScheduledBatch, previous: "_Launched | None") -> "_Launched":
        """Run the model and queue the sampling of `batch`; the tokens stay on the device."""
        start = time.perf_counter()
        self.num_steps += 1
        launched = _Launched(self.weight_version, [], [], [])
        if not batch.seqs:
            return launched
        feed = None if previous is None or previous.pending is None else previous.feed()
        out = self.runner.run(batch, self.blocks, feed)
        if batch.all_decodes:
            self._launch_decodes(batch.seqs, out, launched)
        else:
            self._launch_mixed(batch, out, launched)
        self.timings["model"] += time.perf_counter() - start
        return launched

    def _launch_decodes(self, seqs: list[Sequence], out: RunOutput, launched: "_Launched") -> None:
        """A batch of decodes: per-row sampling constants come from the plan of the same
        sequences (built when the batch changes), and the per-sequence work is one loop."""
        plan = self._plan
        if plan is None or plan.seqs != seqs:
            plan = self._plan = self._decode_plan(seqs)
        launched.seqs, launched.plan, launched.positions = seqs, plan, out.lens
        launched.pending = self._sample(out.logits, plan.rows, out.positions)
        register = self.blocks.register if self.blocks.prefix_caching else None
        size = self.block_size
        for seq in seqs:
            seq.num_cached += 1
            seq.token_ids.append(PLACEHOLDER)  # the drawn token's place until it reaches the host
            # a block is registered a step after it fills: its last token, this step's input,
            # may still be on its way from the device (then it is known by the next launch)
            if register is not None and (seq.num_hashed + 1) * size < seq.num_cached:
                register(seq, seq.num_cached)
        launched.ending = np.flatnonzero(out.lens + 1 >= plan.limits)
        for i in launched.ending:
            self.scheduler.retire(seqs[i])  # its last token: out of the next batch

    def _launch_mixed(self, batch: ScheduledBatch, out: RunOutput, launched: "_Launched") -> None:
        """Prompts, chunks and forks: a row per sample drawn (n for a prompt that finishes)."""
        complete = []
        register = self.blocks.register if self.blocks.prefix_caching else None
        for seq, count in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_cached += count
            if register is not None and (seq.num_hashed + 1) * self.block_size <= seq.num_cached:
                register(seq, seq.num_cached)
            if seq.num_cached == seq.num_tokens:
                complete.append(seq)
        if not complete:
            return
        rows: list[int] = []
        for row, seq in enumerate(complete):
            indices = range(seq.request.n) if seq.fan_out > 1 else (seq.index,)
            for index in indices:
                rows.append(row)
                launched.seqs.append(seq)
                launched.indices.append(index)
            launched.forks = launched.forks or seq.fan_out > 1
        logits = out.logits
        if len(rows) != len(complete):
            logits = logits[to_device(rows, torch.int64, logits.device)]
        targets = list(zip(launched.seqs, launched.indices, strict=True))
        sampling = sampling_batch(
            [seq.params for seq in launched.seqs],
            [seq.request.keys[index] for seq, index in targets],
            [seq.num_tokens for seq in launched.seqs],
        )
        positions = to_device(sampling.positions, torch.int64, logits.device)
        launched.pending = self._sample(
            logits, sampling_rows(sampling, self.vocab_size, logits.device), positions
        )
        for seq, index in targets:
            if index != seq.index:
                launched.positions.append(-1)  # a sample forked off at the end of this step
                continue
            seq.token_ids.append(PLACEHOLDER)
            launched.positions.append(len(seq.token_ids) - 1)
            if self._reaches_length(seq, len(seq.token_ids)):
                self.scheduler.retire(seq)  # its last token: out of the next batch

    def _decode_plan(self, seqs: list[Sequence]) -> "_DecodePlan":
        params = [seq.params for seq in seqs]
        sampling = sampling_batch(params, [seq.request.keys[seq.index] for seq in seqs], [])
        limits = np.fromiter(
            (
                min(seq.num_prompt_tokens + p.max_tokens, self.max_model_len)
                for seq, p in zip(seqs, params, strict=True)
            ),
            np.int64,
            len(seqs),
        )
        return _DecodePlan(
            seqs=seqs,
            rows=sampling_rows(sampling, self.vocab_size, self.device),
            limits=limits,
            eos_rows=np.fromiter((not p.ignore_eos for p in params), bool, len(seqs)),
            stop_rows=[i for i, p in enumerate(params) if p.stop_token_ids],
        )

    def _sample(self, logits: torch.Tensor, rows: SamplingRows, positions: torch.Tensor) -> PendingSample:
        count = logits.shape[0]
        if count > len(self.runner.sampled):
            raise RuntimeError(f"{count} rows to sample; the engine holds {len(self.runner.sampled)}")
        fused_seed = self._noise.getrandbits(31) if self.fused_sampling and rows.fused else None
        return launch_sample(logits, rows, positions, self.generator, self.runner.sampled[:count], fused_seed)

    def _finish_step(self, launched: "_Launched") -> None:
        """Wait for a launched step's tokens; fork, append, and finish samples."""
        if launched.pending is None:
            return
        start = time.perf_counter()
        result = launched.pending.result()
        sampled = time.perf_counter()
        self.timings["sample"] += sampled - start
        if launched.plan is not None:
            self._finish_decodes(launched, result)
        else:
            self._finish_mixed(launched, result)
        self.timings["append"] += time.perf_counter() - sampled

    def _finish_decodes(self, launched: "_Launched", result: SampleResult) -> None:
        plan, seqs, version = launched.plan, launched.seqs, launched.version
        tokens = result.token_ids
        stops = plan.eos_rows & self.eos_table[np.asarray(tokens)]
        for i in plan.stop_rows:
            stops[i] = stops[i] or tokens[i] in seqs[i].params.stop_token_ids
        tops: Iterable[tuple[tuple[int, float], ...] | None] = itertools.repeat(None)
        if result.top_ids is not None:  # alternatives, for the rows that asked for them
            ks = [seq.params.top_logprobs for seq in seqs]
            tops = [
                tuple(zip(ids[:k], lps[:k], strict=True)) if k else None
                for ids, lps, k in zip(result.top_ids, result.top_logprobs, ks, strict=True)
            ]
        touched = self._touched
        delivered = 0
        for seq, token, logprob, position, top in zip(
            seqs, tokens, result.logprobs, launched.positions.tolist(), tops, strict=False
        ):
            if seq.finish_reason is not None:
                continue  # finished or aborted while this step ran: the token is dropped
            seq.token_ids[position] = token
            request = seq.request
            pending = request.pending.get(seq.index)
            if pending is None:
                pending = request.pending[seq.index] = _pending(seq)
                if request.stream:
                    touched[request.request_id] = request
            pending.token_ids.append(token)
            pending.logprobs.append(logprob)
            pending.weight_versions.append(version)
            if top is not None:
                pending.top_logprobs.append(top)  # type: ignore[union-attr]
            delivered += 1
        self.generated_tokens_total += delivered
        for i in np.flatnonzero(stops):
            if seqs[i].finish_reason is None:
                self._finish(seqs[i], "stop")
        for i in launched.ending:
            if seqs[i].finish_reason is None:
                self._finish(seqs[i], "length")

    def _finish_mixed(self, launched: "_Launched", result: SampleResult) -> None:
        owners: list[Sequence | None] = list(launched.seqs)
        if launched.forks:  # the prompt's samples become sequences (before the prompt gets its token)
            targets = zip(launched.seqs, launched.indices, strict=True)
            owners = [seq if index == seq.index else self._fork(seq, index) for seq, index in targets]
        version = launched.version
        top_ids = result.top_ids
        for i, (seq, target) in enumerate(zip(launched.seqs, owners, strict=True)):
            if target is None or target.finish_reason is not None:
                continue  # finished or aborted while this step ran: the token is dropped
            top = None
            if top_ids is not None and seq.params.top_logprobs > 0:
                k = seq.params.top_logprobs
                top = tuple(zip(top_ids[i][:k], result.top_logprobs[i][:k], strict=True))
            token = result.token_ids[i]
            position = launched.positions[i]
            if position < 0:  # a new fork: its token is the first after the prompt
                target.token_ids.append(token)
                position = len(target.token_ids) - 1
            else:
                target.token_ids[position] = token
            self._append(target, token, result.logprobs[i], version, top, position)
        if launched.forks:
            for seq in launched.seqs:
                seq.fan_out = 1

    def _reaches_length(self, seq: Sequence, num_tokens: int) -> bool:
        return num_tokens - seq.num_prompt_tokens >= seq.params.max_tokens or num_tokens >= self.max_model_len

    def _fork(self, parent: Sequence, index: int) -> Sequence | None:
        """Sample `index` of `parent`'s request, sharing the prompt's blocks (None if cancelled,
        or if the request was aborted while the prompt's last step ran: no sample starts)."""
        request = parent.request
        if parent.finish_reason == "abort":
            return None
        if index in request.cancelled:
            self._mark_finished(request, index, request.cancelled.pop(index))
            return None
        child = Sequence(
            request, index, parent.token_ids[: parent.num_prompt_tokens], parent.num_prompt_tokens
        )
        request.sequences[index] = child
        if parent.status is Status.RUNNING and self.blocks.can_fork(parent, 1):
            copy = self.blocks.fork(parent, child)
            self.runner.copy_blocks([copy] if copy else [])
            self.scheduler.insert_running_after(parent, [child])
        else:  # no block for the partial copy: recompute this sample's prompt later
            self.scheduler.add(child)
        return child

    def _append(
        self,
        seq: Sequence,
        token: int,
        logprob: float,
        version: int,
        top: tuple[tuple[int, float], ...] | None,
        position: int,
    ) -> None:
        """`token` (already in `seq.token_ids` at `position`) is delivered; finish the sample if it ends here."""
        request = seq.request
        if seq.index in request.cancelled:
            self._finish(seq, request.cancelled.pop(seq.index))
            return
        pending = request.pending.get(seq.index)
        if pending is None:
            pending = request.pending[seq.index] = _pending(seq)
            if request.stream:
                self._touched[request.request_id] = request
        pending.token_ids.append(token)
        pending.logprobs.append(logprob)
        pending.weight_versions.append(version)
        if top is not None:
            pending.top_logprobs.append(top)  # type: ignore[union-attr]
        self.generated_tokens_total += 1
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            self._finish(seq, "stop")
        elif self._reaches_length(seq, position + 1):
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finish_reason = reason
        self.blocks.register(seq, seq.num_cached)  # its last tokens are known now: a next turn can reuse them
        self.scheduler.remove(seq)
        seq.request.sequences.pop(seq.index, None)
        self._mark_finished(seq.request, seq.index, reason)

    def _mark_finished(self, request: Request, index: int, reason: FinishReason) -> None:
        request.finished[index] = reason
        if index not in request.pending:
            request.pending[index] = SampleUpdate(index)
        self._touched[request.request_id] = request

    def _collect_updates(self) -> list[tuple[str, list[SampleUpdate]]]:
        """The undelivered tokens of every touched request. A whole-response request is touched
        only when a sample finishes, and delivered once all have; a streaming request with an
        interval waits for it (unless it is complete)."""
        out = []
        requests = self.requests
        held: dict[str, Request] = {}
        now = time.monotonic()
        for request_id, request in self._touched.items():
            finished = request.finished
            done = len(finished) == request.n
            if requests.get(request_id) is not request or not (request.stream or done):
                continue  # aborted, or a whole response that is not complete yet
            if request.stream_interval and not done:
                if now < request.next_delivery:
                    held[request_id] = request
                    continue
                request.next_delivery = now + request.stream_interval
            pending = request.pending
            updates = list(pending.values()) if len(pending) == 1 else [pending[i] for i in sorted(pending)]
            for update in updates:
                update.finish_reason = finished.get(update.index)
            request.pending = {}
            out.append((request_id, updates))
            if done:
                del requests[request_id]
                if request in self.held:  # finished by finish_sample before it started
                    self.held.remove(request)
        self._touched = held
        return out

    def apply_weights(
        self, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        apply_checkpoint(self.model, tensors)
        self.blocks.reset_prefix_cache()
        self.weight_version = version


def _eos_ids(hf_model: torch.nn.Module, tokenizer: object) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(hf_model, "generation_config", None), hf_model.config):
        value = getattr(source, "eos_token_id", None)
        ids.update([value] if isinstance(value, int) else value or [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


@dataclass
class _DecodePlan:
    """Per-row constants of a decode batch, kept while the batch holds the same sequences."""

    seqs: list[Sequence]
    rows: SamplingRows
    limits: np.ndarray  # the token count at which each row's sample ends by length
    eos_rows: np.ndarray  # bool: EOS ends the row's sample (not ignore_eos)
    stop_rows: list[int]  # rows with stop_token_ids of their own


@dataclass
class _Launched:
    """A step whose model run and sampling are queued on the device."""

    version: int  # the weights the step runs with
    seqs: list[Sequence]  # per drawn row: the sequence drawn for (the prompt, for its new forks)
    indices: list[int]  # per row: the sample index drawn (empty in a decode step: each row's own)
    positions: list[int] | np.ndarray  # per row: the index of its placeholder in token_ids (-1: a fork)
    plan: _DecodePlan | None = None  # decode steps
    ending: np.ndarray | None = None  # decode steps: rows whose sample ends by length with this token
    pending: PendingSample | None = None  # None: nothing sampled (a prompt chunk, an empty batch)
    forks: bool = False  # a prompt's n > 1 samples are drawn: they become sequences when it finishes

    def feed(self) -> Feed:
        """Where the next step finds these draws (ModelRunner.sampled), by sequence."""
        if not self.indices:
            return Feed(self.seqs)
        return Feed(
            [seq if index == seq.index else None for seq, index in zip(self.seqs, self.indices, strict=True)]
        )


def _pending(seq: Sequence) -> SampleUpdate:
    """An empty update for `seq`'s next tokens (with room for alternatives if its request asked)."""
    return SampleUpdate(seq.index, top_logprobs=[] if seq.params.top_logprobs > 0 else None)
