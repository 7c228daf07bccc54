"""Qwen3-MoE (transformers model type `qwen3_moe`)."""
