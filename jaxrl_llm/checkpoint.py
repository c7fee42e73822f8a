"""Orbax checkpoints with exact resume.

A checkpoint is one pytree `state` (whatever the training loop keeps: params, optax state, step, PRNG key,
data position such as examples consumed and stage index) plus a JSON `meta` item: the experiment config
(as a dict and as TOML text), the resolved model architecture and any extra JSON the caller passes.

Layout (Orbax's `CheckpointManager`): `<directory>/<step>/state/` (the arrays, PyTree handler) and
`<directory>/<step>/meta/` (JSON). A save is written to `<step>.orbax-checkpoint-tmp-*` and renamed to
`<step>` when complete, so a crash mid-save leaves only a temporary folder that is never read (and is
removed the next time a writing `Checkpointer` opens the directory). With `async_save` the arrays are
copied off the device before `save` returns and written in a background thread; `wait()` / `close()`
(or leaving the `with` block) block until the writes are committed. The last `keep` steps are kept.

Restoring for exact resume: build the target with `jax.eval_shape` of the function that created the
state (so optax's NamedTuples, dtypes and, with shardings, the layout are known) and pass it:

    abstract = jax.eval_shape(init_state, jax.random.key(0))
    with Checkpointer(cfg.checkpoint_dir(), keep=cfg.checkpoint.keep) as ckpt:
        state = ckpt.restore(target=abstract, expect_config=cfg)   # latest step

Typed PRNG keys (`jax.random.key`) are stored as their raw uint32 key data and wrapped again when the
target says the leaf is a key; raw uint32 keys (`jax.random.PRNGKey`) are stored as they are. The shapes
of the target are checked against the checkpoint (Orbax alone would silently restore the stored shape)
and a differing leaf is named; dtypes follow the target (Orbax casts).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

__all__ = [
    "Checkpointer",
    "CheckpointNotFoundError",
    "CheckpointMismatchError",
    "CheckpointDamagedError",
    "CheckpointWriteError",
    "RunLock",
    "RunLockedError",
    "RunExistsError",
    "tokenizer_record",
    "restore_params_only",
    "load_checkpoint_config",
    "partial_saves",
    "FORMAT",
]

FORMAT = "jaxrl_llm.checkpoint/1"
STATE, META = "state", "meta"
TMP_MARKER = ".orbax-checkpoint-tmp"  # Orbax's suffix of a save in progress
# Architecture fields that do not change the stored arrays' shapes (a checkpoint restores across them).
_ARCH_IGNORED = ("dtype", "param_dtype", "remat", "attention_row_block")


class CheckpointNotFoundError(FileNotFoundError):
    """No checkpoint directory, or no (complete) checkpoint in it, or not the step asked for."""


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit the target state or the expected config; the message names the field."""


class CheckpointDamagedError(ValueError):
    """A committed step cannot be read (a truncated or deleted file); the message names the step and file."""


class CheckpointWriteError(OSError):
    """A save failed (disk full, unwritable folder); the message names the folder and the last good step."""


class RunLockedError(RuntimeError):
    """Another live process holds the output folder's lock (one trainer per folder)."""


class RunExistsError(FileExistsError):
    """checkpoint.resume = false on a folder that already holds a run: refused, nothing is truncated."""


# ----------------------------------------------------------------------------------------------------------
# Pytree helpers: paths, keys, abstract targets
# ----------------------------------------------------------------------------------------------------------


def _key_str(entry: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def _path_str(path: tuple) -> str:
    return "/".join(_key_str(e) for e in path)


def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _keys_to_data(tree: Any) -> Any:
    """Typed PRNG key leaves -> their raw uint32 key data."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    """An array or ShapeDtypeStruct -> ShapeDtypeStruct (key leaves as their uint32 data)."""
    if _is_key(x):
        return jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, jax.sharding.Sharding):
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)


def _flatten_metadata(tree: Any, prefix: tuple[str, ...] = ()) -> dict[str, Any]:
    """Orbax's metadata tree (nested dicts / lists, None for empty nodes) -> {"a/0/b": ArrayMetadata}."""
    if tree is None:
        return {}
    if isinstance(tree, Mapping):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        return {"/".join(prefix): tree}
    out: dict[str, Any] = {}
    for k, v in items:
        out.update(_flatten_metadata(v, (*prefix, str(k))))
    return out


def _unflatten_metadata(tree: Any) -> Any:
    """Orbax's metadata tree -> the same tree of ShapeDtypeStructs on the first device (None nodes kept)."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    if tree is None:
        return None
    if isinstance(tree, Mapping):
        return {k: _unflatten_metadata(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_unflatten_metadata(v) for v in tree]
    return jax.ShapeDtypeStruct(tuple(tree.shape), tree.dtype, sharding=device)


def _check_against(stored: dict[str, Any], target: Any, partial: bool, where: str) -> None:
    """Raises CheckpointMismatchError naming the first leaves whose path or shape differ."""
    leaves = {_path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(target)[0]}
    missing = [p for p in leaves if p not in stored]
    if missing:
        raise CheckpointMismatchError(
            f"{where}: the checkpoint has no {', '.join(map(repr, missing[:5]))}"
            f"{' ...' if len(missing) > 5 else ''} that the target has (different structure, e.g. another "
            f"model or optimizer); it has {', '.join(map(repr, list(stored)[:5]))}{' ...' if len(stored) > 5 else ''}")
    if not partial:
        extra = [p for p in stored if p not in leaves]
        if extra:
            raise CheckpointMismatchError(
                f"{where}: the checkpoint has {', '.join(map(repr, extra[:5]))}{' ...' if len(extra) > 5 else ''}"
                " that the target lacks (different structure, e.g. another model or optimizer)")
    differ = []
    for path, x in leaves.items():
        want = tuple(jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype)).shape
                     if _is_key(x) else np.shape(x))
        have = tuple(stored[path].shape)
        if want != have:
            differ.append(f"{path!r} has shape {have} in the checkpoint but {want} in the target")
    if differ:
        differ.sort(key=lambda d: not d.startswith("'params"))  # the params first: they name the model's change
        more = f" (and {len(differ) - 3} more)" if len(differ) > 3 else ""
        raise CheckpointMismatchError(f"{where}: " + "; ".join(differ[:3]) + more + " (a different model shape?)")


def _wrap_keys(restored: Any, target: Any) -> Any:
    """Key-typed target leaves: wrap the restored uint32 data as keys of the same implementation."""
    def wrap(t, r):
        if _is_key(t):
            impl = jax.random.key_impl(t) if isinstance(t, jax.Array) else t.dtype._impl
            return jax.random.wrap_key_data(r, impl=impl)
        return r

    return jax.tree.map(wrap, target, restored)


# ----------------------------------------------------------------------------------------------------------
# Config metadata
# ----------------------------------------------------------------------------------------------------------


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x))


def env_record(config: Any) -> dict[str, Any]:
    """The env a model is trained on, as JSON: {"name" (as the config gives it: a registered name, an entry
    point or a class path), "class" ("module:Class", so the env is found again by any of its names), "params"}.
    Checkpoints and exports carry it."""
    from jaxrl_llm.config import config_to_dict

    record = {"name": config.env.name}
    try:
        from envs.core import class_path

        record["class"] = class_path(config.env.env_class())
    except Exception:  # noqa: BLE001 - a record without the class is still a record
        pass
    record["params"] = config_to_dict(config.env.params) if config.env.params is not None else {}
    return record


def same_env(saved: dict[str, Any], mine: dict[str, Any]) -> bool:
    """Whether a saved env record names the env of `mine` (this config's record): the same name, or the saved
    name (an entry point or a class path) resolves here to this config's class. A saved name that does not
    resolve here is another env."""
    if saved.get("name") == mine.get("name"):
        return True
    try:
        from envs.core import class_path, env_class

        return bool(mine.get("class")) and class_path(env_class(saved.get("name"))) == mine["class"]
    except Exception:  # noqa: BLE001 - unknown or unimportable: not this env
        return False


def _config_meta(config: Any) -> dict[str, Any]:
    """What `meta` stores of a config: the dict, the TOML text and the resolved architecture."""
    from jaxrl_llm.config import ExperimentConfig, config_to_dict, dump_config

    if config is None:
        return {}
    if isinstance(config, ExperimentConfig):
        out: dict[str, Any] = {"config": config_to_dict(config), "config_toml": dump_config(config),
                               "env": env_record(config)}
        record = tokenizer_record(config.tokenizer.path)
        if record is not None:
            out["tokenizer"] = record
        try:
            out["model"] = _jsonable(dataclasses.asdict(config.model.lfm2_config()))
        except (OSError, ValueError):  # init_from not readable here: compare the model section instead
            pass
        return out
    if isinstance(config, Mapping):
        return {"config": _jsonable(dict(config))}
    raise TypeError(f"config must be an ExperimentConfig or a JSON-able mapping, got {type(config).__name__}")


_TOKENIZER_RECORDS: dict[tuple[str, float], dict[str, Any] | None] = {}


def tokenizer_record(path: str | os.PathLike | None) -> dict[str, Any] | None:
    """What identifies a tokenizer's vocabulary, from its folder's `tokenizer.json` (None: the project's
    tokenizer): {"size": distinct ids, "sha256": of the token -> id map and the added tokens, "source"}.
    None when the folder has no tokenizer.json (nothing to compare). Checkpoints and exports carry it."""
    from jaxrl_llm.text.tokenizer import ASSET_DIR

    folder = Path(ASSET_DIR if path is None else path)
    file = folder / "tokenizer.json"
    if not file.is_file():
        return None
    key = (str(file.resolve()), file.stat().st_mtime)
    if key not in _TOKENIZER_RECORDS:
        data = json.loads(file.read_text(encoding="utf-8"))
        vocab = (data.get("model") or {}).get("vocab") or {}
        if isinstance(vocab, list):  # unigram models: [[piece, score], ...]
            vocab = {piece[0]: i for i, piece in enumerate(vocab)}
        added = sorted((int(t["id"]), str(t["content"])) for t in data.get("added_tokens") or ())
        ids = set(vocab.values()) | {i for i, _ in added}
        digest = hashlib.sha256(json.dumps([sorted(vocab.items()), added], ensure_ascii=False).encode()).hexdigest()
        _TOKENIZER_RECORDS[key] = {"size": len(ids), "sha256": digest}
    record = dict(_TOKENIZER_RECORDS[key])
    record["source"] = "the project's tokenizer" if path is None else str(path)
    return record


def tokenizer_mismatch(have: dict[str, Any] | None, want: dict[str, Any] | None, where: str) -> str | None:
    """A sentence naming both tokenizers when two records differ (None when they agree or one is unknown)."""
    if not have or not want or (have.get("size"), have.get("sha256")) == (want.get("size"), want.get("sha256")):
        return None
    def name(r):
        return f"{r.get('size')} tokens ({r.get('source', '?')}, vocabulary sha256 {str(r.get('sha256'))[:12]})"
    return (f"{where} was trained with a tokenizer of {name(have)} but this config's tokenizer has {name(want)}: "
            "token ids would mean other text; set tokenizer.path to the tokenizer it was trained with")


def _lora_record(meta: Mapping[str, Any]) -> dict[str, Any]:
    """What makes a checkpoint's params LoRA adapters of a kind: {"rank"} (0: the whole model) and, for
    adapters, "alpha" and the targeted projections (dropout does not matter). Older checkpoints: rank 0."""
    from models.lora import LoraConfig

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


# ----------------------------------------------------------------------------------------------------------
# Checkpointer
# ----------------------------------------------------------------------------------------------------------


def partial_saves(directory: str | os.PathLike) -> list[Path]:
    """The temporary folders of saves that were never committed (a crash mid-save), e.g. `2.orbax-checkpoint-tmp-*`."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_dir() and TMP_MARKER in p.name)


def _remove_partial_saves(directory: Path) -> None:
    for path in partial_saves(directory):
        shutil.rmtree(path, ignore_errors=True)


class Checkpointer:
    """Saves and restores one training state per step in `directory` (Orbax CheckpointManager).

    keep: the last N steps are kept (None keeps all). async_save: write in the background (call `wait`,
    `close` or use `with` before the process exits). read_only: open an existing directory to restore
    only (another process may be writing it: its temporary folders are left alone).
    """

    def __init__(self, directory: str | os.PathLike, keep: int | None = 3, async_save: bool = True,
                 read_only: bool = False):
        self.directory = Path(directory).expanduser().absolute()
        if read_only and not self.directory.is_dir():
            raise CheckpointNotFoundError(f"checkpoint directory {str(self.directory)!r} does not exist")
        if self.directory.exists() and not self.directory.is_dir():
            raise NotADirectoryError(f"checkpoint directory {str(self.directory)!r} is a file")
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be >= 1 or None (got {keep})")
        # Orbax's own read_only option is not used: it only makes the manager skip saves and deletes, which
        # a reader never asks for (`save` refuses below), and it logs "Given directory is read only" each
        # time a manager opens. A reader creates nothing, keeps every step and leaves temporary folders.
        self.read_only = read_only
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else keep,
            enable_async_checkpointing=async_save and not read_only,
            create=not read_only,
            cleanup_tmp_directories=not read_only,
        )
        if not read_only and self.directory.is_dir():
            _remove_partial_saves(self.directory)
        handlers = {STATE: ocp.PyTreeCheckpointHandler(), META: ocp.JsonCheckpointHandler()}
        try:
            self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=(STATE, META),
                                                  item_handlers=handlers)
        except OSError as e:  # e.g. an unwritable parent folder: name the folder
            raise CheckpointWriteError(e.errno, f"cannot create the checkpoint directory {str(self.directory)!r}: "
                                       f"{e.strerror or e}", str(self.directory)) from None
        self._closed = False
        self._pending: int | None = None  # the step of an asynchronous save not yet known to be committed
        self._write_failed = False

    # ---- context manager ----
    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait(self) -> None:
        """Blocks until every pending (asynchronous) save is committed; a failed write raises
        CheckpointWriteError naming the folder, the step and the last committed step."""
        try:
            self._manager.wait_until_finished()
        except Exception as e:  # an asynchronous write failed (disk full, folder made unwritable, ...)
            raise self._write_error(self._pending, e) from None
        self._pending = None

    def close(self) -> None:
        """Waits for pending saves, then releases the manager (idempotent). After a failed write that was
        already reported, closing does not raise it again."""
        if not self._closed:
            self._closed = True
            try:
                self.wait()
            except CheckpointWriteError:
                if not self._write_failed:
                    raise
            finally:
                try:
                    self._manager.close()
                except Exception:
                    if not self._write_failed:
                        raise

    def _write_error(self, step: int | None, error: BaseException) -> CheckpointWriteError:
        """A failed save as one readable error: the folder, the step, the cause, the step that survives."""
        self._write_failed = True
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        code = re.search(r"os_error_code='(\d+)'", str(error))
        errno_ = getattr(error, "errno", None) or (int(code.group(1)) if code else None)
        cause = os.strerror(errno_) if errno_ else None
        if len(text) > 400:
            text = text[:400] + " ..."
        try:
            self._manager.reload()
            good = self._manager.latest_step()
        except Exception:
            good = None
        kept = (f"the last committed checkpoint, step {good}, is kept: after fixing the cause, run the same "
                f"command again to resume from it" if good is not None else "no earlier checkpoint exists here")
        what = f"step {step}" if step is not None else "a checkpoint"
        return CheckpointWriteError(errno_ or 0, f"could not write {what} to {str(self.directory)!r}"
                                    f"{f' ({cause})' if cause else ''}: {type(error).__name__}: {text}. Free disk "
                                    f"space or make the folder writable; {kept}", str(self.directory))

    # ---- steps ----
    def all_steps(self) -> list[int]:
        """Committed steps, ascending (partial saves are never listed)."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The last committed step, None when there is none."""
        return self._manager.latest_step()

    def _step(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise CheckpointNotFoundError(f"no checkpoint found in {str(self.directory)!r}")
            return steps[-1]
        if step not in steps:
            raise CheckpointNotFoundError(
                f"no checkpoint for step {step} in {str(self.directory)!r}; steps there: {steps or 'none'}")
        return step

    # ---- save ----
    def save(self, step: int, state: Any, config: Any = None, metadata: Mapping[str, Any] | None = None,
             force: bool = True) -> bool:
        """Saves pytree `state` as step `step` (with the config and extra JSON `metadata` in `meta`).

        Returns whether a save was started (Orbax may skip one it considers not due when force=False).
        Asynchronous unless the Checkpointer was made with async_save=False. A step that is already
        committed raises Orbax's StepAlreadyExistsError.
        """
        if self.read_only:
            raise ValueError(f"Checkpointer({str(self.directory)!r}) was opened read_only: it does not save")
        meta = {"format": FORMAT, "step": int(step), "metadata": _jsonable(dict(metadata or {})),
                **_config_meta(config)}
        args = ocp.args.Composite(**{STATE: ocp.args.PyTreeSave(_keys_to_data(state)), META: ocp.args.JsonSave(meta)})
        try:
            started = bool(self._manager.save(int(step), args=args, force=force))
        except ocp.checkpoint_manager.StepAlreadyExistsError:
            raise
        except Exception as e:  # this save failed, or the previous asynchronous one did (reported here)
            raise self._write_error(self._pending if self._pending is not None else int(step), e) from None
        self._pending = int(step) if started else self._pending
        return started

    # ---- restore ----
    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The `meta` JSON of a step (latest by default): format, step, metadata, config, config_toml, model."""
        step = self._step(step)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))
        except Exception as e:
            raise self._damaged(step, "its meta item (the config JSON) cannot be read", e) from None
        meta = restored[META]
        if not isinstance(meta, Mapping) or not meta:
            raise self._damaged(step, "its meta item (the config JSON) is empty")
        return dict(meta)

    def _damaged(self, step: int, what: str, error: BaseException | None = None) -> CheckpointDamagedError:
        detail = ""
        if error is not None:
            text = str(error).strip().splitlines()[0] if str(error).strip() else ""
            detail = f" ({type(error).__name__}: {text[:300]}{' ...' if len(text) > 300 else ''})"
        return CheckpointDamagedError(f"checkpoint step {step} in {str(self.directory)!r} is damaged: {what}{detail}")

    def config(self, step: int | None = None):
        """The ExperimentConfig stored with a step (None when it was saved without one)."""
        from jaxrl_llm.config import config_from_dict

        data = self.metadata(step).get("config")
        return None if data is None else config_from_dict(data)

    def _stored_leaves(self, step: int) -> tuple[Any, dict[str, Any]]:
        index = self.directory / str(step) / STATE / "_METADATA"
        try:
            tree = self._manager.item_metadata(step)[STATE]
        except Exception as e:
            raise self._damaged(step, "the index of its arrays (state/_METADATA) cannot be read", e) from None
        tree = getattr(tree, "tree", tree)
        flat = _flatten_metadata(tree)
        if not flat:  # Orbax reads a missing index as "no arrays": that is damage, not another model
            missing = "is missing" if not index.exists() else "lists no arrays"
            raise self._damaged(step, f"the index of its arrays, {str(index)!r}, {missing}")
        return tree, flat

    def check_config(self, expected: Any, step: int | None = None) -> None:
        """Raises CheckpointMismatchError naming each field where the stored config differs from `expected`
        (an ExperimentConfig): the env (name and params) and the resolved architecture (dtypes and remat
        may differ)."""
        meta = self.metadata(step)
        mine = _config_meta(expected)
        if "env" in meta and "env" in mine:
            have_env, want_env = meta["env"], mine["env"]
            if not same_env(have_env, want_env):
                raise CheckpointMismatchError(
                    f"checkpoint {str(self.directory)!r} step {meta.get('step')} was trained on env "
                    f"{have_env.get('name')!r} but the config uses env {want_env.get('name')!r}: use the preset it "
                    "was trained with, or another checkpoint.dir / run.output_dir")
            diffs = _diff(have_env.get("params", {}), want_env.get("params", {}), "env.params")
            if diffs:
                raise CheckpointMismatchError(
                    f"checkpoint {str(self.directory)!r} step {meta.get('step')} was trained on env "
                    f"{want_env.get('name')!r} with other params: " + "; ".join(diffs))
        clash = tokenizer_mismatch(meta.get("tokenizer"), mine.get("tokenizer"),
                                   f"checkpoint {str(self.directory)!r} step {meta.get('step')}")
        if clash:
            raise CheckpointMismatchError(clash)
        have_lora, want_lora = _lora_record(meta), _lora_record(mine)
        if "config" in meta and "config" in mine and have_lora != want_lora:
            raise CheckpointMismatchError(
                f"checkpoint {str(self.directory)!r} step {meta.get('step')} was trained with "
                f"{_lora_text(have_lora)} but this config asks for {_lora_text(want_lora)}: its params do not fit. "
                "Use the [lora] table it was trained with, or another checkpoint.dir / run.output_dir")
        if "model" in meta and "model" in mine:
            have = {k: v for k, v in meta["model"].items() if k not in _ARCH_IGNORED}
            want = {k: v for k, v in mine["model"].items() if k not in _ARCH_IGNORED}
        elif "config" in meta and "config" in mine:
            have, want = meta["config"].get("model", {}), mine["config"].get("model", {})
        else:
            return
        diffs = _diff(have, want, "model")
        if diffs:
            raise CheckpointMismatchError(
                f"checkpoint {str(self.directory)!r} step {meta.get('step')} was saved with another model: "
                + "; ".join(diffs))

    def restore(self, step: int | None = None, target: Any = None, expect_config: Any = None) -> Any:
        """Restores a step's state (latest by default).

        target: a pytree of ShapeDtypeStructs (from `jax.eval_shape`, optionally with shardings) or arrays
        giving the structure, shapes, dtypes and placement; the result has exactly that structure (optax
        NamedTuples included) and those dtypes, PRNG-key leaves wrapped again. Without a target the state
        comes back as Orbax stores it: nested dicts / lists of arrays on the first device, keys as raw
        uint32 data. expect_config: check the stored model against this ExperimentConfig first.
        """
        step = self._step(step)
        if expect_config is not None:
            self.check_config(expect_config, step)
        tree, stored = self._stored_leaves(step)
        if target is None:
            abstract = _unflatten_metadata(tree)
        else:
            _check_against(stored, target, partial=False, where=f"step {step}")
            abstract = jax.tree.map(_abstract, target)
        restored = self._restore_state(step, abstract, partial=False)
        return restored if target is None else _wrap_keys(restored, target)

    def _restore_state(self, step: int, abstract: Any, partial: bool) -> Any:
        restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
        args = ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args, partial_restore=partial)
        try:
            return self._manager.restore(step, args=ocp.args.Composite(**{STATE: args}))[STATE]
        except Exception as e:  # a truncated or deleted array file (tensorstore: OUT_OF_RANGE, NOT_FOUND, ...)
            raise self._damaged(step, "reading its arrays failed", e) from None

    def restore_subtree(self, name: str = "params", step: int | None = None, target: Any = None) -> Any:
        """Restores only `state[name]` (e.g. the params, without reading the optimizer state)."""
        step = self._step(step)
        tree, stored = self._stored_leaves(step)
        if not isinstance(tree, Mapping) or name not in tree:
            keys = list(tree) if isinstance(tree, Mapping) else []
            raise CheckpointMismatchError(f"step {step}: the state has no {name!r} (it has {keys})")
        if target is None:
            abstract = _unflatten_metadata(tree[name])
        else:
            sub = {k[len(name) + 1:]: v for k, v in stored.items() if k.startswith(name + "/")}
            _check_against(sub, target, partial=False, where=f"step {step} {name}")
            abstract = jax.tree.map(_abstract, target)
        restored = self._restore_state(step, {name: abstract}, partial=True)[name]
        return restored if target is None else _wrap_keys(restored, target)

    # ---- damaged steps ----
    def restore_newest_good(self, target: Any = None, expect_config: Any = None, subtree: str | None = None,
                            move_aside: bool | None = None, log=print) -> tuple[int, Any]:
        """(step, state) of the newest committed step that restores whole (`restore`, or `restore_subtree`
        of `subtree`); `target` may be a function of the step (e.g. an optimizer state that depends on it).

        A damaged step (a truncated or deleted file: CheckpointDamagedError) is skipped with a warning that
        names it and the step used instead; a writer (move_aside, default: not read_only) renames it to
        `<step>.damaged` so that the resumed run can save that step again, and never touches the older
        good steps. A mismatch (another model, env or tokenizer) raises at once. No step at all:
        CheckpointNotFoundError; every step damaged: CheckpointDamagedError naming each.
        """
        move_aside = (not self.read_only) if move_aside is None else move_aside
        steps = self.all_steps()
        if not steps:
            raise CheckpointNotFoundError(f"no checkpoint found in {str(self.directory)!r}")
        damaged: list[tuple[int, CheckpointDamagedError]] = []
        for step in reversed(steps):
            try:
                if expect_config is not None:
                    self.check_config(expect_config, step)
                at = target(step) if callable(target) else target
                if subtree is None:
                    state = self.restore(step, target=at)
                else:
                    state = self.restore_subtree(subtree, step, target=at)
            except CheckpointDamagedError as e:
                damaged.append((step, e))
                continue
            for bad, error in damaged:
                where = f"; moved it to {str(self.move_aside(bad))!r}" if move_aside else ""
                log(f"warning: {error}; using step {step}, the newest good checkpoint, instead{where}")
            return step, state
        raise CheckpointDamagedError(
            f"every checkpoint in {str(self.directory)!r} is damaged: " + "; ".join(str(e) for _, e in damaged)
            + ". Nothing was changed: move the folder aside to start the run over, or restore it from a copy")

    def move_aside(self, step: int) -> Path:
        """Renames committed step `step` to `<step>.damaged` (or `.damaged-2`, ...), out of Orbax's sight."""
        if self.read_only:
            raise ValueError(f"Checkpointer({str(self.directory)!r}) was opened read_only: it moves nothing")
        source = self.directory / str(step)
        dest, n = self.directory / f"{step}.damaged", 1
        while dest.exists():
            n += 1
            dest = self.directory / f"{step}.damaged-{n}"
        os.rename(source, dest)
        self._manager.reload()
        return dest


def restore_params_only(directory: str | os.PathLike, step: int | None = None, target: Any = None,
                        name: str = "params") -> Any:
    """The params of a checkpoint (latest step by default), without the optimizer state or model code.

    For another process (evaluation, export) that has only Orbax and the config: it opens the directory
    read-only (a trainer may still be writing it), reads `state["params"]` alone and returns it as nested
    dicts of arrays on the first device, or with `target`'s structure, dtypes and shardings. The config
    the params belong to is `load_checkpoint_config(directory, step)`. With Orbax alone the same is:

        mngr = ocp.CheckpointManager(directory, item_names=("state", "meta"),
                                     item_handlers={"state": ocp.PyTreeCheckpointHandler()})
        abstract = {"params": <tree of jax.ShapeDtypeStruct>}
        mngr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
            partial_restore=True)))["state"]["params"]
    """
    checkpointer = Checkpointer(directory, read_only=True)
    try:
        return checkpointer.restore_subtree(name, step, target)
    finally:
        checkpointer.close()


def load_checkpoint_config(directory: str | os.PathLike, step: int | None = None):
    """The ExperimentConfig saved with a checkpoint (latest step by default), or None if it has none."""
    checkpointer = Checkpointer(directory, read_only=True)
    try:
        return checkpointer.config(step)
    finally:
        checkpointer.close()


# ----------------------------------------------------------------------------------------------------------
# One trainer per output folder
# ----------------------------------------------------------------------------------------------------------

LOCK_FILE = "jaxrl_llm.lock"
_HELD: dict[str, int] = {}  # lock files this process holds -> nesting depth (experiment -> sft -> train)


def _process_start(pid: int) -> str | None:
    """The start time of process `pid` (Linux: /proc/<pid>/stat field 22), to tell a reused PID apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None


def _alive(pid: int, start: str | None) -> bool:
    """Whether process `pid` (started at `start`, when recorded) still runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
        if state in ("Z", "X"):  # a zombie: dead, not yet reaped
            return False
    except OSError:
        pass
    now = _process_start(pid)
    return start is None or now is None or now == start  # a different start time: the PID was reused


class RunLock:
    """One trainer per output folder: `<folder>/jaxrl_llm.lock` holds the owner's PID, host and start time.

        with RunLock(config.run.output_dir):
            ...   # train: checkpoints, metrics

    A second process that asks for the lock while the owner runs gets RunLockedError naming the PID, host
    and since when, instead of interleaving checkpoints and metrics. A lock left by a process that died
    (SIGKILL, power loss) on this host is stale: it is taken over with a warning. A lock from another host
    cannot be checked from here: the error says which file to delete once no trainer runs there. The same
    process may nest locks on one folder (the experiment command runs SFT and GRPO under one lock).
    """

    def __init__(self, folder: str | os.PathLike, log=print):
        self.folder = Path(folder).expanduser().absolute()
        self.path = self.folder / LOCK_FILE
        self.log = log

    def _mine(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "host": socket.gethostname(), "pid_start": _process_start(os.getpid()),
                "since": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)[:500]}

    def acquire(self) -> RunLock:
        key = str(self.path)
        if _HELD.get(key):
            _HELD[key] += 1
            return self
        self.folder.mkdir(parents=True, exist_ok=True)
        for _ in range(10):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self._mine(), f)
            _HELD[key] = 1
            return self
        raise RunLockedError(f"could not take the lock {key!r} (it keeps changing hands)")

    def _take_over_if_stale(self) -> None:
        """Raises RunLockedError unless the lock file belongs to no live process; a stale one is removed."""
        try:
            owner = json.loads(self.path.read_text())
            pid, host = int(owner["pid"]), str(owner["host"])
        except FileNotFoundError:
            return  # released meanwhile: try again
        except (OSError, ValueError, KeyError, TypeError):
            owner, pid, host = {}, None, None
        if pid is not None:
            since = f" since {owner.get('since')}" if owner.get("since") else ""
            command = f" ({owner['command']})" if owner.get("command") else ""
            if host != socket.gethostname():
                raise RunLockedError(
                    f"{str(self.folder)!r} is in use by PID {pid} on host {host!r}{since}{command}: one trainer per "
                    f"output folder. If no trainer runs there any more, delete {str(self.path)!r}; or use another "
                    "run.output_dir")
            if pid == os.getpid() or _alive(pid, owner.get("pid_start")):
                if pid == os.getpid():  # a lock of this very process that was not released: take it back
                    self.path.unlink(missing_ok=True)
                    return
                raise RunLockedError(
                    f"{str(self.folder)!r} is in use by PID {pid} on this host ({host}){since}{command}: one trainer "
                    "per output folder. Wait for it to finish or stop it, or use another run.output_dir")
            what = f"PID {pid} on host {host}{since}, which no longer runs"
        else:
            what = "an unreadable lock file"
        stale = self.path.with_name(f"{LOCK_FILE}.stale-{os.getpid()}")
        try:
            os.rename(self.path, stale)  # atomic: of two processes taking over, one wins
        except FileNotFoundError:
            return
        stale.unlink(missing_ok=True)
        self.log(f"warning: removed the stale lock {str(self.path)!r} of {what}")

    def release(self) -> None:
        key = str(self.path)
        if not _HELD.get(key):
            return
        _HELD[key] -= 1
        if _HELD[key] == 0:
            del _HELD[key]
            try:
                owner = json.loads(self.path.read_text())
                if int(owner.get("pid", -1)) == os.getpid():
                    self.path.unlink()
            except (OSError, ValueError):
                pass

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
