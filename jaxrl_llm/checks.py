"""Moved to `jaxrl_base.checks` (below `envs/` and `models/`, which use it); importable from here as before."""

from jaxrl_base.checks import (ConfigError, EnvBound, check_choice, check_float, check_int, check_probability,
                               check_str)

__all__ = ["ConfigError", "EnvBound", "check_int", "check_float", "check_probability", "check_choice", "check_str"]
