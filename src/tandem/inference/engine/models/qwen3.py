"""Qwen3 (dense) over the paged KV cache. Parameter names equal Hugging Face's, so a checkpoint's
state dict loads as is. Tokens of all sequences in a step are flattened into one `[T]` batch;
the decoder layer takes its MLP as a module so a mixture-of-experts block can replace it.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from tandem.inference.engine.attention import AttentionMetadata, paged_attention


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


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

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


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

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(tokens, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = paged_attention(q, k, v, *kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class Qwen3MLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(config)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, rope, kv_cache, meta):  # type: ignore[no-untyped-def]
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


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
        self.rotary = self._rotary()

    def _rotary(self) -> RotaryEmbedding:
        head_dim = self.model.layers[0].self_attn.head_dim
        return RotaryEmbedding(head_dim, rope_theta(self.config), self.max_positions)

    def to_device(self, device: torch.device) -> None:
        """Rebuild the (non-checkpoint) rope table on `device` after loading weights onto the meta model."""
        with torch.device(device):
            self.rotary = self._rotary()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states after the final norm, one row per input token."""
        x = self.model.embed_tokens(input_ids)
        rope = self.rotary(positions, x.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, rope, kv_cache, meta)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
