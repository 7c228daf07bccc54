"""The `sft` command's configuration."""

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from tandem.config.base import ModelConfig, Section
from tandem.envs.reverse_text import MAX_LEN, MIN_LEN
from tandem.models.tiny import TinyShape
from tandem.trainer.config import ComputeDtype, LoRAConfig, OptimConfig, ParallelConfig


class DataConfig(Section):
    """Which chats to train on and how they are batched."""

    task: Literal["reverse_text", "chat_jsonl"] = Field(
        "reverse_text",
        description="Task whose train split is the data, or 'chat_jsonl': whole chats read from `path`.",
    )
    path: Path | None = Field(
        None,
        description='chat_jsonl: a JSONL file with one {"messages": [...]} chat per line (UTF-8; roles '
        'system, developer, user, assistant, tool; string contents; an optional "tools" list goes to '
        "the chat template, as RL environments pass theirs); the loss covers every assistant turn but "
        "an opening one. Every line is checked and templated before training.",
    )
    num_examples: int = Field(
        10_000, ge=0, description="Distinct training examples (chat_jsonl: the first N chats; 0 = all)."
    )
    min_len: int = Field(MIN_LEN, ge=MIN_LEN, le=MAX_LEN, description="Shortest text of the task.")
    max_len: int = Field(MAX_LEN, ge=MIN_LEN, le=MAX_LEN, description="Longest text of the task.")
    batch_size: int = Field(64, gt=0, description="Examples per optimizer step, over all ranks together.")
    micro_batch_size: int = Field(
        4,
        gt=0,
        description="Packed rows of seq_len tokens per forward pass on each rank (accumulated); under "
        "context parallelism the cp ranks of a group share them, each holding 1/cp of every row.",
    )
    shuffle: bool = Field(True, description="Reshuffle the examples every epoch (seeded by `seed`).")

    @model_validator(mode="after")
    def check_task_keys(self) -> "DataConfig":
        """A key of the other task is an error, not ignored: `path` without task = 'chat_jsonl' would
        train on reverse_text instead of the file."""
        if self.task != "chat_jsonl" and self.path is not None:
            raise PydanticCustomError(
                "path_without_chat_jsonl",
                "path = '{path}' is read only with task = 'chat_jsonl' (task is '{task}')",
                {"path": str(self.path), "task": self.task},
            )
        if self.task == "chat_jsonl" and (given := sorted({"min_len", "max_len"} & self.model_fields_set)):
            raise PydanticCustomError(
                "lengths_with_chat_jsonl",
                "{keys}: the reverse_text task's text lengths; task = 'chat_jsonl' has no such setting",
                {"keys": " and ".join(given)},
            )
        return self


class CheckpointConfig(Section):
    interval: int = Field(
        0, ge=0, description="Write run_dir/checkpoints/step_N every this many steps; 0 = only at the end."
    )
    keep: int = Field(2, ge=0, description="Keep the newest this many checkpoints; 0 = keep all.")
    final: bool = Field(True, description="Also checkpoint after the last step (so the run can be extended).")


class EvalConfig(Section):
    """Greedy decoding of held-out tasks during training, logged as eval/reward and eval/exact_match.

    For data.task = reverse_text (chat_jsonl has no held-out split; evaluate those models with `evaluate`)."""

    interval: int = Field(0, ge=0, description="Evaluate every this many steps; 0 = never during training.")
    final: bool = Field(True, description="Also evaluate the final model.")
    num_tasks: int = Field(200, gt=0, description="Held-out tasks to decode (the first N of the split).")
    batch_size: int = Field(100, gt=0, description="Prompts decoded together.")
    max_new_tokens: int = Field(24, gt=0, description="Longest answer decoded per task.")


class LogConfig(Section):
    interval: int = Field(10, gt=0, description="Print a plain progress line every this many steps (no TTY).")


class SFTConfig(Section):
    """Supervised fine-tuning of a causal LM on chats; loss on assistant tokens only."""

    model: ModelConfig = Field(
        default_factory=ModelConfig,
        description="Model to train. dtype auto = fp32 weights (bf16 compute on GPU); "
        "an explicit dtype trains weights in that dtype.",
    )
    compute_dtype: ComputeDtype = "auto"
    seq_len: int = Field(512, gt=0, description="Tokens per packed row; every example must fit.")
    max_steps: int = Field(100, gt=0, description="Optimizer steps to train for (in total, across resumes).")
    run_dir: Path = Field(
        Path("runs/sft"), description="Output directory: metrics, checkpoints, final model."
    )
    seed: int = Field(0, description="Seed of data order and any randomness in training.")
    resume: bool = Field(False, description="Continue from the newest checkpoint in run_dir/checkpoints.")
    init_tiny_model: bool = Field(
        False,
        description="If model.name does not exist yet, first build tandem's random-init tiny Qwen3 there "
        "(for the CPU examples, which train from scratch).",
    )
    tiny: TinyShape = Field(
        default_factory=TinyShape, description="Shape and init seed of the model init_tiny_model builds."
    )
    parallel: ParallelConfig = Field(
        default_factory=ParallelConfig,
        description="Expert and context parallelism, activation checkpointing and offload, compile.",
    )
    lora: LoRAConfig | None = Field(
        None,
        description="Train LoRA adapters only: run_dir/final is then a PEFT adapter and run_dir/final-merged "
        "the model with it merged.",
    )
    data: DataConfig = Field(default_factory=DataConfig, description="Training data.")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Optimizer and LR schedule.")
    ckpt: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpointing.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Held-out evaluation.")
    log: LogConfig = Field(default_factory=LogConfig, description="Console logging.")

    @model_validator(mode="after")
    def check_eval_task(self) -> "SFTConfig":
        """Held-out evaluation asked of chat_jsonl (no held-out split) fails instead of never running."""
        if self.data.task == "chat_jsonl" and self.eval.interval:
            raise PydanticCustomError(
                "eval_with_chat_jsonl",
                "eval.interval = {interval}: data.task = 'chat_jsonl' has no held-out split to evaluate "
                "(set eval.interval = 0; evaluate the model with `evaluate`)",
                {"interval": self.eval.interval},
            )
        return self
