"""Seeds of sampling requests (`orchestrator.seeded_sampling`): pure functions of where a request
sits in the run, never of timing, so a repeated run sends every request the same seed.

A group's request gets `group_seed(run seed, step, environment, position in its task stream,
task id)`. The server draws choice i of an n-choice request from its own stream (vLLM: seed + i;
the native engine: a key hashed from seed and i). Requests an environment sends one per sample
or per turn take `derive_seed(group seed, sample index[, turn])` (SamplingConfig.for_part).
"""

import hashlib

SEED_BITS = 62
"""Seeds stay below 2**62, so vLLM's seed + choice index cannot overflow a signed 64-bit int."""


def derive_seed(*parts: object) -> int:
    """A seed hashed from `parts`: nearby inputs give unrelated seeds."""
    digest = hashlib.blake2b("/".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - SEED_BITS)


def group_seed(run_seed: int, step: int, env: str, position: int, task_id: str) -> int:
    """The seed of one group's request: its step, environment, place in the task stream and task."""
    return derive_seed("tandem/sampling", run_seed, step, env, position, task_id)
