"""One training loop for SFT and GRPO: the `TrainState` a run carries, its logs, its step loop and its checkpoints.

An algorithm supplies a `Loop`: its step (`TrainState -> (TrainState, metrics row, step output)`, its own data
or rollouts inside) and what runs after each step (samples, evaluation, checkpoints, an early stop). `run_loop`
runs it: each step, then the step's `on_event` point (`train.events`), its metrics row and the progress bar
(`RunLog`: the log sinks, the metrics writer and the progress display of one loop), then the after-step hooks.
Resume: `restore_state` reads a `TrainState` back from the newest good checkpoint that `save_state` wrote;
`refuse_existing_run` guards checkpoint.resume = false. One trainer per output folder: `run_loop` holds the
folder's run lock (`run_lock.RunLock`) while it steps and logs, so no loop ever writes into a folder another
trainer holds, whoever calls it. The lock nests within a process, so the entry points (`grpo_loop.train_grpo`,
`sft_loop.run_sft`, `experiment.run_experiment`) take the same lock one level out, around the set-up that
reads checkpoints and truncates metrics files before the first step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from jaxrl_base.errors import JaxrlError
from jaxrl_llm.checkpoint import Checkpointer
from jaxrl_llm.config import ExperimentConfig
from jaxrl_llm.log_sinks import close_sinks, open_sinks
from jaxrl_llm.metrics import MetricsWriter, Progress, read_metrics
from jaxrl_llm.run_lock import RunExistsError, RunLock
from jaxrl_llm.train.components import Components, policy_view
from jaxrl_llm.train.evaluate import evaluate
from jaxrl_llm.train.events import EventHook, LoopEvent, no_events


@dataclasses.dataclass(frozen=True)
class TrainState:
    """What a training run carries from step to step.

    params: the trainable params (with LoRA the adapters); opt_state: their optimizer state (None: not made
    yet, e.g. at a stage start); step: the steps done (global over GRPO stages); key: the run's base key (each
    step draws from a named stream of it, `train.keys`); frozen: the frozen LoRA base (None without LoRA; not
    trained, not donated, not saved).
    """

    params: Any
    opt_state: Any = None
    step: int = 0
    key: jax.Array | None = None
    frozen: Any = None

    def checkpoint_tree(self) -> dict[str, Any]:
        """The pytree a checkpoint holds: {"params", "opt_state", "step" int32[], "rng" (the base key's data)}."""
        return {"params": self.params, "opt_state": self.opt_state, "step": jnp.int32(self.step),
                "rng": jax.random.key_data(self.key)}


def checkpoint_target(params, opt_state, key: jax.Array) -> dict[str, Any]:
    """The abstract `TrainState.checkpoint_tree` (shapes and dtypes) of params and opt_state targets."""
    return {"params": params, "opt_state": opt_state, "step": jax.ShapeDtypeStruct((), jnp.int32),
            "rng": jax.eval_shape(lambda: jax.random.key_data(key))}


def restore_state(ckpt: Checkpointer, target_of: Callable[[int], dict], config: ExperimentConfig, key: jax.Array,
                  log=print) -> tuple[int, TrainState]:
    """(the step restored, its TrainState) from the newest good checkpoint (`Checkpointer.restore_newest_good`;
    target_of(step) gives a step's `checkpoint_target`). The state keeps `key`, the run's base key."""
    latest, tree = ckpt.restore_newest_good(target_of, expect_config=config, log=log)
    return latest, TrainState(tree["params"], tree["opt_state"], int(tree["step"]), key)


def save_state(ckpt: Checkpointer, state: TrainState, config: ExperimentConfig, metadata: dict,
               on_event: EventHook = no_events, point: str = "save") -> None:
    """Saves `state` at its step (asynchronously when the checkpointer does), then the event `point` ("save";
    SFT's progress checkpoints: "sft_save")."""
    ckpt.save(state.step, state.checkpoint_tree(), config=config, metadata=metadata)
    on_event(LoopEvent(point, state.step, ckpt))


def refuse_existing_run(config: ExperimentConfig, ckpt: Checkpointer) -> None:
    """checkpoint.resume = false must not overwrite a run: RunExistsError when the folder holds one."""
    steps = ckpt.all_steps()
    metrics = Path(config.run.output_dir) / "metrics.jsonl"
    lines = len(read_metrics(metrics))
    if steps or lines:
        held = ", ".join(([f"checkpoints up to step {steps[-1]} in {ckpt.directory}"] if steps else [])
                         + ([f"{lines} steps in {metrics}"] if lines else []))
        raise RunExistsError(
            f"checkpoint.resume = false, but {config.run.output_dir!r} already holds a run ({held}); nothing was "
            "changed. Resume it (checkpoint.resume = true, the default), start the new run in another folder "
            "(--set run.output_dir=...), or delete the old one first")


def placed_like_outputs(tree, mesh=None):
    """`tree` (e.g. a fresh `optimizer.init(params)` or a restored optimizer state) with every leaf committed
    to a device, as the jitted step's outputs are: the uncommitted ones (optax's int32 step counts, made by
    `jnp.zeros` outside any jit) are put on the default device, or replicated over `mesh`.

    Why: jit keys its cache on each argument's placement, and an uncommitted array is a different key from
    a committed one. The step's outputs are committed, so without this the second call of every stage
    compiled the whole step again (with an SFT start or a resumed run, whose params are committed).
    """
    target = SingleDeviceSharding(jax.devices()[0]) if mesh is None else NamedSharding(mesh, PartitionSpec())
    return jax.tree_util.tree_map(
        lambda x: x if not isinstance(x, jax.Array) or x.committed else jax.device_put(x, target), tree)


class RunLog:
    """The logs of one loop in `config.run.output_dir`: the log sinks (`config.run.log`), the metrics writer of
    `metrics_file` (rows grouped as `group` in the sinks) and a progress display of `total` steps named `group`
    showing `keys`. resume_step: None starts the metrics file anew; S keeps its rows up to step S and shows S
    steps done."""

    def __init__(self, config: ExperimentConfig, metrics_file: str, group: str, total: int, keys: Sequence[str],
                 log=print, resume_step: int | None = None):
        self.out = Path(config.run.output_dir)
        self.sinks = open_sinks(config.run.log, self.out, log)
        self.writer = MetricsWriter(self.out / metrics_file, resume_step=resume_step, sinks=self.sinks, group=group)
        self.keys = tuple(keys)
        self.notes: dict[str, Any] = {}  # extra fields for the next row only
        self.progress = Progress(total, group, keys=self.keys)
        if resume_step:  # a run past its (lowered) end shows total/total, not 250 %
            self.progress.update(advance=min(resume_step, total))

    def write(self, step: int, record: dict[str, float]) -> None:
        """One step's metrics row (with the pending `notes`, e.g. a config change at a resume, then cleared), and
        the progress display advanced by one with its figures."""
        self.writer.write(step, {**record, **self.notes})
        self.notes = {}
        self.progress.update(**{k: record[k] for k in self.keys if k in record})

    def close(self) -> None:
        """Ends the progress display, the metrics file and the sinks."""
        self.progress.close()
        self.writer.close()
        close_sinks(self.sinks)


StepFn = Callable[[TrainState], "tuple[TrainState, dict[str, float], Any]"]
AfterFn = Callable[[TrainState, "dict[str, float]", Any], "bool | None"]


@dataclasses.dataclass(frozen=True)
class Loop:
    """What an algorithm gives `run_loop`. step: one training step (the state's step advanced by one) -> (state,
    its metrics row, its output, e.g. the trajectory); point: the `on_event` point of a step done; after: hooks
    run after each step's row, in order, each (state, row, output) -> True to end the loop early."""

    point: str
    step: StepFn
    after: Sequence[AfterFn] = ()


class NonFiniteLossError(FloatingPointError, JaxrlError):
    """A training step's loss or gradient norm was NaN or infinite: its weights are not kept."""


def check_finite_step(record: dict, what: str, step: int, fix: str) -> None:
    """Raise `NonFiniteLossError` when the step's `loss` or `grad_norm` (in `record`, host floats) is not
    finite, before its params replace the state: no checkpoint then holds the broken weights, and the run
    resumes from its last good one. `what`: "SFT" or "GRPO"; step: the step's number (1-based); fix: what to
    change."""
    bad = {k: record[k] for k in ("loss", "grad_norm") if k in record and not math.isfinite(record[k])}
    if bad:
        shown = ", ".join(f"{k} = {v}" for k, v in bad.items())
        raise NonFiniteLossError(f"{what} step {step}: {shown}. The step's weights are dropped and nothing after "
                                 f"the last checkpoint is saved. {fix}")


def run_loop(state: TrainState, stop: int, loop: Loop, run: RunLog | None = None,
             on_event: EventHook = no_events) -> TrainState:
    """Steps `state` until its step reaches `stop` (or a hook ends it). Each step: `loop.step`, the event
    `loop.point` (the step computed, its row not yet written), the row to `run` (metrics file, sinks,
    progress; None: not logged), then every `loop.after` hook. With `run`, the steps hold the lock of its
    output folder (`run_lock.RunLock`: one trainer per folder; nested holds in this process are free)."""
    with RunLock(run.out) if run is not None else contextlib.nullcontext():
        while state.step < stop:
            state, record, out = loop.step(state)
            on_event(LoopEvent(loop.point, state.step))
            if run is not None:
                run.write(state.step, record)
            ends = [bool(hook(state, record, out)) for hook in loop.after]  # every hook runs
            if any(ends):
                break
    return state


def periodic_eval(config: ExperimentConfig, comp: Components, run: RunLog, on_event: EventHook = no_events) -> AfterFn:
    """The after-step hook that, every `config.eval.every_steps` steps (0: never), evaluates the policy
    (`evaluate`), then the `eval` event, then one row `<setting>_<figure>` to `eval_metrics.jsonl`."""
    every = config.eval.every_steps

    def hook(state: TrainState, record, out) -> None:
        if every and state.step % every == 0:
            results = evaluate(comp, policy_view(comp, state.params))
            on_event(LoopEvent("eval", state.step))
            with MetricsWriter(run.out / "eval_metrics.jsonl", resume_step=state.step - 1, sinks=run.sinks,
                               group="eval") as evals:
                evals.write(state.step, {f"{name}_{k}": v for name, r in results.items() for k, v in r.items()})

    return hook
