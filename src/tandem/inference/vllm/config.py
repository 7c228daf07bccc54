"""Settings of the vLLM backend."""

from pydantic import Field

from tandem.config.base import Section


class VLLMConfig(Section):
    python: str | None = Field(
        None, description="Python interpreter of the virtual environment that has vLLM; default: this one."
    )
    extra_args: list[str] = Field(default_factory=list, description="Extra arguments for vLLM's server.")
    startup_timeout_s: float = Field(600, gt=0)
