"""Compatibility records: what a saved model was made with, and the checks that it fits a config.

A checkpoint step (its `meta` JSON) and an exported Hugging Face folder record the env (name, class path,
params), the tokenizer's vocabulary, the LoRA settings, the experiment config (dict and TOML) and the
resolved architecture. Before params are loaded, each is compared with the config's own record and a
difference is a `CheckpointMismatchError` naming both values.

`ExperimentRecords` is how `checkpoint.Checkpointer` (storage, which knows no schema) stores and checks an
`ExperimentConfig`; `run_checkpointer` opens a Checkpointer with it. The direction of the imports: this
module uses storage and the experiment schema; storage uses neither.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from envs.registry import class_path, env_class
from jaxrl_llm.checkpoint import (CheckpointDamagedError, CheckpointMismatchError, CheckpointNotFoundError,
                                  Checkpointer)
from jaxrl_llm.config import ExperimentConfig, config_from_dict, config_to_dict, dump_config
from jaxrl_llm.text.tokenizer import ASSET_DIR
from models.family import config_from_pretrained
from models.lora import LoraConfig

__all__ = [
    "ENV_FILE", "ExperimentRecords", "run_checkpointer", "load_checkpoint_config", "env_record", "same_env",
    "tokenizer_record", "tokenizer_mismatch", "lora_record", "config_meta", "check_meta", "check_env_record",
    "check_hf_folder", "check_hf_architecture", "check_checkpoint",
]

ENV_FILE = "jaxrl_llm_env.json"  # written next to an exported HF checkpoint: the env it was trained on
# Architecture fields that do not change the stored arrays' shapes (a checkpoint restores across them).
ARCH_IGNORED = ("dtype", "param_dtype", "remat", "attention_row_block")


# ---- the records ----


def env_record(config: ExperimentConfig) -> dict[str, Any]:
    """The env a model is trained on, as JSON: {"name" (as the config gives it: a registered name, an entry
    point or a class path), "class" ("module:Class", so the env is found again by any of its names), "params"}.
    Checkpoints and exports carry it."""
    record = {"name": config.env.name}
    try:
        record["class"] = class_path(config.env.env_class())
    except Exception:  # noqa: BLE001 - a record without the class is still a record
        pass
    record["params"] = config_to_dict(config.env.params) if config.env.params is not None else {}
    return record


def _rules_params(params: Mapping[str, Any] | None, config: ExperimentConfig) -> dict[str, Any]:
    """An env record's params without the env class's `reward_params` (the rubric weights): what a model's
    training fixes. Those may differ between a checkpoint and the config that goes on from it."""
    try:
        ignored = set(getattr(config.env.env_class(), "reward_params", ()))
    except Exception:  # noqa: BLE001 - an env that cannot be imported here is checked by name elsewhere
        ignored = set()
    return {k: v for k, v in (params or {}).items() if k not in ignored}


def same_env(saved: dict[str, Any], mine: dict[str, Any]) -> bool:
    """Whether a saved env record names the env of `mine` (this config's record): the same name, or the saved
    name (an entry point or a class path) resolves here to this config's class. A saved name that does not
    resolve here is another env."""
    if saved.get("name") == mine.get("name"):
        return True
    try:
        return bool(mine.get("class")) and class_path(env_class(saved.get("name"))) == mine["class"]
    except Exception:  # noqa: BLE001 - unknown or unimportable: not this env
        return False


@functools.lru_cache(maxsize=64)
def _vocabulary_record(file: str, mtime: float) -> tuple[int, str]:
    """(distinct ids, sha256 of the token -> id map and the added tokens) of a tokenizer.json (read once per
    file version: `mtime` is part of the cache key)."""
    data = json.loads(Path(file).read_text(encoding="utf-8"))
    vocab = (data.get("model") or {}).get("vocab") or {}
    if isinstance(vocab, list):  # unigram models: [[piece, score], ...]
        vocab = {piece[0]: i for i, piece in enumerate(vocab)}
    added = sorted((int(t["id"]), str(t["content"])) for t in data.get("added_tokens") or ())
    ids = set(vocab.values()) | {i for i, _ in added}
    digest = hashlib.sha256(json.dumps([sorted(vocab.items()), added], ensure_ascii=False).encode()).hexdigest()
    return len(ids), digest


def tokenizer_record(path: str | os.PathLike | None) -> dict[str, Any] | None:
    """What identifies a tokenizer's vocabulary, from its folder's `tokenizer.json` (None: the project's
    tokenizer): {"size": distinct ids, "sha256": of the token -> id map and the added tokens, "source"}.
    None when the folder has no tokenizer.json (nothing to compare). Checkpoints and exports carry it."""
    file = Path(ASSET_DIR if path is None else path) / "tokenizer.json"
    if not file.is_file():
        return None
    size, digest = _vocabulary_record(str(file.resolve()), file.stat().st_mtime)
    return {"size": size, "sha256": digest, "source": "the project's tokenizer" if path is None else str(path)}


def tokenizer_mismatch(have: dict[str, Any] | None, want: dict[str, Any] | None, where: str) -> str | None:
    """A sentence naming both tokenizers when two records differ (None when they agree or one is unknown)."""
    if not have or not want or (have.get("size"), have.get("sha256")) == (want.get("size"), want.get("sha256")):
        return None
    def name(r):
        return f"{r.get('size')} tokens ({r.get('source', '?')}, vocabulary sha256 {str(r.get('sha256'))[:12]})"
    return (f"{where} was trained with a tokenizer of {name(have)} but this config's tokenizer has {name(want)}: "
            "token ids would mean other text; set tokenizer.path to the tokenizer it was trained with")


def lora_record(meta: Mapping[str, Any]) -> dict[str, Any]:
    """What makes a checkpoint's params LoRA adapters of a kind: {"rank"} (0: the whole model) and, for
    adapters, "alpha" and the targeted projections (dropout does not matter). Older checkpoints: rank 0."""
    table = ((meta.get("config") or {}).get("lora")) or {}
    try:
        lora = LoraConfig(**{k: v for k, v in table.items() if k in ("rank", "alpha", "targets")})
    except (TypeError, ValueError):
        return {"unreadable": dict(table)}
    if not lora.enabled:
        return {"rank": 0}
    return {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.modules)}


def _lora_text(record: Mapping[str, Any]) -> str:
    if record.get("rank") == 0:
        return "no LoRA (the whole model)"
    return "LoRA " + ", ".join(f"{k} = {v!r}" for k, v in record.items())


def _diff(a: Any, b: Any, prefix: str) -> list[str]:
    """Dotted keys where two JSON values differ, with both values."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), f"{prefix}.{k}")
        return out
    return [] if a == b else [f"{prefix}: checkpoint {a!r}, this config {b!r}"]


def config_meta(config: ExperimentConfig) -> dict[str, Any]:
    """What a checkpoint's `meta` stores of a config: the dict, the TOML text, the env and tokenizer records
    and the resolved architecture."""
    if not isinstance(config, ExperimentConfig):
        raise TypeError(f"config must be an ExperimentConfig, got {type(config).__name__}")
    out: dict[str, Any] = {"config": config_to_dict(config), "config_toml": dump_config(config),
                           "env": env_record(config)}
    record = tokenizer_record(config.tokenizer.path)
    if record is not None:
        out["tokenizer"] = record
    try:
        out["model"] = json.loads(json.dumps(dataclasses.asdict(config.model.model_config())))
    except (OSError, ValueError):  # init_from not readable here: compare the model section instead
        pass
    return out


# ---- the checks ----


def check_meta(meta: Mapping[str, Any], config: ExperimentConfig, where: str) -> None:
    """Raises CheckpointMismatchError naming each field where a checkpoint's `meta` (at `where`) differs from
    `config`: the env (name and params), the tokenizer, the LoRA settings and the resolved architecture
    (dtypes and remat may differ)."""
    mine = config_meta(config)
    if "env" in meta:
        have_env, want_env = meta["env"], mine["env"]
        if not same_env(have_env, want_env):
            raise CheckpointMismatchError(
                f"{where} was trained on env {have_env.get('name')!r} but the config uses env "
                f"{want_env.get('name')!r}: use the preset it was trained with, or another checkpoint.dir / "
                "run.output_dir")
        diffs = _diff(_rules_params(have_env.get("params"), config), _rules_params(want_env.get("params"), config),
                      "env.params")
        if diffs:
            raise CheckpointMismatchError(f"{where} was trained on env {want_env.get('name')!r} with other params: "
                                          + "; ".join(diffs))
    clash = tokenizer_mismatch(meta.get("tokenizer"), mine.get("tokenizer"), where)
    if clash:
        raise CheckpointMismatchError(clash)
    have_lora, want_lora = lora_record(meta), lora_record(mine)
    if "config" in meta and have_lora != want_lora:
        raise CheckpointMismatchError(
            f"{where} was trained with {_lora_text(have_lora)} but this config asks for {_lora_text(want_lora)}: its "
            "params do not fit. Use the [lora] table it was trained with, or another checkpoint.dir / run.output_dir")
    if "model" in meta and "model" in mine:
        have = {k: v for k, v in meta["model"].items() if k not in ARCH_IGNORED}
        want = {k: v for k, v in mine["model"].items() if k not in ARCH_IGNORED}
    elif "config" in meta:
        have, want = meta["config"].get("model", {}), mine["config"].get("model", {})
    else:
        return
    diffs = _diff(have, want, "model")
    if diffs:
        raise CheckpointMismatchError(f"{where} was saved with another model: " + "; ".join(diffs))


@dataclasses.dataclass(frozen=True)
class ExperimentRecords:
    """The `checkpoint.ConfigRecords` of an `ExperimentConfig`: what a step stores of it (`config_meta`), the
    check of a config against a step (`check_meta`) and the config read back from a step."""

    def describe(self, config: ExperimentConfig) -> dict[str, Any]:
        return config_meta(config)

    def check(self, meta: Mapping[str, Any], config: ExperimentConfig, where: str) -> None:
        check_meta(meta, config, where)

    def load(self, meta: Mapping[str, Any]) -> ExperimentConfig | None:
        data = meta.get("config")
        return None if data is None else config_from_dict(data)


def run_checkpointer(directory: str | os.PathLike, **options: Any) -> Checkpointer:
    """A `Checkpointer` of a run: it stores an `ExperimentConfig` with each step and checks one against a
    step (`ExperimentRecords`). `options`: those of `Checkpointer` (keep, async_save, read_only)."""
    return Checkpointer(directory, records=ExperimentRecords(), **options)


def load_checkpoint_config(directory: str | os.PathLike, step: int | None = None) -> ExperimentConfig | None:
    """The ExperimentConfig saved with a checkpoint (latest step by default), or None if it has none."""
    with run_checkpointer(directory, read_only=True) as checkpointer:
        return checkpointer.config(step)


def check_env_record(saved: dict[str, Any] | None, config: ExperimentConfig, where: str) -> None:
    """Raises CheckpointMismatchError naming both envs when a model trained on one env is used with another."""
    if not saved:
        return
    mine = env_record(config)
    if not same_env(saved, mine):
        raise CheckpointMismatchError(
            f"{where} was trained on env {saved.get('name')!r} but the config uses env {mine['name']!r}: use the "
            f"preset it was trained with (or --set env.name={saved.get('name')}); to fine-tune it on another env on "
            f"purpose, use a copy of the folder without {ENV_FILE}")
    have, want = _rules_params(saved.get("params"), config), _rules_params(mine["params"], config)
    if saved.get("params") and have != want:
        diff = [f"env.params.{k}: {have.get(k)!r} there, {want.get(k)!r} here"
                for k in sorted(set(have) | set(want)) if have.get(k) != want.get(k)]
        raise CheckpointMismatchError(f"{where} was trained on env {mine['name']!r} with other params "
                                      f"({'; '.join(diff)}): use the preset it was trained with")


def check_hf_folder(config: ExperimentConfig, folder: str | os.PathLike, what: str | None = None) -> None:
    """A Hugging Face folder (an export, or model.init_from) must fit the config: the env it was trained on
    (`jaxrl_llm_env.json`) and its tokenizer's vocabulary (`tokenizer.json`), when it records them.
    Raises CheckpointMismatchError naming both values."""
    what = what or str(folder)
    env_file = Path(folder) / ENV_FILE
    if env_file.is_file():
        try:
            record = json.loads(env_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointDamagedError(f"{env_file} is not valid JSON ({e}): the file is damaged or cut short; "
                                         "copy or export the folder again") from None
        check_env_record(record, config, what)
    else:
        print(f"warning: {what} records no env (no {ENV_FILE}): assuming it was trained on the config's env "
              f"{config.env.name!r}; an export writes the record")
    clash = tokenizer_mismatch(tokenizer_record(folder), tokenizer_record(config.tokenizer.path), what)
    if clash:
        raise CheckpointMismatchError(clash)


def check_hf_architecture(config: ExperimentConfig, folder: str | os.PathLike) -> None:
    """The model in a Hugging Face folder's config.json must be the config's (CheckpointMismatchError naming
    each differing field with both values)."""
    saved, mine = config_from_pretrained(folder), config.model.model_config()
    if type(saved) is not type(mine):
        raise CheckpointMismatchError(f"{folder} holds a {saved.model_type} model ({saved.architecture}) but the "
                                      f"config builds a {mine.model_type} one: use the preset it was trained with")
    differ = [f"{name}: {getattr(saved, name)!r} there, {getattr(mine, name)!r} in the config"
              for name in saved.ARCH_FIELDS if getattr(saved, name) != getattr(mine, name)]
    if differ:
        raise CheckpointMismatchError(f"{folder} holds another model than the config builds ({'; '.join(differ)}): "
                                      "use the preset it was trained with")


def check_checkpoint(config: ExperimentConfig, checkpoint: str | os.PathLike) -> None:
    """`--checkpoint` must name a folder that holds a model and fits the config, checked before anything is
    built: a Hugging Face folder (its env, tokenizer and architecture) or an Orbax folder with at least one
    committed step (its env, tokenizer and model; a damaged newest step is left to the restore, which falls
    back). Raises CheckpointNotFoundError or CheckpointMismatchError naming both values."""
    folder = Path(checkpoint)
    if (folder / "config.json").is_file():
        check_hf_folder(config, folder)
        check_hf_architecture(config, folder)
        return
    if not folder.is_dir():
        raise CheckpointNotFoundError(f"--checkpoint {checkpoint}: no such folder")
    with run_checkpointer(folder, read_only=True) as ckpt:
        if ckpt.latest_step() is None:
            raise CheckpointNotFoundError(
                f"--checkpoint {checkpoint}: the folder holds no checkpoint (no committed Orbax step, no "
                f"config.json){_checkpoint_hint(folder)}")
        try:
            ckpt.check_config(config)
        except CheckpointDamagedError:
            pass


def _checkpoint_hint(folder: Path) -> str:
    """Where under `folder` a checkpoint is, for an error message (a run folder holds checkpoints/, sft/)."""
    found = [str(folder / name) for name in ("checkpoints", "sft") if (folder / name).is_dir()
             and any(p.name.isdigit() for p in (folder / name).iterdir())]
    if found:
        return f"; did you mean {' or '.join(found)}?"
    return ("; pass a folder that holds Orbax steps (<run.output_dir>/checkpoints or .../sft) or a Hugging Face "
            "folder with config.json and model.safetensors (as `jaxrl-llm export` writes)")
