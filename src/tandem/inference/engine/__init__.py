"""tandem's native inference engine (continuous batching over a paged KV cache)."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.inference.config import InferenceConfig
    from tandem.inference.engine.engine import AsyncEngine
    from tandem.inference.engine.process import ProcessEngine


def uses_core_process(config: "InferenceConfig") -> bool:
    """`engine.core_process`, or where it is unset, whether the model runs on CUDA."""
    if config.engine.core_process is not None:
        return config.engine.core_process
    from tandem.models.loading import resolve_device

    return resolve_device(config.model.device).type == "cuda"


def start_engine(config: "InferenceConfig") -> "AsyncEngine | ProcessEngine":
    """The engine the config asks for: its core stepped by a thread of this process, or by a
    process of its own (`uses_core_process`)."""
    if uses_core_process(config):
        from tandem.inference.engine.process import ProcessEngine

        return ProcessEngine(config)
    from tandem.inference.engine.engine import AsyncEngine

    return AsyncEngine(config)


def __getattr__(name: str) -> Any:
    # Lazy, so that importing the interface (api.py) does not load torch and the model code.
    if name == "AsyncEngine":
        from tandem.inference.engine.engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(name)


__all__ = ["AsyncEngine", "start_engine", "uses_core_process"]
