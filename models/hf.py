"""Hugging Face checkpoint import/export for every family of the seam (safetensors only, no torch, no pickle).

    model = load_hf("path/to/Qwen3-0.6B")           # config.json + model.safetensors (or an index); LFM2 or Qwen3
    logits = model(tokens)                           # int32[B, T] -> float32[B, T, V], jitted
    save_hf(model, "out/")                           # transformers.AutoModelForCausalLM.from_pretrained("out/") works

The family comes from config.json's `model_type` (`models.family`; another one is an UnsupportedModelError
listing the supported ones). Names and layouts are the seam's (`models.family.hf_tensor_names`, `to_hf`,
`to_flax`): HF `model.layers.{i}.<module path>.weight` <-> Flax `layers_{i}/<module path>/kernel` (Dense
kernels transposed: torch [out, in] -> Flax [in, out]; norms `weight` -> `scale`; `model.embed_tokens.weight`
-> `embed_tokens/embedding`; untied `lm_head.weight` -> `lm_head/kernel`; a family's own layouts, e.g.
LFM2's depthwise conv weight [D, 1, K] -> [K, D]).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_base.errors import ModelError
from jaxrl_base.finite import describe_non_finite, non_finite
from models import family as fam

_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # non-persistent buffers some exporters write


class HfCheckpointError(ModelError):
    """A Hugging Face folder that cannot be loaded as it is (pickled or damaged weights, tensors that do not fit
    config.json); the message names the file or tensor, what is wrong and what to do."""


_CONVERT_HINT = (
    "convert it to safetensors first, e.g.\n"
    "  python -c \"from transformers import AutoModelForCausalLM as M; "
    "M.from_pretrained('{src}').save_pretrained('{src}-safetensors', safe_serialization=True)\"")


@dataclasses.dataclass(eq=False)
class Model:
    """A model of any family: `config` (its family's config), Flax `params` (plain arrays) and the `module`.

    `model(tokens)`: tokens int32[B, T] -> logits float32[B, T, V], the full causal forward, jitted
    (compiled once per input shape). `model.apply(tokens, cache, num_valid)` is the cached path of
    `models.decoder.CausalLM.__call__` (not jitted); `model.init_cache(batch, max_len)` makes an empty cache.
    """

    config: Any
    params: Any
    module: Any = None
    _forward: Callable = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.module is None:
            self.module = fam.module_of(self.config)
        self._forward = functools.partial(_forward, self.module)

    @property
    def family(self) -> str:
        """The family's model_type ("lfm2", "qwen3")."""
        return self.config.model_type

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """tokens int32[B, T] -> logits float32[B, T, V] (full causal forward over positions 0..T-1)."""
        return self._forward(self.params, jnp.asarray(tokens, jnp.int32))

    def apply(self, tokens: jax.Array, cache: Any = None, num_valid: jax.Array | None = None) -> tuple[jax.Array, Any]:
        """The module's call with these params: (logits float32[B, T, V], new cache or None)."""
        return self.module.apply({"params": self.params}, tokens, cache, num_valid)

    def init_cache(self, batch: int, max_len: int, dtype=None):
        """`models.family.init_cache(self.config, batch, max_len, dtype)`."""
        return fam.init_cache(self.config, batch, max_len, dtype)


@functools.partial(jax.jit, static_argnums=0)
def _forward(module: Any, params: Any, tokens: jax.Array) -> jax.Array:
    # module is static (hashable by config): equal configs share one compiled function per shape
    return module.apply({"params": params}, tokens)[0]


# --------------------------------------------------------------------------------------------------
# Load
# --------------------------------------------------------------------------------------------------


def _safetensors_files(folder: str) -> list[str]:
    single, index = os.path.join(folder, _SINGLE), os.path.join(folder, _INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise HfCheckpointError(f"{index} is not a safetensors index (needs a 'weight_map' object): {e}") from None
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.isfile(os.path.join(folder, name)):
                raise FileNotFoundError(f"{index} names shard {name!r}, which is missing from {folder}")
        return [os.path.join(folder, name) for name in files]
    if os.path.isfile(single):
        return [single]
    pickled = [p for pat in ("*.bin", "*.pt", "*.pth", "*.ckpt") for p in glob.glob(os.path.join(folder, pat))]
    if pickled:
        raise HfCheckpointError(
            f"{folder} holds pickled weights ({', '.join(os.path.basename(p) for p in sorted(pickled))}); "
            "pickle is refused (it can run arbitrary code). " + _CONVERT_HINT.format(src=folder))
    others = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if others:
        raise FileNotFoundError(
            f"{folder} has {[os.path.basename(p) for p in others]} but neither {_SINGLE} nor {_INDEX}; "
            f"rename a single file to {_SINGLE} or add an index json")
    raise FileNotFoundError(f"no weights in {folder}: expected {_SINGLE} or {_INDEX}")


def _read_tensors(files: list[str]) -> dict[str, Any]:
    from safetensors import SafetensorError, safe_open

    tensors: dict[str, Any] = {}
    for file in files:
        try:
            with safe_open(file, framework="flax") as f:
                for name in f.keys():
                    if name in tensors:
                        raise HfCheckpointError(
                            f"tensor {name!r} appears in more than one shard ({os.path.basename(file)})")
                    tensors[name] = f.get_tensor(name)
        except SafetensorError as e:
            size = os.path.getsize(file)
            raise HfCheckpointError(
                f"{file} ({size} bytes) is not a complete safetensors file ({e}): it was probably cut short by an "
                "interrupted download, copy or export. Fetch or export it again (and compare its size with the "
                "source's)") from None
    return tensors


def _unflatten(flat: dict[tuple[str, ...], Any]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for p in path[:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = value
    return tree


def _expected(config: Any) -> dict[tuple[str, ...], jax.ShapeDtypeStruct]:
    """Every Flax param path of this config with its expected shape."""
    return {tuple(k.key for k in keypath): leaf
            for keypath, leaf in jax.tree_util.tree_flatten_with_path(fam.param_shapes(config))[0]}


def params_from_hf(config: Any, tensors: dict[str, Any], where: str = "checkpoint") -> dict:
    """HF-named tensors (`model.layers.0.self_attn.q_proj.weight`, ...) -> Flax params in `config.param_dtype`.

    Raises HfCheckpointError naming a missing, unexpected or wrongly shaped tensor.
    """
    expected = _expected(config)
    tensors = dict(tensors)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # tied: transformers ignores a stored copy as well
    for name in [n for n in tensors if n.endswith(_IGNORED_SUFFIXES)]:
        tensors.pop(name)
    names = fam.hf_tensor_names(config)
    fields = ", ".join(f for f in config.ARCH_FIELDS if f not in ("vocab_size", "hidden_size", "intermediate_size"))
    missing = [n for n in names.values() if n not in tensors]
    if missing:
        hint = ("set tie_word_embeddings true in config.json if the head is tied to the embedding"
                if missing == ["lm_head.weight"] else f"check that config.json ({fields}) matches the weights")
        raise HfCheckpointError(f"{where} lacks tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                                f"({len(missing)} missing) that this config needs: {hint}")
    extra = sorted(set(tensors) - set(names.values()))
    if extra:
        raise HfCheckpointError(
            f"{where} has unexpected tensor(s) {extra[:5]}{' ...' if len(extra) > 5 else ''} that "
            f"{config.architecture} with this config.json does not use: check {fields} in config.json, or remove "
            "the extra tensors")
    bad = non_finite({names[path]: tensors[names[path]] for path in expected})
    if bad:
        raise HfCheckpointError(
            f"{where}: {len(bad)} tensor(s) hold NaN or infinite values: {describe_non_finite(bad)}. These weights "
            "would give garbage (a diverged run, or a damaged file whose headers are sound); use an earlier "
            "checkpoint or export it again")
    flat = {}
    for path, spec in expected.items():
        name, t = names[path], tensors[names[path]]
        want = fam.hf_shape(config, path, spec.shape)
        if tuple(t.shape) != want:
            raise HfCheckpointError(
                f"{where}: tensor {name!r} has shape {tuple(t.shape)} but this config.json implies {want} "
                f"(hidden_size={config.hidden_size}, ff_dim={config.ff_dim}, heads={config.num_attention_heads}, "
                f"kv_heads={config.num_key_value_heads}, head_dim={config.head_dim}, vocab_size={config.vocab_size}); "
                "fix config.json to match the weights")
        flat[path] = jnp.asarray(fam.to_flax(config, path, jnp.asarray(t)), spec.dtype)
    return _unflatten(flat)


def load_hf(path: str | os.PathLike, dtype=None) -> Model:
    """Loads a local HF folder of any supported family (`config.json` + `model.safetensors` or a sharded
    `model.safetensors.index.json`; the family from config.json's model_type) into a `Model`. dtype (e.g.
    "bfloat16"): params and activations; default float32. Pickled `.bin`/`.pt` weights are refused."""
    folder = os.fspath(path)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist (load_hf takes a local folder; "
                                "download it first, e.g. `huggingface-cli download Qwen/Qwen3-0.6B --local-dir DIR`)")
    overrides = {}
    if dtype is not None:
        overrides = {"dtype": dtype, "param_dtype": dtype}
    config = fam.config_from_pretrained(folder, **overrides)
    tensors = _read_tensors(_safetensors_files(folder))
    params = params_from_hf(config, tensors, where=folder)
    return Model(config, params)


# --------------------------------------------------------------------------------------------------
# Save
# --------------------------------------------------------------------------------------------------


def params_to_hf(config: Any, params: Any) -> dict[str, jax.Array]:
    """Flax params -> HF-named tensors in torch layouts (no lm_head when tied)."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    got = {tuple(k.key for k in keypath): leaf for keypath, leaf in flat}
    expected = _expected(config)
    if set(got) != set(expected):
        missing = sorted("/".join(p) for p in set(expected) - set(got))
        extra = sorted("/".join(p) for p in set(got) - set(expected))
        raise ValueError(f"params do not match the config: missing {missing[:5]}, unexpected {extra[:5]}")
    names = fam.hf_tensor_names(config)
    out = {}
    for path, a in got.items():
        if tuple(a.shape) != tuple(expected[path].shape):
            raise ValueError(f"param {'/'.join(path)} has shape {tuple(a.shape)}, config implies "
                             f"{tuple(expected[path].shape)}")
        out[names[path]] = jnp.asarray(fam.to_hf(config, path, jnp.asarray(a)))
    bad = non_finite(out)
    if bad:
        raise ModelError(f"refusing to write weights with NaN or infinite values: {describe_non_finite(bad)}; "
                         "nothing was written. Export an earlier checkpoint of the run")
    return out


def save_hf(model: Any, params_or_path: Any, path: str | os.PathLike | None = None, *,
            overwrite: bool = False) -> str:
    """Writes `config.json` + `model.safetensors` that `transformers.AutoModelForCausalLM.from_pretrained` loads
    (the family's class: `Lfm2ForCausalLM`, `Qwen3ForCausalLM`) with the same logits.

    Call as `save_hf(model, folder)` with a `Model`, or `save_hf(config, params, folder)`. A new folder is
    written atomically (a temp folder beside it, then renamed). An existing folder keeps every file that is
    not one of those two: one that holds other files is refused (FileExistsError) unless overwrite=True,
    and even then only config.json and model.safetensors are replaced (each atomically); a sharded index
    there, which loaders would read instead, is always refused. Nothing else is ever deleted. Returns it.
    """
    from safetensors.flax import save_file

    if isinstance(model, Model):
        if path is not None:
            raise TypeError("save_hf(model, folder) takes two arguments when given a Model")
        config, params, folder = model.config, model.params, params_or_path
    elif any(isinstance(model, f.config) for f in fam.FAMILIES.values()):
        if path is None:
            raise TypeError("save_hf(config, params, folder): the folder is missing")
        config, params, folder = model, params_or_path, path
    else:
        raise TypeError(f"save_hf takes a Model (as load_hf returns) or a model config "
                        f"({', '.join(f.config.__name__ for f in fam.FAMILIES.values())}), got {type(model).__name__}")
    folder = os.path.abspath(os.fspath(folder))
    written = (_SINGLE, "config.json")
    if os.path.exists(folder):
        if not os.path.isdir(folder):
            raise FileExistsError(f"{folder} is a file, not a folder")
        others = sorted(set(os.listdir(folder)) - set(written))
        if _INDEX in others:
            raise FileExistsError(f"{folder} holds {_INDEX} (a sharded checkpoint) that loaders would read instead of "
                                  f"the new {_SINGLE}: save into another folder")
        if others and not overwrite:
            raise FileExistsError(f"{folder} holds other files ({', '.join(others[:5])}{' ...' if len(others) > 5 else ''}): "
                                  "save into a new folder, or pass overwrite=True to replace only config.json and "
                                  f"{_SINGLE} there")
    tensors = params_to_hf(config, params)
    parent = os.path.dirname(folder)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}.tmp-", dir=parent)
    try:
        save_file(tensors, os.path.join(tmp, _SINGLE), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config.to_hf_dict(), f, indent=2)
        if os.path.isdir(folder):
            for name in written:  # the weights first, then the config that describes them
                os.replace(os.path.join(tmp, name), os.path.join(folder, name))
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder
