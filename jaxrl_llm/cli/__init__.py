"""The `jaxrl-llm` command line (`main`) and terminal play (`play`)."""

from jaxrl_llm.cli.main import build_parser, main  # noqa: F401
