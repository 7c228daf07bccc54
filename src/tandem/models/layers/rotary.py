"""Rotary position embedding for packed rows: cos/sin are looked up per token from its position id.

The inverse frequencies follow the checkpoint's `rope_parameters`: the default RoPE is computed
here; the static scaled variants (linear, yarn, llama3, longrope) come from transformers' own
`ROPE_INIT_FUNCTIONS`, so a scaled checkpoint gets exactly the frequencies its reference uses.
Dynamic NTK scaling changes with the sequence length at run time and is refused. A partial
rotary embedding (`partial_rotary_factor` < 1) rotates the first `rotary_dim` channels of each
head and passes the rest through.

Rounding follows transformers: angles and cos/sin in fp32, cast to the activation dtype, then
the rotation in that dtype.
"""

from types import SimpleNamespace

import torch
from torch import nn

STATIC_SCALINGS = ("linear", "yarn", "llama3", "longrope")


def rope_frequencies(
    rope_parameters: dict, head_dim: int, partial_rotary_factor: float, max_positions: int
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2] in fp32, attention scaling of cos/sin)."""
    rope_type = rope_parameters.get("rope_type", "default")
    dim = int(head_dim * partial_rotary_factor)
    if rope_type == "default":
        theta = float(rope_parameters["rope_theta"])
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim)), 1.0
    if rope_type not in STATIC_SCALINGS:
        raise ValueError(
            f"rope_parameters.rope_type = {rope_type!r} is not supported by tandem's models "
            f"(supported: default, {', '.join(STATIC_SCALINGS)}); use model.impl = 'hf'"
        )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    # the init functions read these attributes of a config; a namespace carries exactly them
    config = SimpleNamespace(
        rope_parameters=rope_parameters,
        head_dim=head_dim,
        hidden_size=head_dim,
        num_attention_heads=1,
        partial_rotary_factor=partial_rotary_factor,
        max_position_embeddings=max_positions,
    )
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Turns position ids [B, S] into (cos, sin) [B, S, rotary_dim] in the activation dtype."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._inv_freq_init = inv_freq.clone()  # kept on CPU: the model may be built on meta
        self.attention_scaling = attention_scaling

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.shape[0]

    def reset_buffers(self) -> None:
        """Refill `inv_freq` after the module was materialised from the meta device."""
        self.inv_freq = self._inv_freq_init.to(self.inv_freq.device)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq
        angles = torch.cat([freqs, freqs], dim=-1)
        cos = angles.cos() * self.attention_scaling
        sin = angles.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, S, heads, head_dim] by cos/sin [B, S, rotary_dim] (the first rotary_dim channels)."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat([rot * cos + rotate_half(rot) * sin, rest], dim=-1)


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's rotary layout: channel pairs (x0, x1), (x2, x3), … of x [B, S, heads, rotary_dim]
    each rotate by one frequency. The result is laid out de-interleaved (the rotated first
    members of the pairs, then the second members), as transformers' reference returns it;
    queries and keys get the same layout, so their dot products are those of the rotation."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half].unsqueeze(2), sin[..., :half].unsqueeze(2)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
