"""The RL policy loss: importance-weighted policy gradient against the sampler's logprobs.

Every objective is a function `(LossInputs, **options) -> LossTerms` giving a loss per token and
which tokens it excluded (masked, clipped or truncated). `policy_loss` adds the optional KL term,
sums over loss tokens and divides by the number of loss tokens of the whole step (all
micro-batches, all ranks), so summing the micro-batch losses gives the global per-token mean;
with `normalize = "sample"` each token is weighted by 1 / its sample's loss tokens and the sum
divided by the step's samples. Objectives taken per sample (gspo) read per-sample means through
`LossInputs.sample_mean`, which adds a sample's tokens up across a context-parallel group.
docs/algorithms.md has the math. A custom objective is named by `loss.import_path`.
"""

import importlib
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tandem.cli import UserError
from tandem.trainer.rl.config import (
    MAX_LOG_RATIO,
    CustomLoss,
    GSPOLoss,
    LossConfig,
    MaskedISLoss,
    PPOClipLoss,
    TISLoss,
)

"""|log r| is clamped here before exp, so a wildly off token cannot overflow to inf (or NaN grads)."""


@dataclass
class SampleTokens:
    """Which sample each token of a micro-batch belongs to.

    `index` [rows, width]: the token's sample (its index in the step); −1 on padding (0 where
    context parallelism pads: never a loss token either).
    `loss_tokens` [S] float64, S > every index: each sample's loss tokens, all of them — under
    context parallelism a sample's other tokens lie on the other ranks of `group`, which is why
    per-sample sums are all-reduced over it.
    """

    index: torch.Tensor
    loss_tokens: torch.Tensor
    group: dist.ProcessGroup | None = None

    def mean(self, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Per token: the mean of `values` over the `mask` tokens of its sample (no gradient)."""
        index = self.index.clamp(min=0)
        with torch.no_grad():  # (no boolean indexing: it would wait for the GPU)
            masked = torch.where(mask, values.double(), 0.0)
            sums = torch.zeros_like(self.loss_tokens).index_add_(0, index.flatten(), masked.flatten())
            if self.group is not None:
                dist.all_reduce(sums, group=self.group)
            means = sums / self.loss_tokens.clamp(min=1)
        return means[index].to(values.dtype)

    def weights(self) -> torch.Tensor:
        """Per token: 1 / its sample's loss tokens (1 on padding)."""
        return 1 / self.loss_tokens.clamp(min=1)[self.index.clamp(min=0)]


@dataclass
class LossInputs:
    """Per-token tensors of one micro-batch, all [rows, width] and aligned with the input ids."""

    logprobs: torch.Tensor  # log π_θ(token), differentiable
    sampler_logprobs: torch.Tensor  # log μ(token) from the inference server
    advantages: torch.Tensor
    loss_mask: torch.Tensor  # bool: tokens the loss is taken over
    entropy: torch.Tensor  # of π_θ at each position, differentiable (entropy bonuses)
    samples: SampleTokens | None = None  # the tokens' samples (objectives and normalisation per sample)

    @property
    def log_ratio(self) -> torch.Tensor:
        return (self.logprobs - self.sampler_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)

    def sample_mean(self, values: torch.Tensor) -> torch.Tensor:
        """Per token: the mean of `values` over its sample's loss tokens, detached; e.g. of
        `log_ratio`, the log of the sample's geometric-mean ratio. Under context parallelism an
        all-reduce over the group: every rank must call it alike, whatever its own tokens."""
        if self.samples is None:
            raise ValueError("LossInputs.samples is not set: per-sample means need the tokens' samples")
        return self.samples.mean(values.detach(), self.loss_mask)


@dataclass
class LossTerms:
    per_token: torch.Tensor  # loss of each token; only loss-mask entries are used
    excluded: torch.Tensor  # bool: tokens the objective masked, clipped or truncated


Objective = Callable[..., LossTerms]


def masked_is(inputs: LossInputs, low: float, high: float) -> LossTerms:
    """−r·A where r = π/μ lies in [low, high]; tokens outside contribute nothing."""
    log_ratio = inputs.log_ratio
    excluded = (log_ratio.detach() < math.log(low)) | (log_ratio.detach() > math.log(high))
    per_token = -torch.exp(log_ratio) * inputs.advantages
    return LossTerms(torch.where(excluded, 0.0, per_token), excluded)


def ppo_clip(inputs: LossInputs, eps_low: float, eps_high: float) -> LossTerms:
    """−min(r·A, clip(r, 1−ε_low, 1+ε_high)·A): PPO's pessimistic clipped surrogate."""
    ratio = torch.exp(inputs.log_ratio)
    unclipped = ratio * inputs.advantages
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * inputs.advantages
    return LossTerms(-torch.minimum(unclipped, clipped), (clipped < unclipped).detach())


def tis(inputs: LossInputs, cap: float) -> LossTerms:
    """−sg(min(r, C))·A·log π: the policy gradient weighted by a truncated importance ratio."""
    ratio = torch.exp(inputs.log_ratio.detach())
    return LossTerms(-ratio.clamp(max=cap) * inputs.advantages * inputs.logprobs, ratio > cap)


def gspo(inputs: LossInputs, eps_low: float, eps_high: float) -> LossTerms:
    """GSPO (token form): −min(s·A, clip(s, 1−ε_low, 1+ε_high)·A) on every loss token of a sample,
    s its geometric-mean ratio exp(mean log r); the value is s, the gradient s·∇log π of the token."""
    log_ratio = inputs.log_ratio
    ratio = torch.exp(inputs.sample_mean(log_ratio) + log_ratio - log_ratio.detach())
    unclipped = ratio * inputs.advantages
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * inputs.advantages
    return LossTerms(-torch.minimum(unclipped, clipped), (clipped < unclipped).detach())


def kl_penalty(log_ratio: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(μ‖π) from tokens sampled by μ: k3 = r − 1 − log r, or (log r)²."""
    if estimator == "k3":
        return torch.exp(log_ratio) - 1 - log_ratio
    return log_ratio**2


def import_objective(import_path: str) -> Objective:
    module_name, _, attr = import_path.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise UserError(f"loss.import_path '{import_path}' cannot be imported: {e}") from None
    if not callable(fn):
        raise UserError(f"loss.import_path '{import_path}' is not callable")
    return fn


def check_options(fn: Objective, import_path: str, options: dict[str, Any]) -> None:
    """`loss.options` must be keyword arguments `fn` takes after its inputs, with every one it
    needs: a misspelt option would otherwise fail the first step, or pass unnoticed into **kwargs."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # (a builtin or C function: nothing to check against)
        return
    try:
        signature.bind(None, **options)
    except TypeError as e:
        takes = list(signature.parameters)[1:]
        raise UserError(
            f"loss.options do not fit '{import_path}': {e} (it takes: {', '.join(takes) or 'no options'})"
        ) from None


def build_objective(cfg: LossConfig) -> Callable[[LossInputs], LossTerms]:
    """The configured objective with its options bound."""
    if isinstance(cfg, MaskedISLoss):
        low, high = cfg.bounds()
        return lambda inputs: masked_is(inputs, low, high)
    if isinstance(cfg, PPOClipLoss):
        return lambda inputs: ppo_clip(inputs, cfg.eps_low, cfg.eps_high)
    if isinstance(cfg, TISLoss):
        return lambda inputs: tis(inputs, cfg.cap)
    if isinstance(cfg, GSPOLoss):
        return lambda inputs: gspo(inputs, cfg.eps_low, cfg.eps_high)
    assert isinstance(cfg, CustomLoss)
    fn, options = import_objective(cfg.import_path), dict(cfg.options)
    check_options(fn, cfg.import_path, options)

    def custom(inputs: LossInputs) -> LossTerms:
        terms = fn(inputs, **options)
        if not isinstance(terms, LossTerms) or terms.per_token.shape != inputs.logprobs.shape:
            raise UserError(f"loss '{cfg.import_path}' must return LossTerms with per-token tensors")
        return terms

    return custom


SUMMED = ("loss", "loss_tokens", "excluded_tokens", "mismatch_kl", "entropy")


@dataclass
class LossStats:
    """Sums over loss tokens, `sums[i]` for `SUMMED[i]`, and the largest |log π − log μ|.

    Kept as float64 tensors on the compute device and added up across micro-batches without
    synchronising with the host; `means` reads them once per step, after the all-reduce.
    """

    sums: torch.Tensor
    max_abs_log_ratio: torch.Tensor

    @classmethod
    def zeros(cls, device: torch.device) -> "LossStats":
        sums = torch.zeros(len(SUMMED), dtype=torch.float64, device=device)
        return cls(sums, torch.zeros((), dtype=torch.float64, device=device))

    def add(self, other: "LossStats") -> None:
        self.sums += other.sums
        self.max_abs_log_ratio = torch.maximum(self.max_abs_log_ratio, other.max_abs_log_ratio)

    def means(self) -> dict[str, Any]:
        total = dict(zip(SUMMED, self.sums.tolist(), strict=True))
        n = max(total["loss_tokens"], 1.0)
        return {
            "loss": total["loss"],
            "loss_tokens": int(total["loss_tokens"]),
            "masked_fraction": total["excluded_tokens"] / n,
            "mismatch_kl": total["mismatch_kl"] / n,
            "max_abs_logprob_diff": float(self.max_abs_log_ratio),
            "entropy": total["entropy"] / n,
        }


def policy_loss(
    objective: Callable[[LossInputs], LossTerms],
    cfg: LossConfig,
    inputs: LossInputs,
    num_loss_tokens: int,
    num_loss_samples: int | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """This micro-batch's share of the step loss: divided by the step's `num_loss_tokens`, or with
    `normalize = "sample"` weighted per sample and divided by its `num_loss_samples`."""
    terms = objective(inputs)
    per_token = terms.per_token
    if cfg.kl_coef > 0:
        per_token = per_token + cfg.kl_coef * kl_penalty(inputs.log_ratio, cfg.kl_estimator)
    mask, divisor = inputs.loss_mask, num_loss_tokens
    if cfg.normalize == "sample":
        if inputs.samples is None or num_loss_samples is None:
            raise ValueError(
                "normalize = 'sample' needs the tokens' samples and the step's number of samples"
            )
        per_token, divisor = per_token * inputs.samples.weights().to(per_token.dtype), num_loss_samples
    loss = torch.where(mask, per_token, 0.0).sum() / max(divisor, 1)
    with torch.no_grad():
        log_ratio = (inputs.logprobs - inputs.sampler_logprobs).double()
        log_ratio = torch.where(mask, log_ratio, 0.0)
        sums = [
            loss.double(),
            mask.sum().double(),
            (terms.excluded & mask).sum().double(),
            torch.where(mask, kl_penalty(log_ratio, "k3"), 0.0).sum(),
            torch.where(mask, inputs.entropy.double(), 0.0).sum(),
        ]
        stats = LossStats(torch.stack(sums), log_ratio.abs().max())
    return loss, stats
