"""Flax models: LFM2 (`models.lfm2`) and its Hugging Face checkpoint import/export (`models.hf`)."""

from models.lfm2 import (
    PRESETS,
    Lfm2Cache,
    Lfm2Config,
    Lfm2ForCausalLM,
    count_params,
    init_cache,
    init_params,
    logical_axis_rules,
    logical_param_specs,
    param_shardings,
)

_HF = ("Lfm2", "load_hf", "save_hf", "params_from_hf", "params_to_hf")


def __getattr__(name):  # models.hf needs safetensors (the `hf` extra): import it on first use
    if name in _HF:
        from models import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")


__all__ = [
    "PRESETS", "Lfm2Cache", "Lfm2Config", "Lfm2ForCausalLM", "count_params", "init_cache", "init_params",
    "logical_axis_rules", "logical_param_specs", "param_shardings", *_HF,
]
