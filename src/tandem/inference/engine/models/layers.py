"""Layers the engine's model families share, over the paged KV cache, and the base class that
holds the contract between a family and the engine (models/__init__.py states it).

Parameter names equal Hugging Face checkpoint names, so a checkpoint's state dict loads as is
and weight updates address tensors by their usual names. Tokens of all sequences in a step are
flattened into one `[T]` batch. Several bias-free projections that read the same input (q|k|v,
gate|up) run as one matmul (`Projection`): after loading, their Hugging Face-named weights
become views into the fused weight. On CUDA the elementwise chains run as fused Triton kernels
(kernels.py); on CPU as the torch ops below, which follow transformers' order of rounding.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from tandem.inference.engine.attention import AttentionMetadata, paged_attention, write_kv
from tandem.inference.engine.fp8 import Fp8Weight, Quantized, Unscaled, padded_rows
from tandem.models.decoder_config import head_dim, partial_rotary_factor

try:
    from tandem.inference.engine import kernels
except ImportError:  # no Triton: the torch path everywhere
    kernels = None


@dataclass
class Rope:
    positions: torch.Tensor
    cos_table: torch.Tensor  # [max_positions, rotary_dim], float32
    sin_table: torch.Tensor
    cos: torch.Tensor | None = None  # the rows of `positions`, in the activation dtype (torch path)
    sin: torch.Tensor | None = None

    def rows(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the step's positions [T, 1, rotary_dim] in `dtype`, gathered once per step
        by the first layer that needs them (the fused kernels read the tables instead)."""
        if self.cos is None:
            self.cos = self.cos_table[self.positions].to(dtype)[:, None, :]
            self.sin = self.sin_table[self.positions].to(dtype)[:, None, :]
        return self.cos, self.sin


class Projection:
    """x·Wᵀ (+ b) for one weight that may hold several linear layers' rows (fused). `parts` are
    the (name, first row, rows) of the layers in it, named as in the checkpoint. `matmul`, when
    set, replaces the bf16 matmul (FP8 weights, fp8.py: then x may be `Quantized`, and with
    `defer_scales` the result `Unscaled`, where the FP8 kernel takes or gives them so)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, parts: list[tuple[str, int, int]]
    ) -> None:
        self.weight: torch.Tensor | None = weight
        self.bias = bias
        self.parts = parts
        self.matmul: Fp8Weight | None = None

    def __call__(self, x: torch.Tensor | Quantized, defer_scales: bool = False) -> torch.Tensor | Unscaled:
        if self.matmul is None:
            out = F.linear(x, self.weight)
        else:
            out = self.matmul(x, defer_scales and self.bias is None)
        return out if self.bias is None else out + self.bias


def rows_of(x: torch.Tensor | Quantized) -> int:
    return x.rows if isinstance(x, Quantized) else x.shape[0]


def fuse_linears(owner: nn.Module, names: list[str]) -> Projection:
    """One Projection over `owner`'s linear layers `names`; each layer's weight (and bias)
    becomes a view of the fused one, so loading a checkpoint into them fills it."""
    linears = [getattr(owner, name) for name in names]
    weight = (
        torch.cat([lin.weight.detach() for lin in linears])
        if len(linears) > 1
        else linears[0].weight.detach()
    )
    biased = linears[0].bias is not None
    bias = (
        (torch.cat([lin.bias.detach() for lin in linears]) if len(linears) > 1 else linears[0].bias.detach())
        if biased
        else None
    )
    parts, start = [], 0
    for name, lin in zip(names, linears, strict=True):
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[start : start + rows], requires_grad=False)
        if biased:
            lin.bias = nn.Parameter(bias[start : start + rows], requires_grad=False)
        parts.append((f"{name}.weight", start, rows))
        start += rows
    return Projection(weight, bias, parts)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.use_kernels = False
        self.quantize_for: Fp8Weight | None = None  # the FP8 matmul that reads the norm (fp8.fuse_launches)

    def forward(
        self, x: torch.Tensor | Unscaled, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | Quantized, torch.Tensor]:
        """(norm(x + residual), x + residual), or (norm(x), x) without a residual. With the
        kernels, x may be an FP8 product before its scales, and the norm is handed to
        `quantize_for` as e4m3 rows where that matmul takes them."""
        if self.use_kernels:
            x_scales = None
            if isinstance(x, Unscaled):
                x, x_scales = x.raw, x.scales()
            rows = x.shape[0]
            quantize = self.quantize_for is not None and self.quantize_for.takes_quantized(rows)
            out, residual = kernels.rms_norm(
                x, self.weight, self.eps, residual, x_scales, padded_rows(rows) if quantize else None
            )
            return (Quantized(*out, rows) if quantize else out), residual
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


def rotary_dim(config: PretrainedConfig, width: int | None = None) -> int:
    """The rotating channels of a head of `width` (default: the head width), by the partial factor."""
    return int((width or head_dim(config)) * partial_rotary_factor(config))


class RotaryEmbedding(nn.Module):
    """cos/sin table [max_positions, dim] computed in float32 like the reference, cast to the
    activations' dtype on use; `dim` is the rotating part of a head (all of it unless partial)."""

    def __init__(self, dim: int, theta: float, max_positions: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor) -> Rope:
        return Rope(positions, self.cos, self.sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] channels of x (all, unless the rotary embedding is partial)."""
    dim = cos.shape[-1]
    if dim < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :dim], cos, sin), x[..., dim:]], dim=-1)
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Grouped-query attention with rotary embeddings (partial where the config says so) and q/k
    RMSNorm per head (`qk_norm = "head"`: Qwen3, GLM-4.5), over the whole projection ("full":
    MiniMax-M2) or none. q/k/v carry the config's `attention_bias`, o_proj too unless `out_bias`
    says otherwise. The fused Triton kernel covers per-head norm with full rotation; the other
    variants take the torch path on CUDA too."""

    def __init__(
        self, config: PretrainedConfig, qk_norm: str | None = "head", out_bias: bool | None = None
    ) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim(config)
        self.scale = self.head_dim**-0.5
        bias = bool(getattr(config, "attention_bias", False))
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(
            self.num_heads * self.head_dim, hidden, bias=bias if out_bias is None else out_bias
        )
        self.qk_norm = qk_norm
        if qk_norm is not None:
            per_head = qk_norm == "head"
            self.q_norm = RMSNorm(
                self.head_dim if per_head else self.q_proj.out_features, config.rms_norm_eps
            )
            self.k_norm = RMSNorm(
                self.head_dim if per_head else self.k_proj.out_features, config.rms_norm_eps
            )
        self.fusable = qk_norm == "head" and rotary_dim(config) == self.head_dim  # the kernel's case
        self.use_kernels = False
        self.defer_out = False  # return o_proj's FP8 product before its scales (fp8.fuse_launches)
        self.qkv: Projection | None = None
        self.out: Projection | None = None

    def fuse(self) -> None:
        self.qkv = fuse_linears(self, ["q_proj", "k_proj", "v_proj"])
        self.out = fuse_linears(self, ["o_proj"])

    def project(
        self,
        x: torch.Tensor | Quantized,
        rope: Rope,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, d], k and v [T, kv_heads, d] of the step's rows, k and v also written to
        their cache slots (`meta.slot_mapping`): everything before attention proper."""
        tokens = rows_of(x)
        fused = self.use_kernels and self.fusable
        qkv = self.qkv(x, defer_scales=fused)
        if fused:
            scales = None
            if isinstance(qkv, Unscaled):
                qkv, scales = qkv.raw, qkv.scales()
            return kernels.qk_norm_rope_store(
                qkv, self.num_heads, self.num_kv_heads, self.head_dim,
                self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                rope.cos_table, rope.sin_table, rope.positions, *kv_cache, meta.slot_mapping, scales,
            )  # fmt: skip
        kv_width = self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([self.num_heads * self.head_dim, kv_width, kv_width], -1)
        if self.qk_norm == "full":
            q, k = self.q_norm.normalize(q), self.k_norm.normalize(k)
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm.normalize(q), self.k_norm.normalize(k)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        cos, sin = rope.rows(x.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        write_kv(*kv_cache, k, v, meta.slot_mapping)
        return q, k, v

    def output(self, attended: torch.Tensor) -> torch.Tensor | Unscaled:
        """The output projection of attention's result [T, heads, d]."""
        tokens = attended.shape[0]
        return self.out(attended.reshape(tokens, self.num_heads * self.head_dim), self.defer_out)

    def forward(
        self,
        x: torch.Tensor | Quantized,
        rope: Rope,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor | Unscaled:
        q, k, v = self.project(x, rope, kv_cache, meta)
        return self.output(paged_attention(q, k, v, *kv_cache, meta, self.scale))


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.use_kernels = False
        self.defer_out = False  # return down_proj's FP8 product before its scales (fp8.fuse_launches)
        self.gate_up: Projection | None = None
        self.down: Projection | None = None

    def fuse(self) -> None:
        self.gate_up = fuse_linears(self, ["gate_proj", "up_proj"])
        self.down = fuse_linears(self, ["down_proj"])

    def forward(self, x: torch.Tensor | Quantized) -> torch.Tensor | Unscaled:
        rows = rows_of(x)
        down = self.down.matmul
        quantize = self.use_kernels and down is not None and down.takes_quantized(rows)
        gate_up = self.gate_up(x, defer_scales=quantize)
        if quantize:  # SiLU·mul hands down_proj e4m3 rows, scaling gate_up's product as it reads it
            scales = None
            if isinstance(gate_up, Unscaled):
                gate_up, scales = gate_up.raw, gate_up.scales()
            h = Quantized(*kernels.silu_mul_quantized(gate_up, padded_rows(rows), scales), rows)
        elif self.use_kernels:
            h = kernels.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            h = F.silu(gate) * up
        return self.down(h, self.defer_out)


class DecoderLayer(nn.Module):
    """Pre-norm block; its MLP is stored under the checkpoint's name for it (`mlp_name`)."""

    def __init__(self, config: PretrainedConfig, attention: nn.Module, mlp: nn.Module, mlp_name: str) -> None:
        super().__init__()
        self.self_attn = attention
        setattr(self, mlp_name, mlp)
        self.mlp_name = mlp_name
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor | Unscaled,
        residual: torch.Tensor | None,
        rope: Rope,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor | Unscaled, torch.Tensor]:
        """x is the previous block's output, not yet added to the residual stream (with FP8
        weights, maybe a product before its scales: the norms apply them)."""
        h, residual = self.input_layernorm(x, residual)
        return self._mlp_half(self.self_attn(h, rope, kv_cache, meta), residual)

    # the block in two halves around attention proper (piecewise.py; `Attention` layers only)

    def attention_inputs(
        self,
        x: torch.Tensor | Unscaled,
        residual: torch.Tensor | None,
        rope: Rope,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k, v, residual): the block up to attention, keys and values written to the cache."""
        h, residual = self.input_layernorm(x, residual)
        return *self.self_attn.project(h, rope, kv_cache, meta), residual

    def after_attention(
        self, attended: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor | Unscaled, torch.Tensor]:
        """(x, residual) from attention's result [T, heads, d]: the rest of the block."""
        return self._mlp_half(self.self_attn.output(attended), residual)

    def _mlp_half(
        self, attention_out: torch.Tensor | Unscaled, residual: torch.Tensor
    ) -> tuple[torch.Tensor | Unscaled, torch.Tensor]:
        h, residual = self.post_attention_layernorm(attention_out, residual)
        return getattr(self, self.mlp_name)(h), residual


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and output head. A family subclasses it and says
    what each layer's MLP is (`mlp`, stored as `mlp_name`) and, where it is not Qwen3's, its
    attention (`attention`); everything the engine calls is defined here."""

    mlp_name = "mlp"

    def __init__(self, config: PretrainedConfig, max_positions: int) -> None:
        super().__init__()
        self.check(config)
        self.config = config
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.layers = nn.ModuleList(
            DecoderLayer(config, self.attention(config, i), self.mlp(config, i), self.mlp_name)
            for i in range(config.num_hidden_layers)
        )
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.max_positions = max_positions
        self.use_kernels = False
        self.rotary = self._rotary()

    def mlp(self, config: PretrainedConfig, index: int) -> nn.Module:
        """The MLP of layer `index` (the family's choice)."""
        raise NotImplementedError

    @staticmethod
    def check(config: PretrainedConfig) -> None:
        """Refuse config fields the family does not implement (UnsupportedConfig, one line naming
        the field); the trainer's checks of the same family where it has them."""

    def attention(self, config: PretrainedConfig, index: int) -> nn.Module:
        """The attention of layer `index`: Qwen3's unless the family says otherwise."""
        return Attention(config)

    @classmethod
    def from_transformers(
        cls, state_dict: dict[str, torch.Tensor], config: PretrainedConfig
    ) -> dict[str, torch.Tensor]:
        """A transformers model's tensors under this class's (checkpoint) names; the same by default."""
        return state_dict

    @classmethod
    def cache_shapes(cls, config: PretrainedConfig) -> list[tuple[int, ...]]:
        """Per token and layer, the shape of each part of the paged cache: keys and values."""
        return [(config.num_key_value_heads, head_dim(config))] * 2

    def graph_safe(self, dtype: torch.dtype) -> bool:
        """Whether a decode step in `dtype` runs without host syncs (so a CUDA graph can capture it)."""
        return True

    def splits_at_attention(self) -> bool:
        """Whether every layer is a `DecoderLayer` over the shared `Attention`, so that a step can
        run as pieces between its attention calls (piecewise.py)."""
        return all(
            isinstance(layer, DecoderLayer) and isinstance(layer.self_attn, Attention)
            for layer in self.model.layers
        )

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """What a weight update addresses, by checkpoint name: the parameters, where FP8 weights
        hold a slot that quantizes what is copied into it (fp8.py) instead."""
        slots = getattr(self, "fp8_slots", {})
        return {
            name: slots.get(name, t)
            for name, t in self.state_dict().items()
            if not t.is_meta or name in slots
        }

    def projections(self) -> Iterator[tuple[str, Projection]]:
        """Every fused projection, by the name of the module that holds it."""
        for name, module in self.named_modules():
            for attr in ("qkv", "out", "gate_up", "down"):
                projection = getattr(module, attr, None)
                if isinstance(projection, Projection):
                    yield f"{name}.{attr}", projection

    def _rotary(self) -> RotaryEmbedding:
        return RotaryEmbedding(rotary_dim(self.config), rope_theta(self.config), self.max_positions)

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
        rope = self.rotary(positions)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, rope, kv_cache, meta)
        return self.model.norm(x, residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] in the model's dtype (the sampler reads them as they are)."""
        return self.lm_head(hidden)
