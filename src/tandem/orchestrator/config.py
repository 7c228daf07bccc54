"""Configuration of the orchestrator (`uv run orchestrator @ rl.toml`)."""

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from tandem.client.config import ClientConfig, SamplingConfig
from tandem.config.base import CPStyle, ModelConfig, Section, base_urls, cp_width_multiple
from tandem.envs.config import EnvConfig, chosen_environments
from tandem.monitor.config import MonitorConfig
from tandem.transport.config import WeightsConfig


class AdvantageConfig(Section):
    """Group-relative advantages: reward minus the mean reward of the prompt's group."""

    std_normalize: bool = Field(False, description="Also divide by the group's reward std (+1e-6).")


class EvalConfig(Section):
    """Periodic greedy evaluation on each environment's held-out split."""

    interval: int = Field(
        0, ge=0, description="Evaluate before every `interval`-th step and after the last; 0 = never."
    )
    num_tasks: int = Field(
        64, gt=0, description="Held-out tasks of each environment per evaluation (the first N of its split)."
    )
    max_tokens: int | None = Field(None, gt=0, description="Generation limit; default: sampling.max_tokens.")
    collapse_evals: int = Field(
        3,
        ge=0,
        description="Warn when the held-out reward and the sampling entropy both fell at this many "
        "evaluations in a row (orchestrator/collapse.py); 0 = never.",
    )


class OrchestratorConfig(Section):
    model: ModelConfig = Field(
        ModelConfig(),
        description="The policy's initial checkpoint: its tokenizer measures prompts; "
        "servers serve it as version 0.",
    )
    seq_len: int = Field(2048, gt=0, description="Most tokens (prompt + completion) of one sample.")
    max_steps: int = Field(
        100, gt=0, description="Trainer steps to produce rollouts for (steps 0..max_steps-1)."
    )
    run_dir: Path = Field(Path("runs/rl"), description="Shared run directory (rollouts/, weights/, metrics).")
    seed: int = Field(
        0,
        description="Seed of the task order (the tasks of step N depend on seed and N only) and, with "
        "seeded_sampling, of every sampling request.",
    )
    seeded_sampling: bool = Field(
        False,
        description="Send every sampling request a seed derived from seed, the step, the task and the "
        "sample index: with max_async_level = 0 a CPU run repeats exactly (docs/async.md).",
    )
    resume: bool = Field(
        False,
        description="Continue after the last complete rollouts/step_N instead of refusing a used run_dir.",
    )

    batch_size: int = Field(64, gt=0, description="Samples per trainer step (prompts × group_size).")
    group_size: int = Field(
        8,
        ge=2,
        description="Completions per prompt (one request with n=group_size); at least 2: advantages are "
        "relative to the prompt's group, so a group of one has no learning signal.",
    )
    num_ranks: int = Field(
        1, gt=0, description="Trainer ranks; one rank_R.bin file per data-parallel group (num_ranks / cp)."
    )
    cp: int = Field(
        1,
        gt=0,
        description="The trainer's context-parallel degree (trainer.parallel.cp): its cp ranks share each "
        "micro-batch, whose width is padded to what cp_style needs.",
    )
    cp_style: CPStyle = Field("ulysses", description="The trainer's trainer.parallel.cp_style.")
    share_prompts: bool = Field(
        False,
        description="Pack the samples of one prompt with the prompt once (its completions as branches "
        "that each see the prompt): the trainer computes each group's prompt once instead of group_size "
        "times, with the same loss. Needs the trainer's tandem model with attention sdpa or flex (or "
        "auto), cp = 1 and not GLM-5 (transport/rollouts.py).",
    )
    micro_batch_tokens: int = Field(
        8192,
        gt=0,
        description="Token budget of one packed micro-batch of a trainer data-parallel group (at least "
        "seq_len); under context parallelism each of its cp ranks holds 1/cp of it.",
    )
    max_async_level: int = Field(
        1,
        ge=0,
        description="Rollouts for step N come from policy version >= N - max_async_level; 0 = synchronous.",
    )
    filter_zero_advantage_groups: bool = Field(
        False, description="Drop groups whose rewards are all equal and sample replacement prompts."
    )
    max_filtered_groups: int = Field(
        64,
        ge=0,
        description="Per step, after this many dropped groups the batch is filled with zero-advantage groups.",
    )

    sampling: SamplingConfig = SamplingConfig()
    servers: list[str] = Field(
        ["http://127.0.0.1:8000"],
        description="Base URLs of the inference servers (without /v1); groups go to the least loaded.",
    )
    prefill_servers: list[str] = Field(
        [],
        description="Base URLs of prefill servers (docs/inference-engine.md, 'Prefill on other servers'): "
        "they take every weight update as the servers do, and no rollouts.",
    )
    env: EnvConfig = EnvConfig()
    envs: list[EnvConfig] = Field(
        [],
        description="Several environments mixed by weight ([[envs]] tables with [env]'s keys); "
        "when given, replaces [env].",
    )
    rollout_timeout: float = Field(
        900.0,
        gt=0,
        description="Seconds one group's rollouts may take; a group that takes longer fails (logged with "
        "its task id) and is replaced.",
    )
    advantage: AdvantageConfig = AdvantageConfig()
    eval: EvalConfig = EvalConfig()
    client: ClientConfig = ClientConfig()
    weights: WeightsConfig = WeightsConfig()
    monitor: MonitorConfig = Field(
        MonitorConfig(), description="W&B: the orchestrator logs its own and the trainer's metrics there."
    )
    log_level: Literal["debug", "info", "warning"] = Field("info", description="Log verbosity (stderr).")

    _base_urls = field_validator("servers", "prefill_servers")(base_urls)

    @model_validator(mode="after")
    def check_shapes(self) -> "OrchestratorConfig":
        if self.batch_size % self.group_size:
            raise PydanticCustomError(
                "shape",
                f"batch_size ({self.batch_size}) must be a multiple of group_size ({self.group_size})",
            )
        if self.seq_len <= self.sampling.max_tokens:
            raise PydanticCustomError(
                "shape",
                f"seq_len ({self.seq_len}) must exceed sampling.max_tokens ({self.sampling.max_tokens}) "
                "to leave room for the prompt",
            )
        if self.eval.max_tokens is not None and self.seq_len <= self.eval.max_tokens:
            raise PydanticCustomError(
                "shape",
                f"seq_len ({self.seq_len}) must exceed eval.max_tokens ({self.eval.max_tokens}) "
                "to leave room for the prompt",
            )
        if self.num_ranks % self.cp:
            raise PydanticCustomError(
                "shape",
                f"cp ({self.cp}) must divide num_ranks ({self.num_ranks}): the trainer's context-parallel "
                "groups (trainer.parallel.cp) split its ranks",
            )
        if self.share_prompts and self.cp > 1:
            raise PydanticCustomError(
                "shape",
                f"share_prompts needs cp = 1 (trainer.parallel.cp is {self.cp}): context parallelism splits "
                "rows by columns, which shared prompts do not survive",
            )
        if self.micro_batch_tokens < self.seq_len:
            raise PydanticCustomError(
                "shape",
                f"micro_batch_tokens ({self.micro_batch_tokens}) must be at least seq_len ({self.seq_len})",
            )
        if not self.servers:
            raise PydanticCustomError(
                "shape", "servers is empty: give at least one inference server base URL"
            )
        if self.sampling.request_seed is not None:
            raise PydanticCustomError(
                "shape",
                "sampling.request_seed is set per request by the orchestrator: set seeded_sampling = true "
                "(and seed) instead",
            )
        chosen_environments(self.env, self.envs)
        return self

    @property
    def width_multiple(self) -> int:
        """What every micro-batch's width is a multiple of, for the trainer's context parallelism."""
        return cp_width_multiple(self.cp, self.cp_style)

    @property
    def groups_per_step(self) -> int:
        return self.batch_size // self.group_size

    @property
    def trainer_shape(self) -> tuple[int, int]:
        """(data-parallel groups, cp) of the trainer a step is packed for (its READY marker)."""
        return self.num_ranks // self.cp, self.cp
