"""The bottom layer of the tree: the named errors a user meets and the config value checks.

`envs/`, `models/` and `jaxrl_llm/` all stand on this package, and it imports none of them, so the pure envs
and models can be reused without the framework (see `docs/CONTRACTS.md`, "Layers")."""

from jaxrl_base.errors import (CheckpointError, ConfigError, DataError, EnvError, JaxrlError, ModelError,
                               one_line)

__all__ = ["JaxrlError", "ConfigError", "DataError", "EnvError", "CheckpointError", "ModelError", "one_line"]
