"""What every command needs, built once from an `ExperimentConfig`: the env, tokenizer, text tables and model,
and where a command's params come from (fresh, a checkpoint, an exported Hugging Face folder)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import text
from jaxrl_llm.checkpoint import Checkpointer
from jaxrl_llm.config import ExperimentConfig
from jaxrl_llm.generate import sampler as sampling
from jaxrl_llm.train.keys import stream
from models.lfm2 import Lfm2ForCausalLM, init_cache

ENV_FILE = "jaxrl_llm_env.json"  # written next to an exported HF checkpoint: the env it was trained on


@dataclasses.dataclass
class Components:
    """What every command needs, built once from the config (host objects; tables are device arrays)."""

    config: ExperimentConfig
    env: Any  # envs.core.Env
    tokenizer: Any
    tables: text.TextTables
    lfm2: Any  # models.lfm2.Lfm2Config
    module: Lfm2ForCausalLM
    compiled: dict = dataclasses.field(default_factory=dict)  # jitted programs, built on first use

    @property
    def model_fn(self) -> sampling.ModelFn:
        return sampling.lfm2_model_fn(self.module)

    def init_cache(self, batch: int, max_len: int):
        return init_cache(self.lfm2, batch, max_len)

    @property
    def eos_id(self) -> int:
        return self.tables.eos_id

    def sampling_config(self, config: sampling.SamplingConfig) -> sampling.SamplingConfig:
        """`config` with this tokenizer's end of turn as a stop token and its pad id."""
        return config.with_tokenizer((self.eos_id,), self.tables.pad_id)


def build(config: ExperimentConfig) -> Components:
    """Env, tokenizer, text tables and model of `config` (checks the tokenizer fits the model)."""
    env = config.make_env()
    tokenizer = text.load_tokenizer(config.tokenizer.path)
    tables = text.tables_for_env(tokenizer, env)
    lfm2 = config.model.lfm2_config()
    if len(tokenizer) > lfm2.vocab_size:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {lfm2.vocab_size}; "
            f"set model.vocab_size >= {len(tokenizer)} (e.g. --set model.vocab_size={len(tokenizer)})"
        )
    return Components(config, env, tokenizer, tables, lfm2, Lfm2ForCausalLM(lfm2))


def fresh_params(comp: Components, key: jax.Array):
    """Initial policy params: the HF checkpoint `model.init_from` if set, else a random init."""
    if comp.config.model.init_from is not None:
        from models.hf import load_hf

        return load_hf(comp.config.model.init_from).params
    return comp.module.init(key, jnp.zeros((1, 8), jnp.int32))["params"]


def init_key(config: ExperimentConfig) -> jax.Array:
    """The key of the model's initial parameters (stream "init")."""
    return stream(config.run.seed, "init")


def make_mesh(config: ExperimentConfig):
    """The device mesh of `config.mesh` (axes `data`, `fsdp`); None on a single device."""
    devices = jax.devices()
    if len(devices) == 1:
        return None
    from jax.sharding import Mesh

    data, fsdp = config.mesh.axis_sizes(len(devices))
    return Mesh(np.asarray(devices).reshape(data, fsdp), ("data", "fsdp"))


def shard_params(comp: Components, params, mesh):
    """Places params on `mesh`: the `embed` axis of every weight sharded over `fsdp`, the rest replicated
    (optimizer states follow, since optax builds them from the params)."""
    if mesh is None:
        return params
    from models.lfm2 import param_shardings

    return jax.device_put(params, param_shardings(comp.lfm2, mesh))


def sft_dir(config: ExperimentConfig) -> Path:
    return Path(config.run.output_dir) / "sft"


def initial_policy(comp: Components):
    """The params GRPO starts from: the SFT checkpoint of this run when there is one, else `fresh_params`."""
    folder = sft_dir(comp.config)
    key = init_key(comp.config)
    if folder.is_dir():
        with Checkpointer(folder, read_only=True) as ckpt:
            if ckpt.latest_step() is not None:
                ckpt.check_config(comp.config)
                target = jax.eval_shape(lambda: fresh_params(comp, key))
                return ckpt.restore_subtree("params", target=target)
    return fresh_params(comp, key)


def env_record(config: ExperimentConfig) -> dict[str, Any]:
    """The env a model is trained on, as JSON: {"name", "params"} (checkpoints and exports carry it)."""
    from jaxrl_llm.config import config_to_dict

    return {"name": config.env.name, "params": config_to_dict(config.env.params) if config.env.params else {}}


def check_env_record(saved: dict[str, Any] | None, config: ExperimentConfig, where: str) -> None:
    """Raises ValueError naming both envs when a model trained on one env is used with another."""
    if not saved:
        return
    mine = env_record(config)
    if saved.get("name") != mine["name"]:
        raise ValueError(f"{where} was trained on env {saved.get('name')!r} but the config uses env "
                         f"{mine['name']!r}: use the preset it was trained with (or --set env.name=...)")
    if saved.get("params") and saved["params"] != mine["params"]:
        diff = [f"env.params.{k}: {saved['params'].get(k)!r} there, {mine['params'].get(k)!r} here"
                for k in sorted(set(saved["params"]) | set(mine["params"]))
                if saved["params"].get(k) != mine["params"].get(k)]
        raise ValueError(f"{where} was trained on env {mine['name']!r} with other params ({'; '.join(diff)}): "
                         "use the preset it was trained with")


def _hf_params(comp: Components, folder: str, target):
    """The params of a Hugging Face LFM2 folder (`jaxrl-llm export`'s output), checked against the model."""
    from models.hf import load_hf

    env_file = Path(folder) / ENV_FILE
    if env_file.is_file():
        check_env_record(json.loads(env_file.read_text()), comp.config, folder)
    loaded = load_hf(folder)
    if loaded.config.num_hidden_layers != comp.lfm2.num_hidden_layers or loaded.config.hidden_size != comp.lfm2.hidden_size \
            or loaded.config.vocab_size != comp.lfm2.vocab_size:
        raise ValueError(
            f"{folder} holds a model with {loaded.config.num_hidden_layers} layers, hidden {loaded.config.hidden_size}, "
            f"vocab {loaded.config.vocab_size}, but the config builds {comp.lfm2.num_hidden_layers} / "
            f"{comp.lfm2.hidden_size} / {comp.lfm2.vocab_size}: use the preset it was trained with")
    got = jax.tree_util.tree_map(lambda x: (x.shape, str(x.dtype)), loaded.params)
    want = jax.tree_util.tree_map(lambda x: (x.shape, str(x.dtype)), target)
    if got != want:
        raise ValueError(f"{folder}'s tensors do not match the config's model (shapes or dtypes differ); "
                         "use the preset it was trained with")
    print(f"params from {folder} (Hugging Face folder)")
    return loaded.params


def policy_params(config: ExperimentConfig, comp: Components, checkpoint: str | None):
    """Params to evaluate / play / export: `--checkpoint DIR` (a GRPO or SFT checkpoint folder, or a Hugging
    Face folder with config.json + safetensors such as `jaxrl-llm export` writes), else the
    run's latest GRPO checkpoint, else its SFT checkpoint, else `model.init_from` (a Hugging Face folder),
    else a fresh init (with a warning)."""
    target = jax.eval_shape(lambda: fresh_params(comp, init_key(config)))
    if checkpoint and (Path(checkpoint) / "config.json").is_file():
        return _hf_params(comp, checkpoint, target)
    candidates = [checkpoint] if checkpoint else [config.checkpoint_dir(), str(sft_dir(config))]
    for folder in candidates:
        try:
            with Checkpointer(folder, read_only=True) as ckpt:
                if ckpt.latest_step() is not None:
                    ckpt.check_config(config)
                    print(f"params from {folder} (step {ckpt.latest_step()})")
                    return ckpt.restore_subtree("params", target=target)
        except FileNotFoundError:
            if checkpoint:
                raise
    if config.model.init_from is not None:
        print(f"no checkpoint in {', '.join(map(str, candidates))}: params from model.init_from = {config.model.init_from}")
    else:
        print("warning: no checkpoint found: using freshly initialised params")
    return fresh_params(comp, init_key(config))
