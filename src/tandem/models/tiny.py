"""Build a randomly initialised tiny Qwen3 (or Qwen3-MoE) with an in-process tokenizer.

    uv run tiny-model --out models/tiny --hidden-size 256 --num-layers 6
    uv run tiny-model --out models/tiny-moe --num-experts 8   # every layer a mixture of 8 experts

The default (hidden 256, 6 layers, 4 heads of 64, 2 KV heads, vocab 512) has about 4.9M
parameters: small enough to train on two CPU cores in minutes.
"""

from pathlib import Path

import torch
from pydantic import Field
from transformers import AutoModelForCausalLM, PretrainedConfig, Qwen3Config, Qwen3MoeConfig

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


class TinyShape(Section):
    """The architecture of a tiny Qwen3 and the seed of its random initialisation."""

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
    num_experts: int = Field(0, ge=0, description="Experts per MoE layer; 0 = a dense Qwen3, else Qwen3-MoE.")
    experts_per_token: int = Field(2, gt=0, description="Experts each token is routed to (MoE only).")
    moe_intermediate_size: int = Field(128, gt=0, description="Width of one expert's SwiGLU MLP (MoE only).")
    seed: int = Field(0, description="Seed of the random initialisation.")


class TinyModelConfig(TinyShape):
    out: Path = Field(Path("models/tiny-qwen3"), description="Directory to write the model to.")


def tiny_qwen3_config(cfg: TinyShape, tokenizer_size: int, eos_id: int, pad_id: int) -> PretrainedConfig:
    if cfg.num_experts and cfg.experts_per_token > cfg.num_experts:
        raise ValueError(
            f"experts_per_token = {cfg.experts_per_token} exceeds num_experts = {cfg.num_experts}"
        )
    moe = {
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "norm_topk_prob": True,
    }
    return (Qwen3MoeConfig if cfg.num_experts else Qwen3Config)(
        **(moe if cfg.num_experts else {}),
        vocab_size=max(cfg.vocab_size, tokenizer_size),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        dtype="float32",
    )


def build_tiny_model(cfg: TinyModelConfig | None = None, **overrides: object) -> Path:
    """Write a tiny random Qwen3 and its tokenizer to `cfg.out`; returns the directory."""
    cfg = (cfg or TinyModelConfig()).model_copy(update=overrides)
    tokenizer = train_tokenizer()
    torch.manual_seed(cfg.seed)
    config = tiny_qwen3_config(cfg, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
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
