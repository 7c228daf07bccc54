"""On-device sampling with per-row temperature, top-k, top-p, min-p and seeds.

A token is drawn as argmax(p / E) with E ~ Exp(1) per vocabulary entry (the exponential-race
form of categorical sampling). For a request with a seed the noise is counter-based: a hash of
(the sample's key, the position of the token being drawn, the vocabulary index), so a seeded
sample draws the same tokens whatever else is in the batch, after a preemption, and on CPU or
GPU. Rows without a seed take their noise from the engine's torch.Generator (one fast kernel).

The returned logprob is log_softmax(logits / T) at the drawn token (T = 1 for greedy rows),
computed from the same logits the token was drawn from.
"""

from dataclasses import dataclass

import torch

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
    """Per-row sampling parameters (all length `rows`)."""

    temperatures: list[float]
    top_ps: list[float]
    top_ks: list[int]
    min_ps: list[float]
    keys: list[int | None]  # sample_key(...) of seeded rows, None for unseeded ones
    positions: list[int]  # position of the token each row draws
    num_top_logprobs: int = 0
    generator: torch.Generator | None = None  # noise of the unseeded rows


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float]
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


class PendingSample:
    """Tokens drawn on the device, on their way to the host. `token_ids` (on the device) can feed
    the next step before `result()` has waited for them."""

    def __init__(self, token_ids: torch.Tensor, logprobs: torch.Tensor, top: tuple | None) -> None:
        self.token_ids = token_ids
        # one device→host copy for ids and logprobs (float64 holds every token id exactly)
        tensors = [torch.stack([token_ids.double(), logprobs.double()])]
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
    """logits: [rows, vocab] float32. Waits for the result."""
    return launch_sample(logits, batch).result()


def launch_sample(logits: torch.Tensor, batch: SamplingBatch) -> PendingSample:
    """Queue the sampling of `logits` ([rows, vocab] float32) without waiting for the device."""
    device, vocab = logits.device, logits.shape[-1]
    temps = to_device(batch.temperatures, torch.float32, device)
    greedy = temps <= 0
    scaled = logits / torch.where(greedy, 1.0, temps)[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    tokens = logprobs.argmax(dim=-1)
    if any(t > 0 for t in batch.temperatures):  # decided on the host: no device sync
        probs = _filtered_probs(logprobs.exp(), batch, device)
        noise = torch.empty_like(probs).exponential_(generator=batch.generator)
        seeded = [i for i, key in enumerate(batch.keys) if key is not None]
        if seeded:
            keys, positions, rows = to_device(
                [[batch.keys[i] for i in seeded], [batch.positions[i] for i in seeded], seeded],
                torch.int64,
                device,
            )
            noise[rows] = -torch.log(uniform_noise(keys, positions, vocab))
        drawn = (probs / noise).argmax(dim=-1)
        tokens = torch.where(greedy, tokens, drawn)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    top = None
    if batch.num_top_logprobs > 0:
        top = logprobs.topk(min(batch.num_top_logprobs, vocab), dim=-1)
    return PendingSample(tokens, chosen, top)


def _filtered_probs(probs: torch.Tensor, batch: SamplingBatch, device: torch.device) -> torch.Tensor:
    """Zero the tokens that min-p, top-k and top-p exclude (the most likely token always stays)."""
    vocab = probs.shape[-1]
    if any(p > 0 for p in batch.min_ps):
        min_p = to_device(batch.min_ps, torch.float32, device)
        probs = probs.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)
    ks = [k if 0 < k < vocab else 0 for k in batch.top_ks]
    if any(ks):
        top = probs.topk(max(ks), dim=-1).values
        k_index, k_on = to_device(
            [[max(k, 1) - 1 for k in ks], [int(k > 0) for k in ks]], torch.int64, device
        )
        threshold = top.gather(1, k_index[:, None])
        threshold = torch.where(k_on[:, None] > 0, threshold, 0.0)
        probs = probs.masked_fill(probs < threshold, 0.0)
    if any(p < 1.0 for p in batch.top_ps):
        top_p = to_device(batch.top_ps, torch.float32, device)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_p[:, None] * sorted_probs.sum(dim=-1, keepdim=True)
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    return probs
