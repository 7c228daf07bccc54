from tandem.config.base import ModelConfig, Section
from tandem.config.loader import ConfigError, build_config, parse_config, to_toml

__all__ = ["ConfigError", "ModelConfig", "Section", "build_config", "parse_config", "to_toml"]
