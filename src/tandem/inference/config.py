"""Configuration of the inference server (`uv run inference @ cfg.toml`)."""

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from tandem.config.base import ModelConfig, Section, base_urls
from tandem.inference.vllm.config import VLLMConfig
from tandem.transport.config import WeightsConfig


class EngineConfig(Section):
    """The native engine: batching and KV-cache budget."""

    max_num_seqs: int = Field(256, gt=0, description="Most sequences in the running batch.")
    max_num_batched_tokens: int = Field(8192, gt=0, description="Token budget of one engine step.")
    max_model_len: int | None = Field(
        None, gt=0, description="Context length; default: the model's (under rl and evaluate: their seq_len)."
    )
    block_size: int = Field(16, gt=0, description="Tokens per KV-cache block.")
    prefix_caching: bool = Field(
        True,
        description="Reuse the cached keys and values of full blocks a new prompt shares with an "
        "earlier one (multi-turn rollouts, repeated prompts); forgotten when new weights load.",
    )
    kv_cache_memory_gb: float | None = Field(
        None, gt=0, description="KV-cache budget in GiB; default: a fraction of free device memory."
    )
    gpu_memory_utilization: float = Field(
        0.85,
        gt=0,
        le=1,
        description="Share of the GPU's memory in use once the KV cache is allocated (unless "
        "kv_cache_memory_gb is set); under rl, a server sharing its GPU with the trainer gets "
        "deployment.colocated_gpu_memory_utilization.",
    )
    max_n: int = Field(64, gt=0, description="Largest `n` one request may ask for.")
    weight_update_mode: Literal["finish_old", "wait"] = Field(
        "finish_old",
        description="finish_old: in-flight requests continue on the new weights after an update and "
        "report both versions; wait: an update waits until in-flight requests finish.",
    )
    lora_base_on_cpu: bool = Field(
        False,
        description="LoRA weight updates: keep the unmerged base of the adapted weights (what every adapter "
        "is merged onto) in host memory instead of on the device: saves their size on the GPU, costs a "
        "host-to-device copy of them per update.",
    )
    core_process: bool | None = Field(
        None,
        description="Run the engine core in its own process: the HTTP event loop (parsing, tokenizing, "
        "JSON) and the engine stop sharing one GIL; requests and each step's tokens cross a pipe. An "
        "in-memory weights.transport's receiver is built in that process, beside the model "
        "(docs/inference-engine.md, 'The engine process'). Unset: on when the model runs on CUDA "
        "(measured faster there), off on CPU (where the process's start costs more than it saves).",
    )
    cuda_graphs: bool = Field(True, description="Capture decode steps in CUDA graphs (CUDA only).")
    prompt_graphs: bool | None = Field(
        None,
        description="Run steps with prompts (prefill, prompt chunks, steps that mix them with decodes) as "
        "CUDA graphs of each layer's work outside attention, captured per token-count bucket, with "
        "attention run eagerly between them (docs/inference-engine.md, 'Prompt-step graphs'). None "
        "(default): on CUDA with cuda_graphs for families over the shared attention, else off; true: "
        "also on CPU, where the pieces run eagerly (a check of the layout, no speed-up), with a "
        "warning where the model or the settings do not allow it; false: off.",
    )
    triton_kernels: bool = Field(True, description="Fused Triton kernels for the forward pass (CUDA only).")
    prompt_attention: Literal["auto", "flash", "varlen"] = Field(
        "flash",
        description="Kernels of prompt and prompt-chunk attention: flash = SDPA's flash and "
        "memory-efficient kernels only, which need no per-shape setup (the default: on an H200 it "
        "served 1.1x auto's whole responses and 1.37x its streams, TTFT p50 284 ms against 512); auto = "
        "PyTorch's SDPA choice over a padded batch (cuDNN first on Hopper, which builds an execution graph "
        "for each new batch shape on each thread); varlen = whole prompts through torch's variable-length "
        "flash kernel over their rows, unpadded, chunks as flash; on CPU flash is auto and varlen one SDPA "
        "call per prompt (docs/inference-engine.md, 'Prompt attention').",
    )
    quantization: Literal["none", "fp8"] = Field(
        "none",
        description="fp8: the decoder layers' linear weights in e4m3 with 128×128 block scales (the layout of "
        "published FP8 checkpoints), quantized at load and at every weight update; CUDA with compute "
        "capability 8.9+ (docs/inference-engine.md, 'FP8 weights').",
    )
    fp8_kernel: Literal["triton", "w8a8", "blockwise", "rowwise"] = Field(
        "rowwise",
        description="The FP8 matmul: rowwise, the default and the fastest measured on an H200 "
        "(torch._scaled_mm, per-token and per-channel scales; weights re-quantized per row), "
        "triton (block-scaled weights, bf16 activations), w8a8 (Triton, block-scaled weights, "
        "1x128-scaled e4m3 activations) or blockwise "
        "(torch._scaled_mm, 1x128 activation and 128x128 weight scales; SM90).",
    )


class PrefillConfig(Section):
    """Prefill on other servers (prefill/decode disaggregation; docs/inference-engine.md)."""

    servers: list[str] = Field(
        [],
        description="Base URLs (http://host:port) of tandem servers that compute this server's prompts: it "
        "takes their keys and values into its prefix cache and only decodes. Empty: it computes its own.",
    )
    min_tokens: int = Field(
        64,
        gt=0,
        description="Prompts with fewer tokens than this beyond what this server's prefix cache holds are "
        "computed here: sending them costs more than computing them.",
    )
    timeout_s: float = Field(
        60, gt=0, description="How long a prompt waits for a prefill server before it is computed here."
    )
    transport: Literal["http", "shared", "p2p"] = Field(
        "http",
        description="How the blocks travel: http = in the answer's body (any two machines); shared = through "
        "the prefill server's staging buffers (one machine: CUDA IPC between GPUs, which must all be visible "
        "to this server, or shared memory on CPU); p2p = sent from those buffers over a link of each "
        "(prefill, decode) pair (NCCL between GPUs, gloo on CPU; any two machines; the prefill server's "
        "host must accept connections on ports its OS picks).",
    )
    transfer_timeout_s: float = Field(
        10,
        gt=0,
        description="p2p: how long a link may take to form, and one transfer to complete, before the link is "
        "dropped and that prefill server's prompts travel by HTTP (the decode engine waits for a transfer).",
    )
    staging_mb: int = Field(
        256, gt=0, description="As a prefill server: the size of each staging buffer (MiB) for `shared`."
    )
    staging_buffers: int = Field(
        4,
        gt=0,
        description="As a prefill server: staging buffers, one per export in flight (allocated at first use).",
    )

    @field_validator("servers")
    @classmethod
    def _urls(cls, servers: list[str]) -> list[str]:
        return [url.rstrip("/") for url in base_urls(servers)]


class InferenceConfig(Section):
    model: ModelConfig = ModelConfig()
    host: str = Field("127.0.0.1", description="Address to bind; 127.0.0.1 keeps the server local.")
    port: int = Field(8000, ge=0, le=65535, description="Port to listen on.")
    api_key: str | None = Field(None, description="When set, requests need 'Authorization: Bearer KEY'.")
    served_model_name: str | None = Field(None, description="Model name in the API; default: model.name.")
    backend: Literal["auto", "native", "vllm"] = Field(
        "auto", description="auto = vllm when it is installed and a GPU is present, else native."
    )
    run_dir: Path | None = Field(None, description="Run directory; lets /update_weights take `step: N`.")
    seed: int = Field(0, description="Seed of unseeded sampling.")
    pause_timeout_s: float = Field(
        600, gt=0, description="How long a generation request waits while the server is paused before a 503."
    )
    stream_interval_s: float = Field(
        0.05,
        ge=0,
        description="Least time between two chunks of one streamed response (the first is sent at once); "
        "0 sends every engine step's tokens. Fewer, larger chunks keep hundreds of streams cheap.",
    )
    trust_request_chat_template: bool = Field(
        False,
        description="Let chat requests bring their own template (chat_template_kwargs.chat_template). Off: "
        "refused with a 400, since rendering a client's template runs its loops in the server's event loop "
        "(nested loops hold every request up for hours). The vLLM backend has vLLM's own switch.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Server log level.")
    access_log: bool = Field(False, description="Log every HTTP request (uvicorn's access log).")
    engine: EngineConfig = EngineConfig()
    prefill: PrefillConfig = PrefillConfig()
    vllm: VLLMConfig = VLLMConfig()
    weights: WeightsConfig = Field(
        WeightsConfig(), description="How new weights arrive (transport and where the trainer is)."
    )
