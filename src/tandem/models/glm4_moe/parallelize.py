"""GLM-4.5: expert parallelism over the ep mesh dimension (the routed experts; the shared ones
stay with the dense parameters), then what every decoder gets."""

from tandem.models.qwen3_moe.parallelize import parallelize

__all__ = ["parallelize"]
