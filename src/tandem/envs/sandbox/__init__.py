"""The sandbox for untrusted code: `Sandbox(limits).run(source, files)`; see sandbox.py."""

from tandem.envs.sandbox.sandbox import (
    Isolation,
    Limits,
    Sandbox,
    SandboxError,
    SandboxResult,
    choose_isolation,
    isolation_status,
)

__all__ = [
    "Isolation",
    "Limits",
    "Sandbox",
    "SandboxError",
    "SandboxResult",
    "choose_isolation",
    "isolation_status",
]
