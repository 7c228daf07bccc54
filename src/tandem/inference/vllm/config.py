"""Settings of the vLLM backend."""

from typing import Literal

from pydantic import Field

from tandem.config.base import Section


class VLLMConfig(Section):
    python: str | None = Field(
        None, description="Python interpreter of the virtual environment that has vLLM; default: this one."
    )
    extra_args: list[str] = Field(default_factory=list, description="Extra arguments for vLLM's server.")
    startup_timeout_s: float = Field(600, gt=0, description="How long to wait for vLLM's /health.")
    port: int = Field(
        0, ge=0, le=65535, description="Port of the vLLM subprocess on 127.0.0.1; 0 = a free one."
    )
    max_model_len: int | None = Field(
        None, gt=0, description="Context length; default: the model's (under rl: its seq_len)."
    )
    gpu_memory_utilization: float = Field(
        0.85,
        gt=0,
        le=1,
        description="vLLM's --gpu-memory-utilization; under rl, a server sharing its GPU with the trainer "
        "gets deployment.colocated_gpu_memory_utilization.",
    )
    enforce_eager: bool = Field(False, description="Skip torch.compile and CUDA graphs (faster start-up).")
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = Field(
        "processed_logprobs",
        description="processed: log_softmax(logits / temperature) after top-k/top-p, the distribution "
        "the token was sampled from (as the native engine reports it); raw: log_softmax(logits).",
    )
    request_timeout_s: float = Field(
        3600, gt=0, description="Longest a forwarded request may take (a paused server holds requests)."
    )
    admin_timeout_s: float = Field(600, gt=0, description="Longest a weight load, pause or resume may take.")
    max_lora_rank: int | None = Field(
        None,
        gt=0,
        description="Serve LoRA adapters up to this rank (vLLM's --enable-lora); weight updates are then "
        "adapters, loaded through vLLM's LoRA API. The rl launcher sets it from trainer.lora.rank.",
    )
