"""Flax models behind one seam (`models.family`): LFM2 (`models.lfm2`) and Qwen3 (`models.qwen3`) on a shared
decoder (`models.decoder`, `models.attention`, `models.layers`, `models.base`); Hugging Face checkpoint
import/export (`models.hf`) and LoRA (`models.lora`) for both."""

from models.decoder import DecodeCache, count_params
from models.family import (
    FAMILIES,
    PRESETS,
    UnsupportedModelError,
    cached_call,
    config_from_hf,
    config_from_pretrained,
    by_type,
    family_of,
    init_cache,
    init_params,
    logical_param_specs,
    module_of,
    param_shardings,
)
from models.layers import logical_axis_rules
from models.lfm2 import Lfm2Cache, Lfm2Config, Lfm2ForCausalLM
from models.qwen3 import Qwen3Config, Qwen3ForCausalLM

_HF = ("Model", "load_hf", "save_hf", "params_from_hf", "params_to_hf")


def __getattr__(name):  # models.hf needs safetensors (the `hf` extra): import it on first use
    if name in _HF:
        from models import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")


__all__ = [
    "FAMILIES", "PRESETS", "UnsupportedModelError", "DecodeCache", "Lfm2Cache", "Lfm2Config", "Lfm2ForCausalLM",
    "Qwen3Config", "Qwen3ForCausalLM", "cached_call", "config_from_hf", "config_from_pretrained", "count_params",
    "by_type", "family_of", "init_cache", "init_params", "logical_axis_rules", "logical_param_specs", "module_of",
    "param_shardings", *_HF,
]
