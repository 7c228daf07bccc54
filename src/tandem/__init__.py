"""tandem: asynchronous reinforcement learning for large language models."""
