"""Configuration of the RL trainer (`uv run trainer @ cfg.toml`)."""

import math
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError

from tandem.config.base import ModelConfig, Section
from tandem.trainer.config import ComputeDtype, LoRAConfig, OptimConfig, ParallelConfig
from tandem.transport.config import WeightsConfig

MAX_LOG_RATIO = 20.0
"""The loss clamps log(π/μ) to ±this (a ratio of e^20 is already nonsense; beyond, exp overflows)."""


class LossBase(Section):
    kl_coef: float = Field(
        0.0, ge=0, description="Weight of a per-token KL(sampler ‖ policy) penalty on loss tokens; 0 = off."
    )
    kl_estimator: Literal["k3", "sq_log_ratio"] = Field(
        "k3", description="KL estimator: k3 = r − 1 − log r, or sq_log_ratio = (log r)²."
    )
    normalize: Literal["token", "sample"] = Field(
        "token",
        description="token: the step's loss is the mean over its loss tokens (every token weighs the same); "
        "sample: the mean over samples of each sample's mean over its tokens (gspo's default).",
    )


class MaskedISLoss(LossBase):
    """Default: −r·A on tokens whose ratio r = π/μ lies in the trust region; others masked."""

    type: Literal["masked_is"] = "masked_is"
    delta: float = Field(1.0, gt=0, description="Trust region [1/(1+delta), 1+delta] for the token ratio.")
    low: float | None = Field(None, gt=0, le=1, description="Lower ratio bound; overrides 1/(1+delta).")
    high: float | None = Field(None, ge=1, description="Upper ratio bound; overrides 1+delta.")

    def bounds(self) -> tuple[float, float]:
        low = self.low if self.low is not None else 1 / (1 + self.delta)
        high = self.high if self.high is not None else 1 + self.delta
        return low, high

    @model_validator(mode="after")
    def check_bounds(self) -> "MaskedISLoss":
        """Past e^±20 a bound would keep tokens whose clamped ratio has no gradient (say 'off'
        with e.g. high = 1e6, not 1e10)."""
        low, high = self.bounds()
        if math.log(high) > MAX_LOG_RATIO or math.log(low) < -MAX_LOG_RATIO:
            raise PydanticCustomError(
                "bounds",
                f"the ratio bounds [{low:.3g}, {high:.3g}] (low, high or delta) must lie within [e^-20, e^20] "
                "≈ [2.06e-9, 4.85e8]: the log ratio is clamped at ±20",
            )
        return self


class PPOClipLoss(LossBase):
    """−min(r·A, clip(r, 1−eps_low, 1+eps_high)·A)."""

    type: Literal["ppo_clip"]
    eps_low: float = Field(0.2, gt=0, lt=1, description="The ratio is clipped below at 1 − eps_low.")
    eps_high: float = Field(0.28, gt=0, description="The ratio is clipped above at 1 + eps_high.")


class TISLoss(LossBase):
    """Truncated importance sampling: −min(r, cap)·A·log π with the weight detached."""

    type: Literal["tis"]
    cap: float = Field(2.0, gt=0, description="Truncation C of the importance ratio.")


class GSPOLoss(LossBase):
    """GSPO: PPO's clipped surrogate on the sample's ratio, the geometric mean of its tokens' ratios."""

    type: Literal["gspo"]
    eps_low: float = Field(
        3e-4, gt=0, lt=1, description="The sample's ratio is clipped below at 1 − eps_low."
    )
    eps_high: float = Field(4e-4, gt=0, description="The sample's ratio is clipped above at 1 + eps_high.")
    normalize: Literal["token", "sample"] = Field(
        "sample",
        description="sample (GSPO's own): the mean over samples of each sample's token mean; token: over tokens.",
    )


class CustomLoss(LossBase):
    """A user objective `fn(inputs: LossInputs, **options) -> LossTerms` (tandem.trainer.rl.loss)."""

    type: Literal["custom"]
    import_path: str = Field(pattern=r"^[\w.]+:\w+$", description="'package.module:function'.")
    options: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the function.")


def loss_type(value: Any) -> str:
    """`type` may be left out: then it is the default, masked_is."""
    if isinstance(value, dict):
        return value.get("type", "masked_is")
    return getattr(value, "type", "masked_is")


LossConfig = Annotated[
    Annotated[MaskedISLoss, Tag("masked_is")]
    | Annotated[PPOClipLoss, Tag("ppo_clip")]
    | Annotated[TISLoss, Tag("tis")]
    | Annotated[GSPOLoss, Tag("gspo")]
    | Annotated[CustomLoss, Tag("custom")],
    Discriminator(loss_type),
]


class CheckpointConfig(Section):
    interval: int = Field(0, ge=0, description="Save a resumable checkpoint every N steps; 0 = never.")
    keep: int = Field(2, ge=0, description="Keep the newest N checkpoints; 0 = keep all.")
    final: bool = Field(
        True,
        description="With interval > 0, also checkpoint after the last step, so that --resume with a larger "
        "max_steps continues the run instead of training again from the last interval's checkpoint.",
    )


class RLOptimConfig(OptimConfig):
    """AdamW for RL: a small constant learning rate unless told otherwise."""

    lr: float = Field(3e-6, gt=0, description="Peak learning rate, reached after warmup.")
    schedule: Literal["cosine", "linear", "constant"] = Field(
        "constant", description="Decay after warmup, down to min_lr_ratio × lr at max_steps."
    )


class RLTrainerConfig(Section):
    """The RL trainer: consumes rollouts/step_N, publishes policy version N+1 (docs/weights.md)."""

    model: ModelConfig = ModelConfig()
    compute_dtype: ComputeDtype = "auto"
    run_dir: Path = Field(
        Path("runs/rl"), description="Shared run directory (rollouts, weights, checkpoints)."
    )
    max_steps: int = Field(20, gt=0, description="Optimizer steps; step N consumes rollouts/step_N.")
    seq_len: int | None = Field(
        None,
        gt=0,
        description="Longest packed row accepted (the run's seq_len, filled in by the launcher): a wider "
        "micro-batch, beyond the padding context parallelism adds, fails naming its step; unset = unchecked.",
    )
    seed: int = 0
    optim: RLOptimConfig = RLOptimConfig()
    parallel: ParallelConfig = ParallelConfig()
    lora: LoRAConfig | None = Field(
        None,
        description="Train LoRA adapters only; weight updates then carry the adapters (docs/weights.md).",
    )
    loss: LossConfig = Field(
        MaskedISLoss(),
        description="The policy loss: masked_is (the default), ppo_clip, tis, gspo or custom (docs/algorithms.md).",
    )
    ckpt: CheckpointConfig = CheckpointConfig()
    weights: WeightsConfig = WeightsConfig()
    logprob_chunk_size: int | None = Field(
        None,
        gt=0,
        description="Tokens per chunk of the output head when computing logprobs; "
        "unset = 4096 on CUDA, 1024 on CPU.",
    )
    rollout_timeout_s: float = Field(
        600.0, gt=0, description="How long to wait for rollouts/step_N/READY before failing."
    )
    resume: bool = Field(False, description="Continue from the newest checkpoint in run_dir/checkpoints.")
    prune_rollouts: bool = Field(
        True,
        description="Delete rollouts/step_N once a resume can no longer need it: steps before the one "
        "just trained, at each checkpoint (or every step when checkpoints are off).",
    )
