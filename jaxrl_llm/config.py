"""Experiment configuration: TOML presets loaded into the real config dataclasses, validated before anything compiles.

An experiment is one `ExperimentConfig`. Each TOML table is the dataclass that uses it (one dataclass per
concept, no mirrors here):

    [model]            preset (a name of `models.family.PRESETS`: LFM2 or Qwen3) or init_from (an HF
                       folder), plus any field of that family's config as an override -> ModelSection
    [tokenizer]        path (absent = the project's own tokenizer)              -> TokenizerSection
    [env]              name (a registered env, `envs.make`)                     -> EnvSection
      [env.params]     the env's `Params` (e.g. Tic-Tac-Toe's prompt and rubric)
    [sampling]         `generate.SamplingConfig` (the base for stages and evaluation)
    [rollout]          `rollout.RolloutConfig`: context_length, max_turns, cache_stages (the base)
    [sft]              `algos.sft.SftConfig`; [sft.optim] `algos.optim.OptimConfig`; [sft.teacher] the env's `Teacher`
    [[grpo]]           GrpoStage: steps, num_prompts, group_size; [grpo.curriculum] the env's `Stage`;
                       [grpo.sampling] / [grpo.rollout] override the base key by key; [grpo.loss]
                       `algos.grpo.GrpoConfig`; [grpo.optim] `algos.optim.OptimConfig`
    [eval]             num_games, settings (names of the env's evaluation settings), every_steps;
                       [eval.sampling] (over the base, greedy by default) and [eval.rollout] likewise
    [checkpoint]       dir, keep, every_steps, async_save, resume
    [mesh]             data, fsdp axis sizes (-1 = all remaining devices)
    [lora]             `models.lora.LoraConfig`: rank (0 = off, the default), alpha, dropout, targets
    [run]              output_dir, seed, log_every, sample_every

Every dataclass checks its own fields (`jaxrl_llm.checks`); the loader only reads TOML into them: an
unknown key (with the closest valid key), a wrong type (field, expected type, the value got) or a value
a check refuses raises `ConfigError` (a ValueError) naming the whole key path. Fields whose type belongs
to the env (`checks.EnvBound`) are built once `[env] name` is known. `dump_config` writes the TOML text
that loads back to an equal config (a checkpoint stores it; a run is reproduced from it).

Optional fields (`X | None`) default to None, which TOML writes by leaving the key out.

The generic machinery (coercion against annotations, "did you mean" errors with key paths, `--set`
overrides, the TOML writer) is `jaxrl_llm.schema`, the `[model]` table `jaxrl_llm.model_section`; this
module holds the experiment's other sections and re-exports `ConfigError`, `ModelSection`,
`parse_override`, `apply_overrides`, `config_to_dict` and `dumps_toml`.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

from jaxrl_base.errors import ModelError
from jaxrl_llm.algos.grpo_config import GrpoConfig
from jaxrl_llm.algos.optim import OptimConfig
from jaxrl_llm.algos.sft import SftConfig
from jaxrl_llm.checks import ConfigError, EnvBound, check_choice, check_int, check_str
from jaxrl_llm.generate.sampler import SamplingConfig
from jaxrl_llm.model_section import ModelSection
from jaxrl_llm.rollout.rollout import RolloutConfig
from jaxrl_llm.schema import (  # noqa: F401 (config_to_dict, dumps_toml, parse_override: re-exported)
    BuildContext, Section, apply_overrides, build, coerce, config_to_dict, dumps_toml, hints, init_fields,
    loads_toml, parse_override, sub_table, toml_type, unknown_key,
)
from models.lora import LoraConfig

__all__ = [
    "ConfigError",
    "ModelSection",
    "TokenizerSection",
    "EnvSection",
    "GrpoStage",
    "EvalSection",
    "CheckpointSection",
    "MeshSection",
    "RunSection",
    "ExperimentConfig",
    "load_config",
    "loads_config",
    "config_from_dict",
    "config_to_dict",
    "dump_config",
    "apply_overrides",
    "parse_override",
]



@dataclasses.dataclass(frozen=True)
class _Section(Section):
    """Base of the experiment's config-only sections (`schema.Section` with `ExperimentConfig` as the root
    whose tables an unknown key's error searches)."""

    @classmethod
    def _context(cls) -> BuildContext:
        return BuildContext(root=lambda: ExperimentConfig)  # a function: the root's defaults come first


# ----------------------------------------------------------------------------------------------------------
# Sections
# ----------------------------------------------------------------------------------------------------------

CHAT_TEMPLATES = ("chatml", "lfm2")  # `[tokenizer] chat_template`: `text.tokenizer.chat_template(name)`


@dataclasses.dataclass(frozen=True)
class TokenizerSection(_Section):
    """`path`: a Hugging Face tokenizer folder; None = the project's tokenizer (`text.load_tokenizer`).
    `chat_template`: None keeps the tokenizer's own; "chatml" sets Qwen's ChatML that writes replies as they
    are (`text.tokenizer.CHATML_TEMPLATE`: for Qwen3's tokenizer, whose released template rewrites earlier
    replies, which the text bridge refuses); "lfm2" sets LFM2's (`CHAT_TEMPLATE`). An export saves it."""

    path: str | None = None
    chat_template: str | None = None

    def _validate(self) -> None:
        if self.chat_template is not None:
            check_choice(self, "chat_template", CHAT_TEMPLATES)


@dataclasses.dataclass(frozen=True)
class EnvSection(_Section):
    """The environment: `name` (registered with `envs.register`; `envs.make(name, **params)`) and its
    `Params` (the `[env.params]` table)."""

    name: str = dataclasses.field(default_factory=lambda: _default_env_name())
    params: Annotated[Any, EnvBound("Params")] = None

    def _validate(self) -> None:
        check_str(self, "name")

    def env_class(self):
        """The registered Env subclass (ConfigError with the closest names if unknown)."""
        return _env_class(self.name)

    def make(self):
        """The env instance with these params."""
        cls = self.env_class()
        return cls(self.params if self.params is not None else cls.Params())


def _default_env_name() -> str:
    """The env of a config without `[env] name` (`envs.DEFAULT_ENV`)."""
    import envs

    return envs.DEFAULT_ENV


def _env_class(name: str):
    import envs

    try:
        return envs.env_class(name)
    except KeyError as e:
        raise ConfigError(str(e.args[0]) if e.args else str(e), ("env", "name")) from None


@dataclasses.dataclass(frozen=True)
class GrpoStage(_Section):
    """One GRPO stage: `steps` updates, each on `num_prompts` examples x `group_size` rollouts drawn from
    the env's curriculum `Stage` (`curriculum`). `sampling` and `rollout` are the experiment's with this
    stage's `[grpo.sampling]` / `[grpo.rollout]` keys on top; `loss` (GrpoConfig) and `optim`
    (OptimConfig, counted in optimizer updates: total_steps defaulting to steps * passes *
    num_minibatches) are the update's."""

    steps: int = 100
    num_prompts: int = 32
    group_size: int = 8
    curriculum: Annotated[Any, EnvBound("Stage")] = None
    sampling: SamplingConfig = SamplingConfig()
    rollout: RolloutConfig = RolloutConfig()
    loss: GrpoConfig = GrpoConfig()
    optim: OptimConfig = OptimConfig()

    def _validate(self) -> None:
        check_int(self, "steps", 0)
        check_int(self, "num_prompts", 1)
        if check_int(self, "group_size", 1) < 2:
            raise ConfigError(f"must be >= 2 (got {self.group_size}): a group of one has no baseline", ("group_size",))
        micro = self.loss.num_minibatches * self.loss.grad_accum_steps
        if self.batch_size % micro:
            raise ConfigError(f"num_minibatches * grad_accum_steps ({micro}) must divide the batch num_prompts * "
                              f"group_size ({self.batch_size})", ("loss", "num_minibatches"))
        if self.sampling.max_new_tokens >= self.rollout.context_length:
            raise ConfigError(f"must be below the stage's context length {self.rollout.context_length}",
                              ("sampling", "max_new_tokens"))
        if not self.sampling.temperature > 0:  # greedy sampling allows 0, but the update divides the logits by it
            raise ConfigError(f"must be > 0 (got {self.sampling.temperature:g}): the GRPO update divides the "
                              "policy's logits by it, even when greedy", ("sampling", "temperature"))
        self.grpo_config()  # the effective loss config must be valid too

    @property
    def batch_size(self) -> int:
        """Rollouts per update: num_prompts * group_size."""
        return self.num_prompts * self.group_size

    def grpo_config(self) -> GrpoConfig:
        """The loss with max_completion_tokens resolved: when unset, max_turns * max_new_tokens. (The update
        takes the stage's `group_size` and `sampling.temperature` as arguments: `train.grpo_loop.make_grpo_step`.)"""
        max_completion = self.loss.max_completion_tokens or self.rollout.max_turns * self.sampling.max_new_tokens
        return dataclasses.replace(self.loss, max_completion_tokens=max_completion)

    def optim_config(self) -> OptimConfig:
        """The optimizer with total_steps resolved. Its schedule counts optimizer updates, of which a GRPO
        step makes `passes * num_minibatches`: the default total is steps * passes * num_minibatches, and
        warmup_steps / total_steps are in updates too."""
        return self.optim.for_steps(self.steps * self.loss.passes * self.loss.num_minibatches)


@dataclasses.dataclass(frozen=True)
class EvalSection(_Section):
    """Evaluation: `num_games` games in each of `settings` (names of the env's evaluation settings; empty:
    all of them). `sampling` / `rollout`: the experiment's with `greedy = true` and this table's keys on top.
    every_steps: also evaluate during training every N GRPO steps, into <run.output_dir>/eval_metrics.jsonl
    (0 = never during training).
    batch_size: games played at once (0 = all `num_games` in one batch, the default, for an accelerator).
    On a CPU, batches of a few hundred play faster per game than one of thousands: every game of a batch
    waits for its longest one, and a smaller cache stays nearer the cores. A last, short batch is padded to
    the same shape (one compiled program). Greedy games do not depend on it; sampled games take one key per
    batch."""

    num_games: int = 100
    settings: tuple[str, ...] = ()
    every_steps: int = 0
    batch_size: int = 0
    sampling: SamplingConfig = SamplingConfig(greedy=True)
    rollout: RolloutConfig = RolloutConfig()

    def _validate(self) -> None:
        check_int(self, "num_games", 1)
        check_int(self, "every_steps", 0)
        check_int(self, "batch_size", 0)


@dataclasses.dataclass(frozen=True)
class CheckpointSection(_Section):
    """Checkpoints: `dir` (None = <run.output_dir>/checkpoints), the last `keep` kept, one every
    `every_steps` steps (0 = only at the end of each stage), asynchronous writes (`async_save`), and
    `resume` from the latest checkpoint in `dir` when there is one. A resume whose training config differs
    from the checkpoint's is refused unless `accept_config_change` (`jaxrl_llm.run_config`)."""

    dir: str | None = None
    keep: int = 3
    every_steps: int = 100
    async_save: bool = True
    resume: bool = True
    accept_config_change: bool = False

    def _validate(self) -> None:
        check_int(self, "keep", 1)
        check_int(self, "every_steps", 0)


@dataclasses.dataclass(frozen=True)
class MeshSection(_Section):
    """Device mesh axis sizes: `data` (replicated params, split batch) x `fsdp` (params and batch split);
    -1 = all the devices the other axis leaves."""

    data: int = -1
    fsdp: int = 1

    def _validate(self) -> None:
        for name in ("data", "fsdp"):
            if getattr(self, name) != -1 and getattr(self, name) < 1:
                raise ConfigError(f"must be >= 1, or -1 for all remaining devices (got {getattr(self, name)})", (name,))
        if self.data == -1 and self.fsdp == -1:
            raise ConfigError("only one of data and fsdp can be -1", ("fsdp",))

    def axis_sizes(self, num_devices: int) -> tuple[int, int]:
        """-> (data, fsdp) with -1 resolved; raises ConfigError unless data * fsdp == num_devices."""
        data, fsdp = self.data, self.fsdp
        if data == -1:
            data = num_devices // fsdp if num_devices % fsdp == 0 else 0
        if fsdp == -1:
            fsdp = num_devices // data if num_devices % data == 0 else 0
        if data < 1 or fsdp < 1 or data * fsdp != num_devices:
            raise ConfigError(f"data {self.data} x fsdp {self.fsdp} does not fit {num_devices} devices", ("mesh",))
        return data, fsdp


@dataclasses.dataclass(frozen=True)
class RunSection(_Section):
    """The run: `output_dir` (metrics, checkpoints, plots), `seed`, a metrics line every `log_every`
    steps and a printed sample game every `sample_every` steps (0 = never); `log`: where metrics go,
    "jsonl" (always written) and optionally "tensorboard" (tensorboardX, `<output_dir>/tensorboard`) and
    "wandb" (offline unless WANDB_MODE says otherwise), see `jaxrl_llm.log_sinks`."""

    output_dir: str = "runs/default"
    seed: int = 0
    log_every: int = 1
    sample_every: int = 0
    log: tuple[str, ...] = ("jsonl",)

    def _validate(self) -> None:
        from jaxrl_llm.log_sinks import LOG_SINKS

        if isinstance(self.log, str) or not isinstance(self.log, (list, tuple)):
            raise ConfigError(f"expected an array of names from {list(LOG_SINKS)}, got {self.log!r}", ("log",),
                              type(self).__name__)
        object.__setattr__(self, "log", tuple(self.log))
        for i, name in enumerate(self.log):
            if name not in LOG_SINKS:
                raise ConfigError(f"unknown log {name!r}: use any of {list(LOG_SINKS)} (e.g. [\"jsonl\", "
                                  "\"tensorboard\"])", ("log", i), type(self).__name__)
        check_int(self, "log_every", 1)
        check_int(self, "seed", 0, 2**63 - 1)
        check_int(self, "sample_every", 0)
        check_str(self, "output_dir")


# Tables that inherit the experiment's [sampling] / [rollout] key by key.
_INHERITED = ("sampling", "rollout")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig(_Section):
    """A whole experiment (see the module docstring). Frozen and hashable."""

    model: ModelSection = ModelSection()
    tokenizer: TokenizerSection = TokenizerSection()
    env: EnvSection = EnvSection()
    sampling: SamplingConfig = SamplingConfig()
    rollout: RolloutConfig = RolloutConfig()
    sft: SftConfig = SftConfig()
    grpo: tuple[GrpoStage, ...] = ()
    eval: EvalSection = EvalSection()
    checkpoint: CheckpointSection = CheckpointSection()
    mesh: MeshSection = MeshSection()
    run: RunSection = RunSection()
    lora: LoraConfig = LoraConfig()

    @classmethod
    def _from_table(cls, data: Mapping[str, Any], context: BuildContext = BuildContext()) -> "ExperimentConfig":
        """The whole config: the env first (its types), then the sections, stages and eval over the base
        [sampling] / [rollout] tables."""
        data = dict(data)
        for key in data:
            if key not in {f.name for f in init_fields(cls)}:
                raise unknown_key(cls, str(key), cls)
        env_table = data.get("env", {})
        if not isinstance(env_table, Mapping):
            raise ConfigError(f"expected a table, got {toml_type(env_table)}", ("env",))
        name = env_table.get("name", _default_env_name())
        if not isinstance(name, str):
            raise ConfigError(f"expected a string, got {toml_type(name)}", ("env", "name"))
        env_cls = _env_class(name)
        context = BuildContext(env_cls=env_cls, root=cls)
        base = {k: dict(sub_table(data, k)) for k in _INHERITED}

        def overlay(table: Any, where: tuple, defaults: Mapping[str, Any] | None = None) -> dict:
            table = dict(table)
            for k in _INHERITED:
                table[k] = {**base[k], **(defaults or {}).get(k, {}), **sub_table(table, k, where)}
            return table

        if "grpo" in data:
            if not isinstance(data["grpo"], (list, tuple)):
                raise ConfigError(f"expected an array of tables ([[grpo]]), got {toml_type(data['grpo'])}", ("grpo",))
            stages = []
            for i, stage in enumerate(data["grpo"]):
                if not isinstance(stage, Mapping):
                    raise ConfigError(f"expected a table, got {toml_type(stage)}", ("grpo", i))
                stages.append(overlay(stage, ("grpo", i)))
            data["grpo"] = stages
        data["eval"] = overlay(sub_table(data, "eval"), ("eval",), {"sampling": {"greedy": True}})
        field_types = hints(cls)
        kwargs = {}
        for key, value in data.items():
            try:
                kwargs[key] = coerce(value, field_types[key], context)
            except ConfigError as e:
                raise e.prefixed(key) from None
        if "env" not in kwargs:
            kwargs["env"] = EnvSection(name=name, params=env_cls.Params())
        if "sft" not in kwargs:
            kwargs["sft"] = coerce({}, field_types["sft"], context)
        return cls(**kwargs)

    def _validate(self) -> None:
        env_cls = self.env.env_class()
        self._resolve_env_types(env_cls)
        max_pos = None
        if self.model.init_from is None:
            max_pos = self.model.model_config().max_position_embeddings
            for where, ctx in [(("rollout", "context_length"), self.rollout.context_length),
                               (("eval", "rollout", "context_length"), self.eval.rollout.context_length),
                               *[(("grpo", i, "rollout", "context_length"), s.rollout.context_length)
                                 for i, s in enumerate(self.grpo)]]:
                if ctx > max_pos:
                    raise ConfigError(f"{ctx} exceeds the model's max_position_embeddings {max_pos}", where)
            if self.sft.seq_len > max_pos:
                raise ConfigError(f"exceeds the model's max_position_embeddings {max_pos}", ("sft", "seq_len"))
        for where, section in [(("eval",), self.eval), *[(("grpo", i), s) for i, s in enumerate(self.grpo)]]:
            if section.sampling.max_new_tokens >= section.rollout.context_length:
                raise ConfigError(f"must be below the context length {section.rollout.context_length}",
                                  (*where, "sampling", "max_new_tokens"))
        names = [s.name for s in env_cls().eval_settings()]
        for i, name in enumerate(self.eval.settings):
            if name not in names:
                close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"env {self.env.name!r} has no evaluation setting {name!r}{hint} (it has: "
                                  f"{', '.join(names)})", ("eval", "settings", i))
        if self.sft.steps and self.sft.dataset is None and self.sft.teacher is None:
            raise ConfigError(f"env {self.env.name!r} has no teacher: give sft.dataset, or sft.steps = 0",
                              ("sft", "dataset"))
        if self.sft.check_every and not env_cls().has_check_rows(self.sft.teacher):
            raise ConfigError(f"env {self.env.name!r} has no exactness check for this teacher "
                              f"({self.sft.teacher!r})", ("sft", "check_every"))
        self._check_curricula()

    def _check_curricula(self) -> None:
        """Each stage's curriculum against the env's params (e.g. a search depth above max_depth): the env's
        own check, run by tracing `sample_examples` once, re-raised with the key path (grpo.N.curriculum.KEY)."""
        import jax

        env = self.make_env()
        for i, s in enumerate(self.grpo):
            try:
                jax.eval_shape(lambda st=s.curriculum: env.sample_examples(jax.random.PRNGKey(0), 1, 1, st))
            except ConfigError as e:
                where = ("env", "params") if e.owner == "Params" else ("grpo", i, "curriculum")
                raise ConfigError(e.reason, (*where, *e.path)) from None

    def _resolve_env_types(self, env_cls) -> None:
        """Env-bound fields left at None (a config built in Python) get the env's defaults; instances of the
        wrong class are refused."""
        def fix(value, attr, where):
            cls = getattr(env_cls, attr, None)
            if cls is None or cls is type(None):
                if value is not None:
                    raise ConfigError(f"env {env_cls.name!r} has no {attr}", where)
                return None
            if value is None:
                return cls()
            if not isinstance(value, cls):
                raise ConfigError(f"expected the {attr} of env {env_cls.name!r}, got {type(value).__name__}", where)
            return value

        object.__setattr__(self, "env", dataclasses.replace(self.env, params=fix(self.env.params, "Params", ("env", "params"))))
        object.__setattr__(self, "sft", dataclasses.replace(self.sft, teacher=fix(self.sft.teacher, "Teacher", ("sft", "teacher"))))
        object.__setattr__(self, "grpo", tuple(
            dataclasses.replace(s, curriculum=fix(s.curriculum, "Stage", ("grpo", i, "curriculum")))
            for i, s in enumerate(self.grpo)))

    # ---- helpers ----
    def make_env(self):
        """The env of this experiment (`envs.make(env.name, **env.params)`)."""
        return self.env.make()

    def eval_settings(self):
        """The env's evaluation settings named in eval.settings (all of them when it is empty), in order."""
        settings = self.make_env().eval_settings()
        if not self.eval.settings:
            return settings
        by_name = {s.name: s for s in settings}
        return tuple(by_name[n] for n in self.eval.settings)

    def checkpoint_dir(self) -> str:
        """checkpoint.dir, or <run.output_dir>/checkpoints."""
        return self.checkpoint.dir if self.checkpoint.dir is not None else os.path.join(self.run.output_dir,
                                                                                        "checkpoints")


# ----------------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------------


def config_from_dict(data: Mapping[str, Any]) -> ExperimentConfig:
    """Raw TOML data -> a validated ExperimentConfig (ConfigError naming the key path otherwise)."""
    return build(ExperimentConfig, data, BuildContext(root=ExperimentConfig))


def _check_paths(config: ExperimentConfig) -> None:
    folder = config.model.init_from
    if folder is not None and not os.path.isfile(os.path.join(folder, "config.json")):
        raise ConfigError(f"{folder!r} is not a folder with a config.json (a Hugging Face checkpoint of a "
                          "supported family: LFM2, Qwen3)",
                          ("model", "init_from"))
    if folder is not None:
        try:
            config.model.model_config()  # a supported family, and the overrides must fit its architecture
        except ModelError as e:
            raise ConfigError(str(e), ("model", "init_from")) from None
    if config.tokenizer.path is not None and not os.path.exists(config.tokenizer.path):
        raise ConfigError(f"{config.tokenizer.path!r} does not exist", ("tokenizer", "path"))
    if config.sft.dataset is not None and not os.path.exists(config.sft.dataset):
        raise ConfigError(f"{config.sft.dataset!r} does not exist (a save_to_disk folder or a .jsonl/.parquet file)",
                          ("sft", "dataset"))


def loads_config(text: str, overrides: Sequence[str] = (), check_paths: bool = False) -> ExperimentConfig:
    """TOML text (+ overrides) -> ExperimentConfig. check_paths: also check init_from / tokenizer.path exist."""
    config = config_from_dict(apply_overrides(loads_toml(text), overrides))
    if check_paths:
        _check_paths(config)
    return config


def load_config(path: str | os.PathLike, overrides: Sequence[str] = (), check_paths: bool = True) -> ExperimentConfig:
    """Reads a TOML preset, applies `--set` overrides ("dotted.key=value", values TOML literals) and
    validates everything; raises ConfigError (a ValueError) naming the key path."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} not found")
    try:
        return loads_config(path.read_text(encoding="utf-8"), overrides, check_paths)
    except ConfigError as e:
        raise ConfigError(f"{e.reason} (in {path})", e.path) from None


def dump_config(config: ExperimentConfig) -> str:
    """The TOML text of a config; `loads_config(dump_config(c)) == c`."""
    return "# jaxrl_llm experiment config\n" + dumps_toml(config_to_dict(config))
