"""The RL trainer: rollouts in, optimizer steps, weights out."""
