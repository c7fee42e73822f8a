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
import json
import os
import shutil
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


def _config_meta(config: Any) -> dict[str, Any]:
    """What `meta` stores of a config: the dict, the TOML text and the resolved architecture."""
    from jaxrl_llm.config import ExperimentConfig, config_to_dict, dump_config

    if config is None:
        return {}
    if isinstance(config, ExperimentConfig):
        out: dict[str, Any] = {"config": config_to_dict(config), "config_toml": dump_config(config),
                               "env": {"name": config.env.name, "params": config_to_dict(config.env.params)
                                       if config.env.params is not None else {}}}
        try:
            out["model"] = _jsonable(dataclasses.asdict(config.model.lfm2_config()))
        except (OSError, ValueError):  # init_from not readable here: compare the model section instead
            pass
        return out
    if isinstance(config, Mapping):
        return {"config": _jsonable(dict(config))}
    raise TypeError(f"config must be an ExperimentConfig or a JSON-able mapping, got {type(config).__name__}")


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
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else keep,
            save_interval_steps=0 if read_only else 1,
            enable_async_checkpointing=async_save and not read_only,
            create=not read_only,
            read_only=read_only,
            cleanup_tmp_directories=not read_only,
        )
        if not read_only and self.directory.is_dir():
            _remove_partial_saves(self.directory)
        handlers = {STATE: ocp.PyTreeCheckpointHandler(), META: ocp.JsonCheckpointHandler()}
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=(STATE, META),
                                              item_handlers=handlers)
        self._closed = False

    # ---- context manager ----
    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait(self) -> None:
        """Blocks until every pending (asynchronous) save is committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves, then releases the manager (idempotent)."""
        if not self._closed:
            self._manager.wait_until_finished()
            self._manager.close()
            self._closed = True

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
        meta = {"format": FORMAT, "step": int(step), "metadata": _jsonable(dict(metadata or {})),
                **_config_meta(config)}
        args = ocp.args.Composite(**{STATE: ocp.args.PyTreeSave(_keys_to_data(state)), META: ocp.args.JsonSave(meta)})
        return bool(self._manager.save(int(step), args=args, force=force))

    # ---- restore ----
    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The `meta` JSON of a step (latest by default): format, step, metadata, config, config_toml, model."""
        step = self._step(step)
        restored = self._manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))
        return restored[META] or {}

    def config(self, step: int | None = None):
        """The ExperimentConfig stored with a step (None when it was saved without one)."""
        from jaxrl_llm.config import config_from_dict

        data = self.metadata(step).get("config")
        return None if data is None else config_from_dict(data)

    def _stored_leaves(self, step: int) -> tuple[Any, dict[str, Any]]:
        tree = self._manager.item_metadata(step)[STATE]
        tree = getattr(tree, "tree", tree)
        return tree, _flatten_metadata(tree)

    def check_config(self, expected: Any, step: int | None = None) -> None:
        """Raises CheckpointMismatchError naming each field where the stored config differs from `expected`
        (an ExperimentConfig): the env (name and params) and the resolved architecture (dtypes and remat
        may differ)."""
        meta = self.metadata(step)
        mine = _config_meta(expected)
        if "env" in meta and "env" in mine:
            have_env, want_env = meta["env"], mine["env"]
            if have_env.get("name") != want_env.get("name"):
                raise CheckpointMismatchError(
                    f"checkpoint {str(self.directory)!r} step {meta.get('step')} was trained on env "
                    f"{have_env.get('name')!r} but the config uses env {want_env.get('name')!r}: use the preset it "
                    "was trained with, or another checkpoint.dir / run.output_dir")
            diffs = _diff(have_env.get("params", {}), want_env.get("params", {}), "env.params")
            if diffs:
                raise CheckpointMismatchError(
                    f"checkpoint {str(self.directory)!r} step {meta.get('step')} was trained on env "
                    f"{want_env.get('name')!r} with other params: " + "; ".join(diffs))
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
        return self._manager.restore(step, args=ocp.args.Composite(**{STATE: args}))[STATE]

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
