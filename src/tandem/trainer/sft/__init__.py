"""Supervised fine-tuning: chat data, packed micro-batches, FSDP2, exact-resume checkpoints."""
