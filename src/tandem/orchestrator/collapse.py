"""A warning for a run that is collapsing: the held-out reward and the sampling entropy both fell
at each of the last N evaluations.

Entropy here is the sampler's: the mean −logprob of the model's own completion tokens over the
training rollouts collected since the previous evaluation (at temperature 1 an unbiased estimate
of the policy's per-token entropy; otherwise that of the tempered distribution). It is known to
the orchestrator without asking the trainer, and it is what collapses when a too-large step makes
the policy deterministic on wrong answers.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.envs.base import Trajectory


@dataclass
class CollapseWatch:
    evaluations: int = 3
    """Consecutive falls (evaluation to evaluation) of both reward and entropy that warn; 0 = never."""
    history: list[tuple[int, float, float]] = field(default_factory=list)
    """(step, held-out reward, sampling entropy since the previous evaluation) per evaluation."""
    _nll: float = 0.0
    _tokens: int = 0

    def add(self, trajectories: Sequence[Trajectory]) -> None:
        """Count the model's completion tokens of one step's training rollouts."""
        for t in trajectories:
            for lp, m in zip(t.completion_logprobs, t.completion_mask, strict=True):
                if m:
                    self._nll -= lp
                    self._tokens += 1

    def evaluated(self, step: int, reward: float) -> str | None:
        """Record an evaluation; the warning's text when the last `evaluations` changes all fell."""
        if self._tokens == 0:  # before the first step (or no rollouts since the last evaluation)
            return None
        self.history.append((step, reward, self._nll / self._tokens))
        self._nll, self._tokens = 0.0, 0
        recent = self.history[-(self.evaluations + 1) :]
        if self.evaluations == 0 or len(recent) <= self.evaluations:
            return None
        pairs = list(zip(recent, recent[1:], strict=False))
        if not all(b[1] < a[1] and b[2] < a[2] for a, b in pairs):
            return None
        rewards = " → ".join(f"{r:.3f}" for _, r, _ in recent)
        entropies = " → ".join(f"{e:.3f}" for _, _, e in recent)
        return (
            f"held-out reward fell at {self.evaluations} evaluations in a row (steps "
            f"{recent[0][0]}–{recent[-1][0]}: {rewards}) while the sampling entropy fell too "
            f"({entropies}): the policy is collapsing; try a lower trainer.optim.lr"
        )
