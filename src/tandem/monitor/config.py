"""Configuration of what a run reports beyond run_dir/metrics.jsonl (imports no torch or wandb)."""

from typing import Literal

from pydantic import Field

from tandem.config.base import Section


class WandbConfig(Section):
    """One Weights & Biases run for the whole RL run (docs/monitoring.md); needs the `wandb` extra."""

    project: str = Field("tandem", description="W&B project.")
    name: str | None = Field(None, description="Run name; default: the run directory's name.")
    entity: str | None = Field(None, description="W&B entity (user or team); default: yours.")
    mode: Literal["online", "offline", "disabled"] = Field(
        "online",
        description="online: stream to the W&B server; offline: write run_dir/wandb/ only (upload later "
        "with `wandb sync`); disabled: log nothing (and need no wandb package).",
    )
    tags: list[str] = Field([], description="Tags of the run.")
    sample_interval: int = Field(
        10, ge=0, description="Log a table of the step's rollouts every N steps (from step 0); 0 = never."
    )
    sample_rows: int = Field(64, gt=0, description="Most rollouts in one table (the step's first groups).")


class MonitorConfig(Section):
    """Where metrics go besides run_dir/metrics.jsonl."""

    wandb: WandbConfig | None = Field(
        None, description="Log to Weights & Biases ([monitor.wandb]); unset = no W&B."
    )

    @property
    def wandb_enabled(self) -> bool:
        return self.wandb is not None and self.wandb.mode != "disabled"
