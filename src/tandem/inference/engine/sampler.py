"""On-device sampling with per-row temperature, top-k, top-p, min-p and seeds.

A token is drawn as argmax(p / E) with E ~ Exp(1) per vocabulary entry (the exponential-race
form of categorical sampling). For a request with a seed the noise is counter-based: a hash of
(the sample's key, the position of the token being drawn, the vocabulary index), so a seeded
sample draws the same tokens whatever else is in the batch, after a preemption, and on CPU or
GPU. Rows without a seed take their noise from the engine's torch.Generator (one fast kernel).
On CUDA, a batch without top-k, top-p, min-p and alternatives is drawn by one fused kernel
(triton_sample.py) with the same noise for seeded rows and hashed noise from a per-step seed
for the others.

The returned logprob is log_softmax(logits / T) at the drawn token (T = 1 for greedy rows),
computed from the same logits the token was drawn from.
"""

from dataclasses import dataclass

import torch

from tandem.inference.engine.api import SamplingParams
from tandem.inference.engine.transfer import HostCopy, to_device

MASK32 = 0xFFFFFFFF


def fmix32(x: torch.Tensor | int) -> torch.Tensor | int:
    """MurmurHash3's 32-bit finaliser on non-negative values below 2**32 (ints or int64 tensors)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & MASK32
    return x ^ (x >> 16)


def sample_key(seed: int, sample_index: int) -> int:
    """The 32-bit key of sample `sample_index` of a request seeded with `seed`."""
    key = fmix32((seed & MASK32) ^ fmix32((seed >> 32) & MASK32))
    return int(fmix32(key ^ fmix32((sample_index + 0x9E3779B9) & MASK32)))


def uniform_noise(keys: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] uniforms in (0, 1) from per-row sample keys and token positions (int64)."""
    row = fmix32(keys ^ fmix32(positions))[:, None]
    index = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    x = (row + index[None, :] * 0x9E3779B9) & MASK32
    x = fmix32(fmix32(x) ^ row)
    return ((x >> 8).float() + 0.5) * (1.0 / (1 << 24))


@dataclass
class SamplingBatch:
    """Per-row sampling parameters (all length `rows`), as the host knows them."""

    temperatures: list[float]
    top_ps: list[float]
    top_ks: list[int]
    min_ps: list[float]
    keys: list[int | None]  # sample_key(...) of seeded rows, None for unseeded ones
    positions: list[int]  # position of the token each row draws
    num_top_logprobs: int = 0
    generator: torch.Generator | None = None  # noise of the unseeded rows


def sampling_batch(
    params: list[SamplingParams], keys: list[int | None], positions: list[int]
) -> SamplingBatch:
    """The rows' sampling parameters, one `SamplingParams` per row."""
    return SamplingBatch(
        temperatures=[p.temperature for p in params],
        top_ps=[p.top_p for p in params],
        top_ks=[p.top_k for p in params],
        min_ps=[p.min_p for p in params],
        keys=keys,
        positions=positions,
        num_top_logprobs=max(p.top_logprobs for p in params),
    )


@dataclass
class SamplingRows:
    """A batch's sampling parameters on the device, built once and reused while the batch's
    rows stay the same (a run of decode steps): launching a step copies nothing for them."""

    temperatures: torch.Tensor  # [rows] float32; ≤ 0 greedy
    keys: torch.Tensor  # [rows] int64: a seeded row's key, -1 for unseeded rows
    random: bool  # some row samples (temperature > 0)
    seeded_rows: torch.Tensor | None  # indices of the seeded rows, None when there are none
    min_ps: torch.Tensor | None
    top_k: tuple[torch.Tensor, torch.Tensor, int] | None  # (k - 1 per row, k on per row, largest k)
    top_ps: torch.Tensor | None
    num_top_logprobs: int

    @property
    def fused(self) -> bool:
        """Whether the one-pass kernel (triton_sample.py) covers these rows: no filters, no alternatives."""
        return (
            self.min_ps is None and self.top_k is None and self.top_ps is None and not self.num_top_logprobs
        )


def sampling_rows(batch: SamplingBatch, vocab: int, device: torch.device) -> SamplingRows:
    seeded = [i for i, key in enumerate(batch.keys) if key is not None]
    temps, keys = to_device(
        [batch.temperatures, [-1 if key is None else key for key in batch.keys]], torch.float64, device
    )
    ks = [k if 0 < k < vocab else 0 for k in batch.top_ks]
    top_k = None
    if any(ks):
        k_index, k_on = to_device(
            [[max(k, 1) - 1 for k in ks], [int(k > 0) for k in ks]], torch.int64, device
        )
        top_k = (k_index, k_on, max(ks))
    return SamplingRows(
        temperatures=temps.float(),
        keys=keys.long(),
        random=any(t > 0 for t in batch.temperatures),
        seeded_rows=to_device(seeded, torch.int64, device) if seeded else None,
        min_ps=to_device(batch.min_ps, torch.float32, device) if any(p > 0 for p in batch.min_ps) else None,
        top_k=top_k,
        top_ps=to_device(batch.top_ps, torch.float32, device) if any(p < 1.0 for p in batch.top_ps) else None,
        num_top_logprobs=batch.num_top_logprobs,
    )


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float]
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


class PendingSample:
    """Tokens drawn on the device, on their way to the host. `token_ids` (on the device) can feed
    the next step before `result()` has waited for them."""

    def __init__(self, token_ids: torch.Tensor, result: torch.Tensor, top: tuple | None) -> None:
        self.token_ids = token_ids
        # one device→host copy for ids and logprobs ([2, rows] float64 holds every token id exactly)
        tensors = [result]
        if top is not None:
            tensors += [top[1], top[0]]  # ids, values
        self._copy = HostCopy(*tensors)

    def result(self) -> SampleResult:
        host = self._copy.get()
        token_ids, logprobs = host[0].tolist()
        result = SampleResult(list(map(int, token_ids)), logprobs)
        if len(host) > 1:
            result.top_ids, result.top_logprobs = host[1].tolist(), host[2].tolist()
        return result


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SampleResult:
    """logits: [rows, vocab]. Waits for the result (the torch path; tests and one-off use)."""
    rows = sampling_rows(batch, logits.shape[-1], logits.device)
    positions = to_device(batch.positions, torch.int64, logits.device)
    return launch_sample(logits, rows, positions, batch.generator).result()


def launch_sample(
    logits: torch.Tensor,
    rows: SamplingRows,
    positions: torch.Tensor,
    generator: torch.Generator | None,
    tokens_out: torch.Tensor | None = None,
    fused_seed: int | None = None,
) -> PendingSample:
    """Queue the sampling of `logits` ([rows, vocab]) without waiting for the device.

    positions: [rows] int64 on the device, the position of the token each row draws. The drawn
    ids are also written to `tokens_out` when given (the next step's inputs read them there).
    With `fused_seed` (CUDA, `rows.fused`) the one-pass kernel draws, unseeded rows from that seed.
    """
    count = logits.shape[0]
    if tokens_out is None:
        tokens_out = torch.empty(count, dtype=torch.int64, device=logits.device)
    if fused_seed is not None:
        from tandem.inference.engine.triton_sample import fused_sample

        result = fused_sample(logits, rows.temperatures, rows.keys, positions, fused_seed, tokens_out)
        return PendingSample(tokens_out, result, None)
    vocab = logits.shape[-1]
    greedy = rows.temperatures <= 0
    scaled = logits.float() / torch.where(greedy, 1.0, rows.temperatures)[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    tokens = logprobs.argmax(dim=-1)
    if rows.random:  # decided on the host: no device sync
        probs = _filtered_probs(logprobs.exp(), rows)
        noise = torch.empty_like(probs).exponential_(generator=generator)
        if rows.seeded_rows is not None:
            seeded = rows.seeded_rows
            noise[seeded] = -torch.log(uniform_noise(rows.keys[seeded], positions[seeded], vocab))
        drawn = (probs / noise).argmax(dim=-1)
        tokens = torch.where(greedy, tokens, drawn)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    tokens_out.copy_(tokens)
    top = None
    if rows.num_top_logprobs > 0:
        top = logprobs.topk(min(rows.num_top_logprobs, vocab), dim=-1)
    return PendingSample(tokens_out, torch.stack([tokens.double(), chosen.double()]), top)


def _filtered_probs(probs: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """Zero the tokens that min-p, top-k and top-p exclude (the most likely token always stays)."""
    if rows.min_ps is not None:
        probs = probs.masked_fill(probs < rows.min_ps[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)
    if rows.top_k is not None:
        k_index, k_on, largest = rows.top_k
        top = probs.topk(largest, dim=-1).values
        threshold = top.gather(1, k_index[:, None])
        threshold = torch.where(k_on[:, None] > 0, threshold, 0.0)
        probs = probs.masked_fill(probs < threshold, 0.0)
    if rows.top_ps is not None:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= rows.top_ps[:, None] * sorted_probs.sum(dim=-1, keepdim=True)
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    return probs
