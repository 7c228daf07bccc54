"""Configuration of tandem's clients of inference servers: how a request samples and how the client
retries (`[orchestrator.sampling]`, `[orchestrator.client]`, and the same sections of `evaluate`)."""

from pydantic import Field, field_validator

from tandem.client.seeds import derive_seed
from tandem.config.base import Section
from tandem.inference.protocol import usable_temperature


class SamplingConfig(Section):
    """How training rollouts are sampled (evaluation always decodes greedily)."""

    temperature: float = Field(1.0, ge=0, description="Sampling temperature; 0 = greedy.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    max_tokens: int = Field(128, gt=0, description="Most tokens one model turn may generate.")
    request_seed: int | None = Field(
        None,
        ge=0,
        description="Seed of the requests this sampling is for (choice i of an n-choice request draws "
        "from its own stream); unset = the servers' own randomness. The orchestrator sets it per group "
        "when seeded_sampling is on.",
    )

    _usable_temperature = field_validator("temperature")(usable_temperature)  # (what the servers take)

    def for_part(self, *part: int) -> "SamplingConfig":
        """The sampling of one part of a seeded request's work that an environment sends as a
        request of its own (a sample, a later turn): a seed derived from this one and `part`."""
        if self.request_seed is None:
            return self
        return self.model_copy(update={"request_seed": derive_seed(self.request_seed, *part)})


class ClientConfig(Section):
    """How a client talks to inference servers."""

    request_timeout: float = Field(300.0, gt=0, description="Seconds one HTTP request may take.")
    max_retries: int = Field(5, ge=0, description="Retries of a failed request (connection error, 5xx).")
    retry_backoff: float = Field(
        0.5, gt=0, description="First retry delay in seconds; doubles per retry (capped at 30 s)."
    )
    api_key: str | None = Field(None, description="Bearer key, when the servers were started with one.")
    max_concurrent_groups: int = Field(
        256, gt=0, description="Most group requests in flight at once, over all servers."
    )
