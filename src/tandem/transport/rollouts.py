"""Rollouts on disk: samples packed into per-rank micro-batches, one file per trainer rank.

    run_dir/rollouts/step_N/rank_R.bin   safetensors bytes; JSON metadata in the header
    run_dir/rollouts/step_N/READY        written last: {"num_ranks": R, "cp": C}

The orchestrator turns scored `Sample`s into micro-batches with `pack_samples` and writes them
with `write_step`; trainer data-parallel group R reads its list with `read_rank`. Under context
parallelism (cp = C > 1) R counts the trainer's data-parallel groups (its ranks / C): the C
ranks of a group read the same file, and every micro-batch is as wide as a multiple of what
their split needs (`cp_width_multiple`). Every file is written under a
temporary name and renamed, so a reader never sees half a file.

Token alignment: every per-token tensor is aligned with `input_ids`. `loss_mask[t]` says token t
is a trained completion token; its logprob comes from the logits at position t - 1 (the trainer
shifts). A packed sample always starts with at least one prompt token, so no loss token is ever
predicted from another sample's context.

Shared prompts (`share_prompts`): the samples of one prompt (a GRPO group) can be packed as one
unit, the prompt but its last token once, then for each sample that last token again and its
completion, with positions continuing from the prompt: [p0 .. p(P-2)] [p(P-1) c c c]
[p(P-1) c c] ... A branch starts where a position does not increase and is not 0; its tokens
attend to the unit's shared prompt and to their own branch (models/layers/attention.py). Each
completion then sees exactly the context it had unshared, and the prompt is computed once
instead of once per sample.
"""

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from tandem.models.layers.attention import branch_starts
from tandem.transport.layout import READY, prune_steps, rank_path, step_dir, written_steps  # noqa: F401 (re-exported)

FORMAT_VERSION = 1
PAD_ID = 0
TENSOR_FIELDS = ("input_ids", "position_ids", "loss_mask", "sampler_logprobs", "advantages", "sample_index")


class RolloutError(RuntimeError):
    """A rollout step that cannot be read: missing, corrupt or inconsistent. Names the path."""


class RolloutTimeoutError(RolloutError, TimeoutError):
    """The READY marker of a step did not appear in time."""


@dataclass
class Sample:
    """One scored rollout as the orchestrator hands it over.

    `completion_ids` holds every token after the prompt, all turns included; environment tokens
    (tool output, user turns) have `completion_mask` False. `completion_logprobs[i]` is the
    sampler's logprob of `completion_ids[i]` (ignored where the mask is False).
    `policy_version` is the oldest policy version that generated any of its tokens;
    `policy_versions` lists every version involved (multi-turn samples can span updates).
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_mask: list[bool]
    completion_logprobs: list[float]
    reward: float
    advantage: float
    policy_version: int
    task_id: str = ""
    env: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    policy_versions: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    def check(self, seq_len: int) -> None:
        where = f"sample {self.task_id!r} (env {self.env!r})"
        n = len(self.completion_ids)
        if len(self.completion_mask) != n or len(self.completion_logprobs) != n:
            raise ValueError(
                f"{where}: completion_ids, completion_mask and completion_logprobs differ in length "
                f"({n}, {len(self.completion_mask)}, {len(self.completion_logprobs)})"
            )
        if not self.prompt_ids:
            raise ValueError(f"{where}: empty prompt (the first token has no context to be predicted from)")
        if len(self) > seq_len:
            raise ValueError(f"{where}: {len(self)} tokens exceed seq_len {seq_len}")


@dataclass
class SampleMeta:
    """Per-sample metadata carried next to the tensors; `index` matches `sample_index`."""

    index: int
    task_id: str
    env: str
    reward: float
    advantage: float
    policy_version: int
    policy_versions: list[int]
    prompt_len: int
    completion_len: int
    num_loss_tokens: int
    metrics: dict[str, float]


@dataclass
class MicroBatch:
    """Packed token rows, all tensors [rows, width]; plus sample and step metadata.

    `num_loss_tokens` counts the loss tokens of the whole step across all ranks: the loss of
    every micro-batch is divided by it, so gradients sum to the global per-token mean.
    `num_loss_samples` counts the step's samples with at least one loss token, the divisor of a
    loss normalised per sample (None in files written before it was recorded).
    """

    input_ids: torch.Tensor  # int64
    position_ids: torch.Tensor  # int64, restarts at 0 for every packed sample
    loss_mask: torch.Tensor  # bool
    sampler_logprobs: torch.Tensor  # float32, 0 where not a loss token
    advantages: torch.Tensor  # float32, the sample's advantage on its loss tokens, 0 elsewhere
    sample_index: torch.Tensor  # int64, index of the sample in the step, -1 on padding
    samples: list[SampleMeta]
    step: int
    temperature: float
    num_loss_tokens: int
    num_loss_samples: int | None = None

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens."""
        return int((self.sample_index >= 0).sum())


def first_fit_rows(lengths: dict[int, int], capacity: int) -> list[list[int]]:
    """Bin-pack sample indices into rows of `capacity` tokens, longest first (first-fit decreasing)."""
    rows: list[list[int]] = []
    free: list[int] = []
    for index in sorted(lengths, key=lambda i: (-lengths[i], i)):
        for r, room in enumerate(free):
            if lengths[index] <= room:
                rows[r].append(index)
                free[r] -= lengths[index]
                break
        else:
            rows.append([index])
            free.append(capacity - lengths[index])
    return rows


def balance_ranks(lengths: dict[int, int], num_ranks: int) -> list[list[int]]:
    """Assign samples to ranks, longest first, each to the rank with the fewest tokens so far."""
    ranks: list[list[int]] = [[] for _ in range(num_ranks)]
    load = [0] * num_ranks
    for index in sorted(lengths, key=lambda i: (-lengths[i], i)):
        r = min(range(num_ranks), key=lambda k: (load[k], k))
        ranks[r].append(index)
        load[r] += lengths[index]
    return ranks


def shares_prompts(position_ids: torch.Tensor) -> bool:
    """Whether packed rows hold a shared prompt's branches."""
    return bool(branch_starts(position_ids).any())


def prompt_units(samples: list[Sample], seq_len: int, share: bool) -> list[list[int]]:
    """Sample indices in packing units: one sample each, or (`share`) the samples of one prompt
    together, split where a unit would pass seq_len tokens."""
    if not share:
        return [[i] for i in range(len(samples))]
    units, by_prompt = [], {}
    for i, s in enumerate(samples):
        if len(s.prompt_ids) > 1:
            by_prompt.setdefault(tuple(s.prompt_ids), []).append(i)
        else:  # a 1-token prompt has nothing to share: its branches would start at position 0
            units.append([i])
    for indices in by_prompt.values():
        unit: list[int] = []
        for i in indices:
            if unit and unit_len(unit + [i], samples) > seq_len:
                units.append(unit)
                unit = []
            unit.append(i)
        units.append(unit)
    return units


def unit_len(unit: list[int], samples: list[Sample]) -> int:
    """Tokens of a packing unit: a lone sample's, or the shared prompt but its last token once
    plus, per sample, that token and the completion."""
    if len(unit) == 1:
        return len(samples[unit[0]])
    shared = len(samples[unit[0]].prompt_ids) - 1
    return shared + sum(len(samples[i]) - shared for i in unit)


def build_micro_batch(
    rows: list[list[list[int]]],
    samples: list[Sample],
    step: int,
    temperature: float,
    num_loss_tokens: int,
    width_multiple: int = 1,
    num_loss_samples: int | None = None,
) -> MicroBatch:
    """Lay out `rows` (lists of packing units, each a list of sample indices) as tensors padded
    to the longest row, rounded up to a multiple of `width_multiple`."""
    longest = max([sum(unit_len(u, samples) for u in row) for row in rows] + [1])
    width = -(-longest // width_multiple) * width_multiple
    shape = (max(len(rows), 1), width)
    input_ids = torch.full(shape, PAD_ID, dtype=torch.long)
    position_ids = torch.arange(width).repeat(shape[0], 1)
    loss_mask = torch.zeros(shape, dtype=torch.bool)
    sampler_logprobs = torch.zeros(shape, dtype=torch.float32)
    advantages = torch.zeros(shape, dtype=torch.float32)
    sample_index = torch.full(shape, -1, dtype=torch.long)
    metas = []
    for r, row in enumerate(rows):
        start = 0
        for unit in row:
            # the tokens of the unit's shared prompt laid out once, before its branches
            head = len(samples[unit[0]].prompt_ids) - 1 if len(unit) > 1 else 0
            if head:
                input_ids[r, start : start + head] = torch.tensor(samples[unit[0]].prompt_ids[:head])
                position_ids[r, start : start + head] = torch.arange(head)
                sample_index[r, start : start + head] = unit[0]
                start += head
            for i in unit:
                s = samples[i]
                n, p = len(s) - head, len(s.prompt_ids) - head
                end = start + n
                input_ids[r, start:end] = torch.tensor((s.prompt_ids + s.completion_ids)[head:])
                position_ids[r, start:end] = torch.arange(head, head + n)
                mask = torch.tensor(s.completion_mask, dtype=torch.bool)
                loss_mask[r, start + p : end] = mask
                logprobs = torch.tensor(s.completion_logprobs, dtype=torch.float32)
                sampler_logprobs[r, start + p : end] = torch.where(mask, logprobs, 0.0)
                advantages[r, start + p : end] = torch.where(mask, s.advantage, 0.0)
                sample_index[r, start:end] = i
                metas.append(
                    SampleMeta(
                        index=i,
                        task_id=s.task_id,
                        env=s.env,
                        reward=float(s.reward),
                        advantage=float(s.advantage),
                        policy_version=s.policy_version,
                        policy_versions=list(s.policy_versions) or [s.policy_version],
                        prompt_len=len(s.prompt_ids),
                        completion_len=len(s.completion_ids),
                        num_loss_tokens=int(mask.sum()),
                        metrics={k: float(v) for k, v in s.metrics.items()},
                    )
                )
                start = end
        # padding after the last sample: its own "sequence" with positions from 0
        position_ids[r, start:] = torch.arange(width - start)
    return MicroBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        loss_mask=loss_mask,
        sampler_logprobs=sampler_logprobs,
        advantages=advantages,
        sample_index=sample_index,
        samples=metas,
        step=step,
        temperature=temperature,
        num_loss_tokens=num_loss_tokens,
        num_loss_samples=num_loss_samples,
    )


def pack_samples(
    samples: list[Sample],
    seq_len: int,
    num_ranks: int,
    micro_batch_tokens: int,
    step: int = 0,
    temperature: float = 1.0,
    width_multiple: int = 1,
    share_prompts: bool = False,
) -> list[list[MicroBatch]]:
    """Pack a step's samples into micro-batches for each of `num_ranks` trainer data-parallel
    groups (ranks, without context parallelism).

    Samples (or with `share_prompts`, units of the samples of one prompt: `prompt_units`) are
    spread over groups balanced by token count, packed into rows of at most
    `seq_len` tokens, and rows are grouped `micro_batch_tokens // seq_len` to a micro-batch (the
    budget of one micro-batch of a group: under context parallelism its ranks share it); its
    width is rounded up to `width_multiple`. Every group gets the same number of micro-batches
    (padded with empty ones) so the ranks' collectives line up. Raises ValueError on a malformed
    or too long sample.
    """
    if seq_len < 2 or num_ranks < 1 or micro_batch_tokens < seq_len:
        raise ValueError(
            f"need seq_len >= 2, num_ranks >= 1 and micro_batch_tokens >= seq_len "
            f"(got {seq_len}, {num_ranks}, {micro_batch_tokens})"
        )
    for s in samples:
        s.check(seq_len)
    rows_per_micro_batch = micro_batch_tokens // seq_len
    num_loss_tokens = sum(sum(map(bool, s.completion_mask)) for s in samples)
    num_loss_samples = sum(any(s.completion_mask) for s in samples)
    units = prompt_units(samples, seq_len, share_prompts)
    lengths = {u: unit_len(unit, samples) for u, unit in enumerate(units)}
    per_rank_rows = [
        [[units[u] for u in row] for row in first_fit_rows({u: lengths[u] for u in indices}, seq_len)]
        for indices in balance_ranks(lengths, num_ranks)
    ]
    per_rank_groups = [
        [rows[k : k + rows_per_micro_batch] for k in range(0, len(rows), rows_per_micro_batch)]
        for rows in per_rank_rows
    ]
    num_micro_batches = max(1, max(len(groups) for groups in per_rank_groups))
    return [
        [
            build_micro_batch(
                groups[k] if k < len(groups) else [],
                samples,
                step,
                temperature,
                num_loss_tokens,
                width_multiple,
                num_loss_samples,
            )
            for k in range(num_micro_batches)
        ]
        for groups in per_rank_groups
    ]


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def encode(micro_batches: list[MicroBatch], step: int, rank: int) -> bytes:
    tensors = {
        f"{k}.{name}": getattr(mb, name).contiguous()
        for k, mb in enumerate(micro_batches)
        for name in TENSOR_FIELDS
    }
    header = {
        "format": FORMAT_VERSION,
        "step": step,
        "rank": rank,
        "micro_batches": [
            {
                "temperature": mb.temperature,
                "num_loss_tokens": mb.num_loss_tokens,
                "num_loss_samples": mb.num_loss_samples,
                "samples": [asdict(m) for m in mb.samples],
            }
            for mb in micro_batches
        ],
    }
    return save_tensors(tensors, metadata={"tandem": json.dumps(header)})


def write_step(run_dir: Path, step: int, per_rank: list[list[MicroBatch]], cp: int = 1) -> Path:
    """Write one file per data-parallel group, then the READY marker; returns the step directory."""
    directory = step_dir(run_dir, step)
    directory.mkdir(parents=True, exist_ok=True)
    for rank, micro_batches in enumerate(per_rank):
        write_atomic(rank_path(run_dir, step, rank), encode(micro_batches, step, rank))
    write_atomic(directory / READY, json.dumps({"num_ranks": len(per_rank), "cp": cp}).encode())
    return directory


def decode(data: bytes, path: Path, step: int, rank: int) -> list[MicroBatch]:
    try:
        tensors = load_tensors(data)
        header_len = int.from_bytes(data[:8], "little")
        header = json.loads(json.loads(data[8 : 8 + header_len])["__metadata__"]["tandem"])
        if header["format"] != FORMAT_VERSION or header["step"] != step or header["rank"] != rank:
            raise RolloutError(
                f"{path}: holds format {header['format']}, step {header['step']}, rank {header['rank']}; "
                f"expected format {FORMAT_VERSION}, step {step}, rank {rank}"
            )
        micro_batches = []
        for k, mb in enumerate(header["micro_batches"]):
            fields = {name: tensors[f"{k}.{name}"] for name in TENSOR_FIELDS}
            shapes = {t.shape for t in fields.values()}
            if len(shapes) != 1 or len(next(iter(shapes))) != 2:
                raise RolloutError(f"{path}: micro-batch {k} has tensors of different shapes {shapes}")
            micro_batches.append(
                MicroBatch(
                    **fields,
                    samples=[SampleMeta(**m) for m in mb["samples"]],
                    step=step,
                    temperature=float(mb["temperature"]),
                    num_loss_tokens=int(mb["num_loss_tokens"]),
                    num_loss_samples=None
                    if mb.get("num_loss_samples") is None
                    else int(mb["num_loss_samples"]),
                )
            )
    except RolloutError:
        raise
    except (SafetensorError, ValueError, KeyError, TypeError) as e:
        raise RolloutError(f"corrupt rollout file {path}: {type(e).__name__}: {e}") from None
    return micro_batches


def wait_ready(run_dir: Path, step: int, timeout_s: float, poll_s: float = 0.05) -> dict:
    """Wait for `rollouts/step_N/READY`; returns its content. Raises RolloutTimeoutError naming the path."""
    ready = step_dir(run_dir, step) / READY
    deadline = time.monotonic() + timeout_s
    while not ready.is_file():
        if time.monotonic() >= deadline:
            raise RolloutTimeoutError(f"timed out after {timeout_s:g}s waiting for {ready}")
        time.sleep(poll_s)
    try:
        return json.loads(ready.read_text())
    except ValueError as e:
        raise RolloutError(f"corrupt marker {ready}: {e}") from None


def read_rank(
    run_dir: Path, step: int, rank: int, timeout_s: float, num_ranks: int | None = None, cp: int = 1
) -> list[MicroBatch]:
    """Wait for step N to be ready, then read data-parallel group R's micro-batches.

    `num_ranks`, when given, is checked against the number of groups the step was packed for,
    and `cp` against its context-parallel degree.
    """
    marker = wait_ready(run_dir, step, timeout_s)
    packed = (marker.get("num_ranks"), marker.get("cp", 1))
    if num_ranks is not None and packed != (num_ranks, cp):
        raise RolloutError(
            f"{step_dir(run_dir, step)} was packed for {packed[0]} trainer data-parallel groups of cp = "
            f"{packed[1]}, but the trainer runs {num_ranks} of cp = {cp}"
        )
    path = rank_path(run_dir, step, rank)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise RolloutError(f"missing rollout file {path} (the step's READY marker exists)") from None
    return decode(data, path, step, rank)
