"""MiniMax-M2 (transformers model type `minimax_m2`)."""
