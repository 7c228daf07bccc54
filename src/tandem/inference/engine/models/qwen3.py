"""Qwen3 (dense) over the paged KV cache. Parameter names equal Hugging Face's, so a checkpoint's
state dict loads as is. Tokens of all sequences in a step are flattened into one `[T]` batch;
the decoder layer takes its MLP as a module so a mixture-of-experts block can replace it.

q/k/v and gate/up projections run as one matmul each: after loading, the Hugging Face-named
weights become views into a fused weight, so checkpoints (and weight updates) still address
them by their usual names. On CUDA the elementwise chains run as fused Triton kernels
(kernels.py); on CPU as the torch ops below, which follow transformers' order of rounding.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from tandem.inference.engine.attention import AttentionMetadata, paged_attention, write_kv

try:
    from tandem.inference.engine import kernels
except ImportError:  # no Triton: the torch path everywhere
    kernels = None


@dataclass
class Rope:
    positions: torch.Tensor
    cos_table: torch.Tensor  # [max_positions, head_dim], float32
    sin_table: torch.Tensor
    cos: torch.Tensor | None = None  # the rows of `positions`, in the activation dtype (torch path)
    sin: torch.Tensor | None = None


def fuse_linears(*linears: nn.Linear) -> torch.Tensor:
    """One weight for several bias-free projections; each projection's weight becomes a view of it."""
    fused = torch.cat([lin.weight.detach() for lin in linears])
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(fused[start : start + rows], requires_grad=False)
        start += rows
    return fused


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.use_kernels = False

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), or (norm(x), x) without a residual."""
        if self.use_kernels:
            return kernels.rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
        return self.normalize(x), x

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_theta(config: PretrainedConfig) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"rope type {params['rope_type']!r} is not supported by the native engine")
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


class RotaryEmbedding(nn.Module):
    """cos/sin table computed in float32 like the reference, cast to the activations' dtype on use."""

    def __init__(self, head_dim: int, theta: float, max_positions: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype, gather: bool) -> Rope:
        rope = Rope(positions, self.cos, self.sin)
        if gather:
            rope.cos = self.cos[positions].to(dtype)[:, None, :]
            rope.sin = self.sin[positions].to(dtype)[:, None, :]
        return rope


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Qwen3Attention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.head_dim**-0.5
        bias = getattr(config, "attention_bias", False)
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.use_kernels = False
        self.qkv_weight: torch.Tensor | None = None

    def fuse(self) -> None:
        if self.q_proj.bias is None:
            self.qkv_weight = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        if self.use_kernels and self.qkv_weight is not None:
            q, k, v = kernels.qk_norm_rope_store(
                F.linear(x, self.qkv_weight), self.num_heads, self.num_kv_heads, self.head_dim,
                self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                rope.cos_table, rope.sin_table, rope.positions, *kv_cache, meta.slot_mapping,
            )  # fmt: skip
        else:
            if self.qkv_weight is not None:
                kv_width = self.num_kv_heads * self.head_dim
                q, k, v = F.linear(x, self.qkv_weight).split(
                    [self.num_heads * self.head_dim, kv_width, kv_width], -1
                )
            else:
                q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q = self.q_norm.normalize(q.reshape(tokens, self.num_heads, self.head_dim))
            k = self.k_norm.normalize(k.reshape(tokens, self.num_kv_heads, self.head_dim))
            v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
            q, k = apply_rope(q, rope.cos, rope.sin), apply_rope(k, rope.cos, rope.sin)
            write_kv(*kv_cache, k, v, meta.slot_mapping)
        out = paged_attention(q, k, v, *kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class Qwen3MLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

        self.use_kernels = False
        self.gate_up_weight: torch.Tensor | None = None

    def fuse(self) -> None:
        self.gate_up_weight = fuse_linears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate_up = F.linear(x, self.gate_up_weight)
        if self.use_kernels:
            return self.down_proj(kernels.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(config)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Rope,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x is the previous block's output, not yet added to the residual stream."""
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, rope, kv_cache, meta), residual)
        return self.mlp(h), residual


class Qwen3Model(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(config, Qwen3MLP(config)) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, config: PretrainedConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.max_positions = max_positions
        self.use_kernels = False
        self.rotary = self._rotary()

    def _rotary(self) -> RotaryEmbedding:
        head_dim = self.model.layers[0].self_attn.head_dim
        return RotaryEmbedding(head_dim, rope_theta(self.config), self.max_positions)

    def prepare(self, device: torch.device, use_kernels: bool) -> None:
        """After loading weights onto the meta model: build the rope table on `device`, fuse the
        projections, and choose the fused kernels (CUDA with Triton) or the torch path."""
        with torch.device(device):
            self.rotary = self._rotary()
        self.use_kernels = use_kernels and device.type == "cuda" and kernels is not None
        for module in self.modules():
            if hasattr(module, "fuse"):
                module.fuse()
            if hasattr(module, "use_kernels"):
                module.use_kernels = self.use_kernels

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states after the final norm, one row per input token."""
        x = self.model.embed_tokens(input_ids)
        rope = self.rotary(positions, x.dtype, gather=not self.use_kernels)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, rope, kv_cache, meta)
        return self.model.norm(x, residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
