"""GLM-5: expert parallelism over the ep mesh dimension, then what every decoder gets."""

from tandem.models.qwen3_moe.parallelize import parallelize

__all__ = ["parallelize"]
