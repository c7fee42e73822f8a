"""What every command needs, built once from an `ExperimentConfig`: the env, tokenizer, text tables and model,
and where a command's params come from (fresh, a checkpoint, an exported Hugging Face folder). The checks that
a saved model fits the config live in `jaxrl_llm.compat`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm import text
from jaxrl_llm.checkpoint import CheckpointMismatchError
from jaxrl_llm.checks import ConfigError
from jaxrl_llm.compat import check_checkpoint, check_hf_folder, run_checkpointer
from jaxrl_llm.config import ExperimentConfig
from jaxrl_llm.generate import sampler as sampling
from jaxrl_llm.train.keys import stream
from models import family as fam
from models import lora as lora_lib
from models.hf import load_hf


@dataclasses.dataclass
class Components:
    """What every command needs, built once from the config (host objects; tables are device arrays)."""

    config: ExperimentConfig
    env: Any  # envs.core.Env
    tokenizer: Any
    tables: text.TextTables
    model_config: Any  # the model family's config (`models.family`: Lfm2Config, Qwen3Config)
    module: Any  # the family's Flax module, or models.lora.LoraModel around it when [lora] rank >= 1
    compiled: dict = dataclasses.field(default_factory=dict)  # jitted programs, built on first use
    base: Any = dataclasses.field(default=None, repr=False)  # LoRA: the frozen base, loaded once (`base_params`)

    @property
    def lora(self) -> lora_lib.LoraConfig | None:
        """The LoRA settings when adapters are trained ([lora] rank >= 1), else None (full fine-tuning)."""
        return self.config.lora if self.config.lora.enabled else None

    @property
    def model_fn(self) -> sampling.ModelFn:
        return fam.cached_call(self.module)

    def init_cache(self, batch: int, max_len: int):
        return fam.init_cache(self.model_config, batch, max_len)

    @property
    def lfm2(self) -> Any:
        """The old name of `model_config` (from when LFM2 was the one family), kept for users' code."""
        return self.model_config

    @property
    def eos_id(self) -> int:
        return self.tables.eos_id

    def sampling_config(self, config: sampling.SamplingConfig) -> sampling.SamplingConfig:
        """`config` with this tokenizer's end of turn as a stop token and its pad id."""
        return config.with_tokenizer((self.eos_id,), self.tables.pad_id)


def build(config: ExperimentConfig) -> Components:
    """Env, tokenizer, text tables and model of `config` (checks the tokenizer fits the model)."""
    if config.model.init_from is not None:  # the folder's env and tokenizer must be the config's
        try:
            check_hf_folder(config, config.model.init_from)
        except CheckpointMismatchError as e:
            raise ConfigError(str(e), ("model", "init_from")) from None
    env = config.make_env()
    tokenizer = text.load_tokenizer(config.tokenizer.path, config.tokenizer.chat_template)
    model_config = config.model.model_config()
    if len(tokenizer) > model_config.vocab_size:
        where = "model.init_from's config.json" if config.model.init_from else "the model's vocab_size"
        raise ConfigError(
            f"the tokenizer ({config.tokenizer.path or 'the project tokenizer'}) has {len(tokenizer)} tokens but "
            f"{where} is {model_config.vocab_size}; set model.vocab_size >= {len(tokenizer)} (e.g. --set "
            f"model.vocab_size={len(tokenizer)}) or use the tokenizer the model was made for", ("model", "vocab_size"))
    tables = text.tables_for_env(tokenizer, env)
    check_context_lengths(config, tables)
    module = fam.module_of(model_config)
    if config.lora.enabled:
        shapes = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))["params"])
        try:
            lora_lib.adapter_paths(config.lora, shapes)
        except ValueError as e:
            raise ConfigError(str(e), ("lora", "targets")) from None
        try:
            lora_lib.check_rank(config.lora, shapes)
        except ValueError as e:
            raise ConfigError(str(e), ("lora", "rank")) from None
        module = lora_lib.LoraModel(module, config.lora)
    return Components(config, env, tokenizer, tables, model_config, module)


def check_context_lengths(config: ExperimentConfig, tables: text.TextTables) -> None:
    """Every rollout's context must hold the system prefix, one message and one reply (ConfigError naming
    the key and both numbers, before anything compiles)."""
    uses = [(("eval", "rollout", "context_length"), config.eval.rollout, config.eval.sampling)]
    uses += [(("grpo", i, "rollout", "context_length"), s.rollout, s.sampling) for i, s in enumerate(config.grpo)]
    for where, rollout_config, sampling_config in uses:
        need = tables.prefix_length + tables.max_msg + 1 + sampling_config.max_new_tokens
        if rollout_config.context_length < need:
            raise ConfigError(
                f"{rollout_config.context_length} cannot hold the system prompt ({tables.prefix_length} tokens), one "
                f"message (up to {tables.max_msg}) and one reply (max_new_tokens {sampling_config.max_new_tokens}): "
                f"it must be >= {need}", where)


def fresh_params(comp: Components, key: jax.Array):
    """Initial policy params: the HF checkpoint `model.init_from` if set, else a random init."""
    if comp.config.model.init_from is not None:
        return load_hf(comp.config.model.init_from).params
    return comp.module.init(key, jnp.zeros((1, 8), jnp.int32))["params"]


def init_key(config: ExperimentConfig) -> jax.Array:
    """The key of the model's initial parameters (stream "init")."""
    return stream(config.run.seed, "init")


# ---- what is trained: the whole model, or (LoRA) adapters on a frozen base ----
# "trainable" params are what the optimizer updates and the checkpoints hold: the model's params, or with
# [lora] rank >= 1 the adapters alone. "policy" params are what `comp.module` applies: the same tree, or
# with LoRA `lora.join(base, adapters)` (a plain base tree there: adapters off).


def base_params(comp: Components, mesh=None):
    """LoRA's frozen base (`fresh_params`: model.init_from, or the seeded random init), loaded on first use
    and kept on `comp`, so the policy, the KL reference, SFT and GRPO share one copy; placed on `mesh`."""
    if comp.base is None:
        comp.base = fresh_params(comp, init_key(comp.config))
    if mesh is not None:
        comp.base = shard_params(comp, comp.base, mesh)
    return comp.base


def fresh_trainable(comp: Components):
    """The initial trainable params: fresh adapters (stream "lora"; B = 0, so the policy is the base) with
    LoRA, else `fresh_params`."""
    if comp.lora is None:
        return fresh_params(comp, init_key(comp.config))
    shapes = jax.eval_shape(lambda: fresh_params(comp, init_key(comp.config)))
    return lora_lib.init_adapters(comp.lora, shapes, stream(comp.config.run.seed, "lora"))


def trainable_target(comp: Components):
    """ShapeDtypeStructs of the trainable params (the `params` a checkpoint holds)."""
    return jax.eval_shape(lambda: fresh_trainable(comp))


def policy_view(comp: Components, trainable):
    """The params `comp.module` applies for these trainable params (LoRA: joined to the base; no copy)."""
    return trainable if comp.lora is None else lora_lib.join(base_params(comp), trainable)


def merged_params(comp: Components, params):
    """A plain params tree of policy params: LoRA adapters folded into the base (`lora.merge`)."""
    return lora_lib.merge(comp.lora, params) if lora_lib.is_joined(params) else params


def replicate(params, mesh):
    """params replicated on every device of `mesh` (LoRA adapters); unchanged without a mesh."""
    if mesh is None:
        return params
    return jax.device_put(params, NamedSharding(mesh, PartitionSpec()))


def make_mesh(config: ExperimentConfig):
    """The device mesh of `config.mesh` (axes `data`, `fsdp`); None on a single device (with a warning when
    mesh.data or mesh.fsdp asks for more devices than that)."""
    devices = jax.devices()
    if len(devices) == 1:
        asked = {k: getattr(config.mesh, k) for k in ("data", "fsdp") if getattr(config.mesh, k) > 1}
        if asked:
            shown = ", ".join(f"mesh.{k} = {v}" for k, v in asked.items())
            print(f"warning: {shown} asks for more devices than the 1 present ({devices[0].platform}): running on "
                  "that single device without a mesh (data 1 x fsdp 1)")
        return None
    data, fsdp = config.mesh.axis_sizes(len(devices))
    return Mesh(np.asarray(devices).reshape(data, fsdp), ("data", "fsdp"))


def shard_params(comp: Components, params, mesh):
    """Places params on `mesh`: the `embed` axis of every weight sharded over `fsdp`, the rest replicated
    (optimizer states follow, since optax builds them from the params)."""
    if mesh is None:
        return params
    return jax.device_put(params, fam.param_shardings(comp.model_config, mesh))


def sft_dir(config: ExperimentConfig) -> Path:
    return Path(config.run.output_dir) / "sft"


def sft_trainable(comp: Components):
    """The trainable params of this run's SFT checkpoint, or None when there is none."""
    folder = sft_dir(comp.config)
    if folder.is_dir():
        with run_checkpointer(folder, read_only=True) as ckpt:
            if ckpt.latest_step() is not None:
                return ckpt.restore_newest_good(trainable_target(comp), expect_config=comp.config,
                                                subtree="params")[1]
    return None


def initial_policy(comp: Components):
    """The trainable params GRPO starts from: the SFT checkpoint of this run when there is one, else
    `fresh_trainable` (the model's params, or with LoRA the adapters)."""
    params = sft_trainable(comp)
    return fresh_trainable(comp) if params is None else params


def _hf_params(comp: Components, folder: str, target):
    """The params of a Hugging Face folder (`jaxrl-llm export`'s output), checked against the config:
    its env, tokenizer and architecture (`check_checkpoint`), then its tensors (both values named)."""
    check_checkpoint(comp.config, folder)
    loaded = load_hf(folder)
    got = dict((jax.tree_util.keystr(p), (x.shape, str(x.dtype)))
               for p, x in jax.tree_util.tree_flatten_with_path(loaded.params)[0])
    want = dict((jax.tree_util.keystr(p), (x.shape, str(x.dtype)))
                for p, x in jax.tree_util.tree_flatten_with_path(target)[0])
    if got != want:
        bad = [f"{k}: {got.get(k)} there, {want.get(k)} in the config" for k in sorted(set(got) | set(want))
               if got.get(k) != want.get(k)]
        raise CheckpointMismatchError(f"{folder}'s tensors do not match the config's model ({'; '.join(bad[:3])}"
                                      f"{' ...' if len(bad) > 3 else ''}): use the preset it was trained with")
    print(f"params from {folder} (Hugging Face folder)")
    return loaded.params


def policy_params(config: ExperimentConfig, comp: Components, checkpoint: str | None):
    """`policy_source`'s params alone."""
    return policy_source(config, comp, checkpoint)[0]


def policy_source(config: ExperimentConfig, comp: Components, checkpoint: str | None):
    """-> (params, step, source): the params as `policy_params` describes below, the checkpoint step they come
    from (None for a Hugging Face folder or a fresh init) and the folder (None: a fresh init).

    Params to evaluate / play / export: `--checkpoint DIR` (a GRPO or SFT checkpoint folder, or a Hugging
    Face folder with config.json + safetensors such as `jaxrl-llm export` writes; a folder that holds
    neither is an error), else the run's latest GRPO checkpoint, else its SFT checkpoint, else
    `model.init_from` (a Hugging Face folder), else a fresh init (with a warning). A damaged newest step
    falls back to the newest good one with a warning naming both. Returns policy params (`policy_view`:
    with LoRA the base joined with the checkpoint's adapters; an HF folder is a whole, merged model)."""
    target = trainable_target(comp)
    if checkpoint:
        if (Path(checkpoint) / "config.json").is_file():
            params = _hf_params(comp, checkpoint, jax.eval_shape(lambda: fresh_params(comp, init_key(config))))
            return params, None, str(checkpoint)
        check_checkpoint(config, checkpoint)
        with run_checkpointer(checkpoint, read_only=True) as ckpt:
            step, params = ckpt.restore_newest_good(target, expect_config=config, subtree="params")
            print(f"params from {checkpoint} (step {step})")
            return policy_view(comp, params), step, str(checkpoint)
    candidates = [config.checkpoint_dir(), str(sft_dir(config))]
    for folder in candidates:
        if not Path(folder).is_dir():
            continue
        with run_checkpointer(folder, read_only=True) as ckpt:
            if ckpt.latest_step() is not None:
                step, params = ckpt.restore_newest_good(target, expect_config=config, subtree="params")
                print(f"params from {folder} (step {step})")
                return policy_view(comp, params), step, str(folder)
    if config.model.init_from is not None:
        print(f"no checkpoint in {', '.join(map(str, candidates))}: params from model.init_from = {config.model.init_from}")
        source = str(config.model.init_from)
    else:
        print("warning: no checkpoint found: using freshly initialised params")
        source = None
    return (base_params(comp) if comp.lora is not None else fresh_params(comp, init_key(config))), None, source


def fresh_start_warning(config: ExperimentConfig) -> str | None:
    """The warning for GRPO that would start from a freshly initialised model (no GRPO checkpoint to resume,
    no SFT checkpoint of this run, no model.init_from, replies not constrained to the grammar), else None.
    Such a model's replies are random text: almost no game gets a well-formed move, every group's rewards are
    equal, and GRPO has no signal."""
    stages = [s for s in config.grpo if s.steps]
    if config.model.init_from is not None or not stages:
        return None
    if all(getattr(s.sampling, "constrained", False) for s in stages):
        return None  # every reply is well formed: the reward sees the moves from the first step
    for folder in (config.checkpoint_dir(), str(sft_dir(config))):
        if Path(folder).is_dir() and any(p.name.isdigit() for p in Path(folder).iterdir()):
            return None
    return ("warning: GRPO starts from a freshly initialised model (no SFT checkpoint in "
            f"{sft_dir(config)}, no model.init_from). Its replies are random text, so nearly every game gets the same "
            "reward, the groups have no spread and GRPO rarely learns anything. Start from a model that already "
            "answers in the env's format: run `jaxrl-llm sft` first (the env's teacher, or sft.dataset = a JSONL "
            "of prompt/completion rows, see the README), set model.init_from to a pretrained Hugging Face folder, "
            "or constrain the replies to the env's grammar ([sampling] constrained = "
            "true) so that every reply is a well-formed move from the first step")
