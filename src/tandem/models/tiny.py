"""Build a randomly initialised tiny model of one of tandem's families with an in-process tokenizer.

    uv run tiny-model --out models/tiny --hidden-size 256 --num-layers 6
    uv run tiny-model --out models/tiny-moe --num-experts 8   # every layer a mixture of 8 experts
    uv run tiny-model --out models/tiny-glm --family glm4_moe --num-experts 8

The default (Qwen3, hidden 256, 6 layers, 4 heads of 64, 2 KV heads, vocab 512) has about 4.9M
parameters: small enough to train on two CPU cores in minutes. The other families take the
same shape with their own defining parts switched on (`tiny_config`): GLM-4.5 a dense first
layer, one shared expert, biased q/k/v with QK norm, half-rotary heads; MiniMax-M2 whole-
projection QK norm and half-rotary heads; GLM-5 MLA (q rank hidden / 2, kv rank head_dim,
rope head_dim / 4, nope and value head_dim / 2) with an indexer of 16 heads (few heads tie often at
relu zero) choosing `index_topk` keys.
"""

from pathlib import Path
from typing import Literal

import torch
from pydantic import Field
from transformers import (
    AutoModelForCausalLM,
    Glm4MoeConfig,
    GlmMoeDsaConfig,
    MiniMaxM2Config,
    PretrainedConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from tandem.config.base import Section
from tandem.config.loader import parse_config
from tandem.models.loading import save_model
from tandem.models.tokenizer import train_tokenizer

QWEN3_0_6B_SHAPE = {
    "hidden_size": 1024,
    "num_layers": 28,
    "num_heads": 16,
    "num_kv_heads": 8,
    "head_dim": 128,
    "intermediate_size": 3072,
    "vocab_size": 151936,
    "max_position_embeddings": 4096,
}
"""Qwen3-0.6B's shape, for benchmarks of realistic size (random init): `TinyModelConfig(**QWEN3_0_6B_SHAPE)`."""


Family = Literal["qwen3", "glm4_moe", "minimax_m2", "glm_moe_dsa"]
MOE_FAMILIES = ("glm4_moe", "minimax_m2", "glm_moe_dsa")


class TinyShape(Section):
    """The architecture of a tiny model and the seed of its random initialisation."""

    family: Family = Field(
        "qwen3", description="qwen3 (Qwen3-MoE when num_experts > 0), glm4_moe, minimax_m2 or glm_moe_dsa."
    )
    hidden_size: int = Field(256, gt=0, description="Width of the residual stream.")
    num_layers: int = Field(6, gt=0, description="Decoder layers.")
    num_heads: int = Field(4, gt=0, description="Query heads.")
    num_kv_heads: int = Field(2, gt=0, description="Key/value heads (grouped-query attention).")
    head_dim: int = Field(64, gt=0, description="Width of one attention head.")
    intermediate_size: int = Field(768, gt=0, description="Width of the SwiGLU MLP.")
    vocab_size: int = Field(512, gt=0, description="Embedding rows; at least the tokenizer's size.")
    max_position_embeddings: int = Field(
        2048, gt=0, description="Longest context the model is configured for."
    )
    tie_word_embeddings: bool = Field(True, description="Share the input embedding with the output head.")
    num_experts: int = Field(
        0,
        ge=0,
        description="Experts per MoE layer; 0 = a dense Qwen3, else Qwen3-MoE (the other families need > 0).",
    )
    experts_per_token: int = Field(2, gt=0, description="Experts each token is routed to (MoE only).")
    moe_intermediate_size: int = Field(128, gt=0, description="Width of one expert's SwiGLU MLP (MoE only).")
    index_topk: int = Field(
        16, gt=0, description="Keys the sparse-attention indexer keeps per query (GLM-5 only)."
    )
    seed: int = Field(0, description="Seed of the random initialisation.")


class TinyModelConfig(TinyShape):
    out: Path = Field(Path("models/tiny-qwen3"), description="Directory to write the model to.")


def tiny_config(cfg: TinyShape, tokenizer_size: int, eos_id: int, pad_id: int) -> PretrainedConfig:
    """The transformers config of `cfg`'s family and shape (the module docstring says what each gets)."""
    if cfg.num_experts and cfg.experts_per_token > cfg.num_experts:
        raise ValueError(
            f"experts_per_token = {cfg.experts_per_token} exceeds num_experts = {cfg.num_experts}"
        )
    if cfg.family == "qwen3":
        return tiny_qwen3_config(cfg, tokenizer_size, eos_id, pad_id)
    if not cfg.num_experts:
        raise ValueError(f"family = {cfg.family!r} is a mixture of experts: set num_experts > 0")
    common = _common_fields(cfg, tokenizer_size, eos_id, pad_id)
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    moe = {"num_experts_per_tok": cfg.experts_per_token}
    if cfg.family == "minimax_m2":
        return MiniMaxM2Config(
            **common, **moe, head_dim=cfg.head_dim, intermediate_size=cfg.moe_intermediate_size,
            num_local_experts=cfg.num_experts, rope_parameters={**rope, "partial_rotary_factor": 0.5},
        )  # fmt: skip
    glm_moe = {
        **moe, "n_routed_experts": cfg.num_experts, "moe_intermediate_size": cfg.moe_intermediate_size,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
        "intermediate_size": cfg.intermediate_size,
    }  # fmt: skip
    if cfg.family == "glm4_moe":
        return Glm4MoeConfig(
            **common, **glm_moe, head_dim=cfg.head_dim, use_qk_norm=True, attention_bias=True,
            rope_parameters={**rope, "partial_rotary_factor": 0.5},
        )  # fmt: skip
    return GlmMoeDsaConfig(
        **{**common, "num_key_value_heads": cfg.num_heads}, **glm_moe, rope_parameters=rope,
        q_lora_rank=cfg.hidden_size // 2, kv_lora_rank=cfg.head_dim, qk_rope_head_dim=cfg.head_dim // 4,
        qk_nope_head_dim=cfg.head_dim // 2, v_head_dim=cfg.head_dim // 2, index_topk=cfg.index_topk,
        index_head_dim=cfg.head_dim // 2, index_n_heads=16,
    )  # fmt: skip


def _common_fields(cfg: TinyShape, tokenizer_size: int, eos_id: int, pad_id: int) -> dict:
    return {
        "vocab_size": max(cfg.vocab_size, tokenizer_size),
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "rms_norm_eps": 1e-6,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "bos_token_id": None,
        "dtype": "float32",
    }


def tiny_qwen3_config(cfg: TinyShape, tokenizer_size: int, eos_id: int, pad_id: int) -> PretrainedConfig:
    """A Qwen3 of `cfg`'s shape (Qwen3-MoE with num_experts > 0)."""
    moe = {
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "norm_topk_prob": True,
    }
    return (Qwen3MoeConfig if cfg.num_experts else Qwen3Config)(
        **(moe if cfg.num_experts else {}),
        **_common_fields(cfg, tokenizer_size, eos_id, pad_id),
        intermediate_size=cfg.intermediate_size,
        head_dim=cfg.head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def build_tiny_model(cfg: TinyModelConfig | None = None, **overrides: object) -> Path:
    """Write a tiny random model and its tokenizer to `cfg.out`; returns the directory."""
    cfg = (cfg or TinyModelConfig()).model_copy(update=overrides)
    tokenizer = train_tokenizer()
    torch.manual_seed(cfg.seed)
    config = tiny_config(cfg, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_config(config)
    save_model(model, tokenizer, cfg.out)
    return cfg.out


def main() -> None:
    from tandem.cli import run_cli

    def run() -> None:
        cfg = parse_config(TinyModelConfig, prog="tiny-model")
        out = build_tiny_model(cfg)
        model = AutoModelForCausalLM.from_pretrained(out)
        n = sum(p.numel() for p in model.parameters())
        print(f"wrote a {n / 1e6:.2f}M-parameter tiny {model.config.model_type} to {out}")

    run_cli(run, "tiny-model")


if __name__ == "__main__":
    main()
