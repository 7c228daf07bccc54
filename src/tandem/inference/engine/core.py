"""The synchronous engine: requests in, one `step()` at a time, token updates out.

`AsyncEngine` (engine.py) drives this from a background thread; tests and benchmarks may call it
directly. A step schedules a batch, runs the model, samples, forks the n samples of prompts that
just finished prefilling, appends tokens, and finishes samples that hit a stop condition.
"""

import itertools
import time

import torch

from tandem.cli import UserError
from tandem.inference.config import InferenceConfig
from tandem.inference.engine.api import FinishReason, SampleUpdate, SamplingParams, TokenOutput
from tandem.inference.engine.block_manager import BlockManager
from tandem.inference.engine.model_runner import ModelRunner, kv_bytes_per_block
from tandem.inference.engine.models import build_model
from tandem.inference.engine.sampler import SamplingBatch, sample, sample_key
from tandem.inference.engine.scheduler import Scheduler
from tandem.inference.engine.sequence import Request, Sequence, Status
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
        self.blocks = BlockManager(num_blocks, cfg.block_size)
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
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, n: int
    ) -> None:
        self.validate(prompt_token_ids, params, n)
        if request_id in self.requests:
            raise ValueError(f"request id '{request_id}' is already running")
        keys = [None if params.seed is None else sample_key(params.seed, i) for i in range(n)]
        request = Request(request_id, list(prompt_token_ids), params, n, keys, next(self._arrivals))
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
        return self.scheduler.has_work()

    @property
    def num_active_requests(self) -> int:
        return len(self.requests) - len(self.held)

    # ---- one step ----------------------------------------------------------------------------

    def step(self) -> list[tuple[str, list[SampleUpdate]]]:
        """Run one batch; return the new updates of every request that got any."""
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        self.num_steps += 1
        scheduled = time.perf_counter()
        self.timings["schedule"] += scheduled - start
        if batch.seqs:
            sampled = [
                seq
                for seq, count in zip(batch.seqs, batch.num_new_tokens, strict=True)
                if seq.num_cached + count == seq.num_tokens
            ]
            logits = self.runner.run(batch, self.blocks)
            self.timings["model"] += time.perf_counter() - scheduled
            for seq, count in zip(batch.seqs, batch.num_new_tokens, strict=True):
                seq.num_cached += count
            if sampled:
                self._sample_and_append(sampled, logits)
        return self._collect_updates()

    def _sample_and_append(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        rows: list[int] = []
        targets: list[tuple[Sequence, int]] = []  # (sequence sampled for, sample index)
        for row, seq in enumerate(seqs):
            indices = range(seq.request.n) if seq.fan_out > 1 else [seq.index]
            for index in indices:
                rows.append(row)
                targets.append((seq, index))
        if len(rows) != len(seqs):
            logits = logits[torch.tensor(rows, device=logits.device)]
        params = [seq.params for seq, _ in targets]
        batch = SamplingBatch(
            temperatures=[p.temperature for p in params],
            top_ps=[p.top_p for p in params],
            top_ks=[p.top_k for p in params],
            min_ps=[p.min_p for p in params],
            keys=[seq.request.keys[index] for seq, index in targets],
            positions=[seq.num_tokens for seq, _ in targets],
            num_top_logprobs=max(p.top_logprobs for p in params),
            generator=self.generator,
        )
        start = time.perf_counter()
        result = sample(logits, batch)
        sampled = time.perf_counter()
        self.timings["sample"] += sampled - start
        owners = [seq if index == seq.index else self._fork(seq, index) for seq, index in targets]
        for i, ((seq, _), target) in enumerate(zip(targets, owners, strict=True)):
            if target is None:
                continue
            top: list[tuple[int, float]] = []
            if result.top_ids is not None and seq.params.top_logprobs > 0:
                k = seq.params.top_logprobs
                top = list(zip(result.top_ids[i][:k], result.top_logprobs[i][:k], strict=True))
            token = TokenOutput(result.token_ids[i], result.logprobs[i], self.weight_version, top)
            self._append(target, token)
        for seq in seqs:
            seq.fan_out = 1
        self.timings["append"] += time.perf_counter() - sampled

    def _fork(self, parent: Sequence, index: int) -> Sequence | None:
        """Sample `index` of `parent`'s request, sharing the prompt's blocks (None if cancelled)."""
        request = parent.request
        if index in request.cancelled:
            self._mark_finished(request, index, request.cancelled.pop(index))
            return None
        child = Sequence(request, index, list(parent.token_ids), parent.num_prompt_tokens)
        request.sequences[index] = child
        if parent.status is Status.RUNNING and self.blocks.can_fork(parent, 1):
            copy = self.blocks.fork(parent, child)
            self.runner.copy_blocks([copy] if copy else [])
            self.scheduler.insert_running_after(parent, [child])
        else:  # no block for the partial copy: recompute this sample's prompt later
            self.scheduler.add(child)
        return child

    def _append(self, seq: Sequence, token: TokenOutput) -> None:
        if seq.index in seq.request.cancelled:
            self._finish(seq, seq.request.cancelled.pop(seq.index))
            return
        seq.token_ids.append(token.token_id)
        seq.request.pending.setdefault(seq.index, []).append(token)
        self.generated_tokens_total += 1
        params = seq.params
        if token.token_id in params.stop_token_ids or (
            not params.ignore_eos and token.token_id in self.eos_token_ids
        ):
            self._finish(seq, "stop")
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.scheduler.remove(seq)
        del seq.request.sequences[seq.index]
        self._mark_finished(seq.request, seq.index, reason)

    def _mark_finished(self, request: Request, index: int, reason: FinishReason) -> None:
        request.finished[index] = reason
        request.pending.setdefault(index, [])

    def _collect_updates(self) -> list[tuple[str, list[SampleUpdate]]]:
        out = []
        for request_id, request in list(self.requests.items()):
            if not request.pending:
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
        return out

    def apply_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        apply_checkpoint(self.model, tensors)
        self.weight_version = version


def _eos_ids(hf_model: torch.nn.Module, tokenizer: object) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(hf_model, "generation_config", None), hf_model.config):
        value = getattr(source, "eos_token_id", None)
        ids.update([value] if isinstance(value, int) else value or [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
