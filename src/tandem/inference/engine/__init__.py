"""tandem's native inference engine (continuous batching over a paged KV cache)."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.inference.engine.engine import AsyncEngine


def __getattr__(name: str) -> Any:
    # Lazy, so that importing the interface (api.py) does not load torch and the model code.
    if name == "AsyncEngine":
        from tandem.inference.engine.engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(name)


__all__ = ["AsyncEngine"]
