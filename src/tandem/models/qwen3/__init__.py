"""Qwen3 dense (transformers model type `qwen3`)."""
