"""The synchronous engine: requests in, one `step()` at a time, token updates out.

`AsyncEngine` (engine.py) drives this from a background thread; tests and benchmarks may call it
directly. A step schedules a batch, runs the model, samples, forks the n samples of prompts that
just finished prefilling, appends tokens, and finishes samples that hit a stop condition.
"""

import itertools
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from tandem.cli import UserError
from tandem.inference.config import InferenceConfig
from tandem.inference.engine.api import FinishReason, SampleUpdate, SamplingParams, TokenOutput
from tandem.inference.engine.block_manager import BlockManager
from tandem.inference.engine.model_runner import Feed, ModelRunner, kv_bytes_per_block
from tandem.inference.engine.models import build_model
from tandem.inference.engine.sampler import PendingSample, SamplingBatch, launch_sample, sample_key
from tandem.inference.engine.scheduler import ScheduledBatch, Scheduler
from tandem.inference.engine.sequence import PLACEHOLDER, Request, Sequence, Status
from tandem.inference.engine.transfer import to_device
from tandem.inference.engine.weights import apply_checkpoint
from tandem.models.loading import load_model, load_tokenizer, resolve_device, resolve_dtype

GiB = 1 << 30
CPU_DEFAULT_KV_GB = 1.0


class EngineCore:
    def __init__(self, config: InferenceConfig) -> None:
        cfg = config.engine
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.tokenizer = load_tokenizer(config.model.name)
        hf_model = load_model(config.model, self.device)
        model_max = getattr(hf_model.config, "max_position_embeddings", None) or 4096
        self.max_model_len = min(cfg.max_model_len or model_max, model_max)
        self.model = build_model(hf_model, self.max_model_len, cfg.triton_kernels)
        self.vocab_size = hf_model.config.vocab_size
        self.eos_token_ids = _eos_ids(hf_model, self.tokenizer)
        del hf_model
        self.block_size = cfg.block_size
        num_blocks = self._num_blocks(config)
        self.runner = ModelRunner(
            self.model, num_blocks, cfg.block_size, self.device, self.dtype, cfg.cuda_graphs, cfg.max_num_seqs
        )
        self.blocks = BlockManager(
            num_blocks, cfg.block_size, -(-self.max_model_len // cfg.block_size), cfg.prefix_caching
        )
        # one sequence must always fit in the whole cache, or preemption could not make room for it
        self.max_model_len = min(self.max_model_len, self.blocks.num_usable * cfg.block_size)
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.max_n = cfg.max_n
        self.requests: dict[str, Request] = {}
        self.held: list[Request] = []  # added while new work is held back (a weight update waits)
        self.hold_new = False
        self.weight_version = 0
        self.generated_tokens_total = 0
        self.prompt_tokens_total = 0
        self.num_steps = 0
        self._arrivals = itertools.count()
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        self.timings = {"schedule": 0.0, "model": 0.0, "sample": 0.0, "append": 0.0}
        self._in_flight: _Launched | None = None  # the step queued on the device, tokens not read yet
        self._touched: dict[str, Request] = {}  # requests with undelivered updates

    def _num_blocks(self, config: InferenceConfig) -> int:
        cfg = config.engine
        per_block = kv_bytes_per_block(self.model.config, cfg.block_size, self.dtype)
        if cfg.kv_cache_memory_gb is not None:
            budget = cfg.kv_cache_memory_gb * GiB
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            reserve = 2 * GiB + cfg.max_num_batched_tokens * self.vocab_size * 4  # activations, logits
            budget = free - (1 - cfg.gpu_memory_utilization) * total - reserve
        else:
            needed = cfg.max_num_seqs * (self.max_model_len + cfg.block_size) * per_block / cfg.block_size
            budget = min(CPU_DEFAULT_KV_GB * GiB, needed)
        num_blocks = int(budget // per_block) + 1  # + the scratch block
        if num_blocks < 2 or (num_blocks - 1) * cfg.block_size < min(self.max_model_len, 256):
            raise UserError(
                f"the KV-cache budget ({budget / GiB:.3f} GiB) holds too few tokens for this model: "
                "raise engine.kv_cache_memory_gb or engine.gpu_memory_utilization"
            )
        return num_blocks

    # ---- requests ----------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, n: int) -> None:
        """Raise ValueError (a client error) for a request the engine cannot serve."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if not 1 <= n <= self.max_n:
            raise ValueError(f"n must be between 1 and {self.max_n}, got {n}")
        if params.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {params.max_tokens}")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens; the context is {self.max_model_len} tokens"
            )
        if (len(prompt_token_ids) + 1) > self.blocks.num_usable * self.block_size:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens, more than the KV cache holds")
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must lie in [0, {self.vocab_size})")
        if params.temperature < 0 or not 0 < params.top_p <= 1 or params.min_p < 0:
            raise ValueError("temperature must be ≥ 0, top_p in (0, 1], min_p ≥ 0")

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        n: int,
        stream: bool = True,
    ) -> None:
        """With `stream=False` the request's updates are held until all its samples have
        finished, then delivered as one update per sample."""
        self.validate(prompt_token_ids, params, n)
        if request_id in self.requests:
            raise ValueError(f"request id '{request_id}' is already running")
        keys = [None if params.seed is None else sample_key(params.seed, i) for i in range(n)]
        request = Request(request_id, list(prompt_token_ids), params, n, keys, next(self._arrivals), stream)
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
        return self._in_flight is not None or self.scheduler.has_work()

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
        launched = _Launched([], [], self.weight_version)
        if not batch.seqs:
            return launched
        seqs = [
            seq
            for seq, count in zip(batch.seqs, batch.num_new_tokens, strict=True)
            if seq.num_cached + count == seq.num_tokens
        ]
        feed = None if previous is None or previous.pending is None else previous.feed()
        logits = self.runner.run(batch, self.blocks, feed)
        for seq, count in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_cached += count
        self.blocks.register(batch.seqs)
        if not seqs:
            self.timings["model"] += time.perf_counter() - start
            return launched
        rows: list[int] = []
        for row, seq in enumerate(seqs):
            indices = range(seq.request.n) if seq.fan_out > 1 else (seq.index,)
            for index in indices:
                rows.append(row)
                launched.targets.append((seq, index))
            launched.forks = launched.forks or seq.fan_out > 1
        if len(rows) != len(seqs):
            logits = logits[to_device(rows, torch.int64, logits.device)]
        params = [seq.params for seq, _ in launched.targets]
        sampling = SamplingBatch(
            temperatures=[p.temperature for p in params],
            top_ps=[p.top_p for p in params],
            top_ks=[p.top_k for p in params],
            min_ps=[p.min_p for p in params],
            keys=[seq.request.keys[index] for seq, index in launched.targets],
            positions=[seq.num_tokens for seq, _ in launched.targets],
            num_top_logprobs=max(p.top_logprobs for p in params),
            generator=self.generator,
        )
        launched.pending = launch_sample(logits, sampling)
        # the sampled token's place in its sequence: a placeholder until it reaches the host
        for seq, index in launched.targets:
            if index != seq.index:
                launched.positions.append(-1)  # a sample forked off at the end of this step
                continue
            seq.token_ids.append(PLACEHOLDER)
            launched.positions.append(len(seq.token_ids) - 1)
            if self._reaches_length(seq, len(seq.token_ids)):
                self.scheduler.retire(seq)  # its last token: out of the next batch
        self.timings["model"] += time.perf_counter() - start
        return launched

    def _finish_step(self, launched: "_Launched") -> None:
        """Wait for a launched step's tokens; fork, append, and finish samples."""
        if launched.pending is None:
            return
        start = time.perf_counter()
        result = launched.pending.result()
        sampled = time.perf_counter()
        self.timings["sample"] += sampled - start
        targets = launched.targets
        owners: list[Sequence | None] = [seq for seq, _ in targets]
        if launched.forks:  # the prompt's samples become sequences (before the prompt gets its token)
            owners = [seq if index == seq.index else self._fork(seq, index) for seq, index in targets]
        version = launched.version
        top_ids = result.top_ids
        requests = self.requests
        for i, ((seq, index), target) in enumerate(zip(targets, owners, strict=True)):
            request = seq.request
            if target is None or index in request.finished or requests.get(request.request_id) is not request:
                continue  # finished or aborted while this step ran: the token is dropped
            top: tuple[tuple[int, float], ...] = ()
            if top_ids is not None and seq.params.top_logprobs > 0:
                k = seq.params.top_logprobs
                top = tuple(zip(top_ids[i][:k], result.top_logprobs[i][:k], strict=True))
            token = TokenOutput(result.token_ids[i], result.logprobs[i], version, top)
            position = launched.positions[i]
            if position < 0:  # a new fork: its token is the first after the prompt
                target.token_ids.append(token.token_id)
                position = len(target.token_ids) - 1
            else:
                target.token_ids[position] = token.token_id
            self._append(target, token, position)
        if launched.forks:
            for seq, _ in targets:
                seq.fan_out = 1
        self.timings["append"] += time.perf_counter() - sampled

    def _reaches_length(self, seq: Sequence, num_tokens: int) -> bool:
        return num_tokens - seq.num_prompt_tokens >= seq.params.max_tokens or num_tokens >= self.max_model_len

    def _fork(self, parent: Sequence, index: int) -> Sequence | None:
        """Sample `index` of `parent`'s request, sharing the prompt's blocks (None if cancelled)."""
        request = parent.request
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

    def _append(self, seq: Sequence, token: TokenOutput, position: int) -> None:
        """`token` (already in `seq.token_ids` at `position`) is delivered; finish the sample if it ends here."""
        request = seq.request
        if seq.index in request.cancelled:
            self._finish(seq, request.cancelled.pop(seq.index))
            return
        pending = request.pending.get(seq.index)
        if pending is None:
            pending = request.pending[seq.index] = []
            self._touched[request.request_id] = request
        pending.append(token)
        self.generated_tokens_total += 1
        params = seq.params
        if token.token_id in params.stop_token_ids or (
            not params.ignore_eos and token.token_id in self.eos_token_ids
        ):
            self._finish(seq, "stop")
        elif self._reaches_length(seq, position + 1):
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.blocks.register((seq,))  # its last tokens are known now: a next turn can reuse them
        self.scheduler.remove(seq)
        seq.request.sequences.pop(seq.index, None)
        self._mark_finished(seq.request, seq.index, reason)

    def _mark_finished(self, request: Request, index: int, reason: FinishReason) -> None:
        request.finished[index] = reason
        request.pending.setdefault(index, [])
        self._touched[request.request_id] = request

    def _collect_updates(self) -> list[tuple[str, list[SampleUpdate]]]:
        out = []
        held = []
        for request_id, request in self._touched.items():
            if self.requests.get(request_id) is not request:
                continue  # aborted
            if not request.stream and not request.done:
                held.append((request_id, request))  # whole-response request: delivered at its end
                continue
            updates = [
                SampleUpdate(index, tokens, request.finished.get(index))
                for index, tokens in sorted(request.pending.items())
            ]
            request.pending.clear()
            out.append((request_id, updates))
            if request.done:
                del self.requests[request_id]
                if request in self.held:  # finished by finish_sample before it started
                    self.held.remove(request)
        self._touched = dict(held)
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
class _Launched:
    """A step whose model run and sampling are queued on the device."""

    targets: list[tuple[Sequence, int]]  # per sampled row: the sequence sampled for, the sample index
    positions: list[int]  # per row: the index of its placeholder in the sequence's token_ids (-1: a fork)
    version: int  # the weights the step runs with
    pending: PendingSample | None = None  # None: nothing sampled (a prompt chunk, an empty batch)
    forks: bool = False  # a prompt's n > 1 samples are drawn: they become sequences when it finishes

    def feed(self) -> Feed:
        """The sampled ids as the next step's inputs, by sequence."""
        rows = {seq.seq_id: row for row, (seq, index) in enumerate(self.targets) if index == seq.index}
        return Feed(self.pending.token_ids, rows)
