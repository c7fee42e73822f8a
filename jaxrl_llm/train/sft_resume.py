"""SFT checkpoints during training, and the resume from them, as GRPO does (bit-exact after a SIGKILL).

While SFT runs, `<run.output_dir>/sft_progress` holds its `TrainState` (params, optimizer state, step, key) every
`[checkpoint] every_steps` steps (0: none before the end), the last `[checkpoint] keep` of them, written as
`checkpoint.async_save` says; each save is the loop event `sft_save`. The finished SFT is still the params alone
in `<run.output_dir>/sft` (what GRPO, eval and export read); once that is committed the progress folder is
removed. A run killed during SFT resumes from the newest good progress step: step s trains on batch s of the
same shuffled epochs and draws its dropout key from the step alone, so the metrics are those of a run never
interrupted. The resume checks the config like GRPO's (`run_config`, scope "sft").
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import jax

from jaxrl_llm.checkpoint import Checkpointer
from jaxrl_llm.config import ExperimentConfig
from jaxrl_llm.metrics import read_metrics
from jaxrl_llm.run_config import check_resumed_config
from jaxrl_llm.run_lock import RunExistsError
from jaxrl_llm.train.components import Components, trainable_target
from jaxrl_llm.train.events import EventHook, no_events
from jaxrl_llm.train.loop import AfterFn, TrainState, checkpoint_target, restore_state, save_state

__all__ = ["SAVE_POINT", "sft_progress_dir", "restore_sft", "save_hook", "last_record", "remove_progress", "with_key"]

SAVE_POINT = "sft_save"  # the loop event of an SFT progress checkpoint (GRPO's is "save")


def sft_progress_dir(config: ExperimentConfig) -> Path:
    """Where an SFT in progress keeps its checkpoints: `<run.output_dir>/sft_progress`."""
    return Path(config.run.output_dir) / "sft_progress"


def restore_sft(ckpt: Checkpointer, comp: Components, optimizer, key: jax.Array,
                log=print) -> tuple[TrainState | None, dict[str, str], bool]:
    """(the state of the newest good SFT progress step, or None when there is none; the note for the next metrics
    row (`run_config.check_resumed_config`); whether that step ended SFT early, `sft.stop_when_exact`).
    The env, tokenizer, LoRA and model must fit (`compat`), and the training config too (`run_config`)."""
    config = comp.config
    if ckpt.latest_step() is None:
        return None, {}, False
    if not config.checkpoint.resume:
        raise RunExistsError(f"checkpoint.resume = false, but {str(ckpt.directory)!r} holds an SFT in progress (step "
                             f"{ckpt.latest_step()}); nothing was changed. Resume it (checkpoint.resume = true, the "
                             "default), start the new run in another folder (--set run.output_dir=...), or delete "
                             "that folder first")
    params_target = trainable_target(comp)
    target = checkpoint_target(params_target, jax.eval_shape(optimizer.init, params_target), key)
    step, state = restore_state(ckpt, target, config, key, log=log)
    meta = ckpt.metadata(step)
    note = check_resumed_config(meta.get("config"), config, state.step, "sft",
                                f"the SFT in {ckpt.directory}", log)
    log(f"SFT resumed from {ckpt.directory} at step {state.step}/{config.sft.steps}")
    return state, note, bool(meta.get("metadata", {}).get("stopped", False))


def save_hook(ckpt: Checkpointer, config: ExperimentConfig, on_event: EventHook = no_events) -> AfterFn:
    """The after-step hook that saves SFT's state every `checkpoint.every_steps` steps, and at a step that ends
    SFT early (the step's output is its exactness flag, `train_sft`'s `stop_when_exact`); the last step's is the
    final save's (`<run.output_dir>/sft`)."""
    every = config.checkpoint.every_steps

    def hook(state: TrainState, record, exact) -> None:
        stopped = bool(config.sft.stop_when_exact and exact)
        if state.step < config.sft.steps and ((every and state.step % every == 0) or stopped):
            save_state(ckpt, state, config, {"sft_step": state.step, "stopped": stopped}, on_event, point=SAVE_POINT)

    return hook


def last_record(config: ExperimentConfig, history: list[dict]) -> dict:
    """SFT's last metrics row: the loop's, or, when the resumed run had no step left, the metrics file's."""
    if history:
        return history[-1]
    rows = read_metrics(Path(config.run.output_dir) / "sft_metrics.jsonl")
    return {k: v for k, v in rows[-1].items() if k not in ("step", "time")} if rows else {}


def remove_progress(config: ExperimentConfig) -> None:
    """Removes the progress checkpoints once the finished SFT is committed to `<run.output_dir>/sft`."""
    shutil.rmtree(sft_progress_dir(config), ignore_errors=True)


def with_key(state: TrainState, key: jax.Array, frozen: Any) -> TrainState:
    """A restored state with the run's key and the frozen LoRA base (neither is saved)."""
    return dataclasses.replace(state, key=key, frozen=frozen)
