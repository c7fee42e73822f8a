"""Orbax checkpoints with exact resume.

A checkpoint is one pytree `state` (whatever the training loop keeps: params, optax state, step, PRNG key,
data position such as examples consumed and stage index) plus a JSON `meta` item: what the caller's
`ConfigRecords` make of the run's config (`jaxrl_llm.compat`: the experiment config as a dict and as TOML
text, the env, tokenizer and resolved model architecture) and any extra JSON the caller passes. This module
is storage only: it imports neither the experiment schema nor the run lock (`jaxrl_llm.run_lock`).

Layout (Orbax's `CheckpointManager`): `<directory>/<step>/state/` (the arrays, PyTree handler) and
`<directory>/<step>/meta/` (JSON). A save is written to `<step>.orbax-checkpoint-tmp-*` and renamed to
`<step>` when complete, so a crash mid-save leaves only a temporary folder that is never read (and is
removed the next time a writing `Checkpointer` opens the directory). With `async_save` the arrays are
copied off the device before `save` returns and written in a background thread; `wait()` / `close()`
(or leaving the `with` block) block until the writes are committed. The last `keep` steps are kept.

Restoring for exact resume: build the target with `jax.eval_shape` of the function that created the
state (so optax's NamedTuples, dtypes and, with shardings, the layout are known) and pass it:

    abstract = jax.eval_shape(init_state, jax.random.key(0))
    with compat.run_checkpointer(cfg.checkpoint_dir(), keep=cfg.checkpoint.keep) as ckpt:
        state = ckpt.restore(target=abstract, expect_config=cfg)   # latest step

Typed PRNG keys (`jax.random.key`) are stored as their raw uint32 key data and wrapped again when the
target says the leaf is a key; raw uint32 keys (`jax.random.PRNGKey`) are stored as they are. The shapes
of the target are checked against the checkpoint (Orbax alone would silently restore the stored shape)
and a differing leaf is named; dtypes follow the target (Orbax casts).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxrl_base.errors import CheckpointError
from jaxrl_base.finite import describe_non_finite, flat_names, non_finite
from jaxrl_llm import distributed
from jaxrl_llm.orbax_noise import silence_failed_reads
from jaxrl_llm.checkpoint_trees import (_abstract, _flatten_metadata, _is_key, _keys_to_data, _path_str,
                                        _unflatten_metadata, _wrap_keys)

__all__ = [
    "Checkpointer",
    "CheckpointNotFoundError",
    "CheckpointMismatchError",
    "CheckpointDamagedError",
    "CheckpointWriteError",
    "CheckpointNonFiniteError",
    "ConfigRecords",
    "restore_params_only",
    "partial_saves",
    "FORMAT",
]

FORMAT = "jaxrl_llm.checkpoint/1"
STATE, META = "state", "meta"
TMP_MARKER = ".orbax-checkpoint-tmp"  # Orbax's suffix of a save in progress


class CheckpointNotFoundError(FileNotFoundError, CheckpointError):
    """No checkpoint directory, or no (complete) checkpoint in it, or not the step asked for."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit the target state or the expected config; the message names the field."""


class CheckpointDamagedError(CheckpointError):
    """A committed step cannot be read (a truncated or deleted file); the message names the step and file."""


class CheckpointNonFiniteError(CheckpointError):
    """A state to save holds NaN or infinite values: refused (nothing written); the message names the arrays."""


class CheckpointWriteError(OSError, CheckpointError):
    """A save failed (disk full, unwritable folder); the message names the folder and the last good step."""


# ----------------------------------------------------------------------------------------------------------
# Checking a target against a checkpoint (the pytree helpers are `jaxrl_llm.checkpoint_trees`)
# ----------------------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------------------
# What a step records of the run's config (supplied by the caller: storage knows no schema)
# ----------------------------------------------------------------------------------------------------------


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x))


class ConfigRecords(Protocol):
    """How a `Checkpointer` stores a run's config with each step and checks a config against a step. Storage
    holds no experiment schema: the experiment's records are `jaxrl_llm.compat.ExperimentRecords`."""

    def describe(self, config: Any) -> dict[str, Any]:
        """JSON to merge into a step's `meta` for `config` (e.g. {"config": ..., "model": ...})."""

    def check(self, meta: Mapping[str, Any], config: Any, where: str) -> None:
        """Raises CheckpointMismatchError (its message starting with `where`) when `config` does not fit the
        step whose `meta` this is."""

    def load(self, meta: Mapping[str, Any]) -> Any:
        """The config object recorded in a step's `meta` (None when it has none)."""


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
    only (another process may be writing it: its temporary folders are left alone). records: how a config
    passed to `save` is stored and checked (`ConfigRecords`; a run's: `compat.run_checkpointer`); without
    records a config is a plain JSON mapping and `check_config` is refused.
    """

    def __init__(self, directory: str | os.PathLike, keep: int | None = 3, async_save: bool = True,
                 read_only: bool = False, records: ConfigRecords | None = None):
        self.directory = Path(directory).expanduser().absolute()
        self.records = records
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
        if not read_only and self.directory.is_dir() and distributed.is_writer():  # multi-host: process 0 alone
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
        # Only a filesystem error is the disk's: any other cause (e.g. an array Orbax cannot write) is named as is.
        fix = ("Free disk space or make the folder writable" if errno_ or isinstance(error, OSError) else
               "The cause is the state itself, not the disk or the folder")
        return CheckpointWriteError(errno_ or 0, f"could not write {what} to {str(self.directory)!r}"
                                    f"{f' ({cause})' if cause else ''}: {type(error).__name__}: {text}. {fix}; "
                                    f"{kept}", str(self.directory))

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
        bad = non_finite(flat_names(state))
        if bad:  # a checkpoint with broken weights would be resumed, evaluated or exported as if it were good
            raise CheckpointNonFiniteError(
                f"refusing to save step {step} to {str(self.directory)!r}: {len(bad)} array(s) hold NaN or infinite "
                f"values ({describe_non_finite(bad)}); the checkpoints already there are kept")
        meta = {"format": FORMAT, "step": int(step), "metadata": _jsonable(dict(metadata or {})),
                **self._config_meta(config)}
        state = distributed.replicated(_keys_to_data(state))  # multi-host: every leaf a global array (a joint save)
        args = ocp.args.Composite(**{STATE: ocp.args.PyTreeSave(state), META: ocp.args.JsonSave(meta)})
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

    def _config_meta(self, config: Any) -> dict[str, Any]:
        """What `meta` stores of `config`: the records' description, or a plain mapping as {"config": ...}."""
        if config is None:
            return {}
        if self.records is not None:
            return self.records.describe(config)
        if isinstance(config, Mapping):
            return {"config": _jsonable(dict(config))}
        raise TypeError(f"config must be a JSON-able mapping, got {type(config).__name__}; a run's config needs "
                        "records that describe it (`jaxrl_llm.compat.run_checkpointer`)")

    def config(self, step: int | None = None) -> Any:
        """The config stored with a step: the records' config object (an ExperimentConfig with
        `compat.ExperimentRecords`), or the stored JSON without records; None when it was saved without one."""
        meta = self.metadata(step)
        return meta.get("config") if self.records is None else self.records.load(meta)

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
        """Raises CheckpointMismatchError naming each field where the step's stored config differs from
        `expected` (the records' check; `compat.check_meta` for an ExperimentConfig: env, tokenizer, LoRA and
        the resolved architecture)."""
        if self.records is None:
            raise TypeError(f"Checkpointer({str(self.directory)!r}) has no config records to check a config with; "
                            "open it with records (`jaxrl_llm.compat.run_checkpointer`)")
        meta = self.metadata(step)
        self.records.check(meta, expected, f"checkpoint {str(self.directory)!r} step {meta.get('step')}")

    def restore(self, step: int | None = None, target: Any = None, expect_config: Any = None) -> Any:
        """Restores a step's state (latest by default).

        target: a pytree of ShapeDtypeStructs (from `jax.eval_shape`, optionally with shardings) or arrays
        giving the structure, shapes, dtypes and placement; the result has exactly that structure (optax
        NamedTuples included) and those dtypes, PRNG-key leaves wrapped again. Without a target the state
        comes back as Orbax stores it: nested dicts / lists of arrays on the first device, keys as raw
        uint32 data. expect_config: check it against the stored config first (`check_config`).
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
            restored = self._manager.restore(step, args=ocp.args.Composite(**{STATE: args}))[STATE]
        except Exception as e:  # a truncated or deleted array file (tensorstore: OUT_OF_RANGE, NOT_FOUND, ...)
            silence_failed_reads()  # Orbax's abandoned reads would bury the warning under their tracebacks
            raise self._damaged(step, "reading its arrays failed", e) from None
        bad = non_finite(flat_names(restored))
        if bad:  # sound files, broken values: never evaluate, export or train on them
            raise self._damaged(step, f"{len(bad)} array(s) hold NaN or infinite values: {describe_non_finite(bad)}")
        return restored

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
                error = None
            except CheckpointDamagedError as e:
                error = e
            if not distributed.all_true(error is None):  # multi-host: every process resumes from the same step
                damaged.append((step, error or self._damaged(step, "another process of the run could not read it")))
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
        if distributed.is_writer():  # multi-host: process 0 renames, the others wait for it
            os.rename(source, dest)
        distributed.all_true(True)
        self._manager.reload()
        return dest


def restore_params_only(directory: str | os.PathLike, step: int | None = None, target: Any = None,
                        name: str = "params") -> Any:
    """The params of a checkpoint (latest step by default), without the optimizer state or model code.

    For another process (evaluation, export) that has only Orbax and the config: it opens the directory
    read-only (a trainer may still be writing it), reads `state["params"]` alone and returns it as nested
    dicts of arrays on the first device, or with `target`'s structure, dtypes and shardings. The config
    the params belong to is `compat.load_checkpoint_config(directory, step)`. With Orbax alone the same is:

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
