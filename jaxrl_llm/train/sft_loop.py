"""SFT warm-up: the env's teacher rows (or a data set on disk) -> `algos.sft.train_sft` -> <output_dir>/sft."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax

from jaxrl_llm.compat import run_checkpointer
from jaxrl_llm.config import ExperimentConfig
from jaxrl_llm.log_sinks import close_sinks, open_sinks
from jaxrl_llm.metrics import MetricsWriter, Progress
from jaxrl_llm.run_lock import RunLock
from jaxrl_llm.train.components import (Components, base_params, build, fresh_trainable, initial_policy, policy_view,
                                        sft_dir)
from jaxrl_llm.train.events import EventHook, LoopEvent, no_events
from jaxrl_llm.train.keys import stream


def sft_rows(config: ExperimentConfig, comp: Components, log=print):
    """The SFT conversations: sft.dataset if set, else the env's teacher's rows (saved next to the run)."""
    from jaxrl_llm.data.sft_data import export_jsonl, load_sft_dataset, rows_to_dataset, save_sft_dataset

    c = config.sft
    if c.dataset is not None:
        dataset = load_sft_dataset(c.dataset)
        log(f"SFT: {len(dataset)} conversations from {c.dataset}")
        return dataset
    out = Path(config.run.output_dir)
    rows = comp.env.demonstrations(c.teacher, stream(config.run.seed, "sft_data"), comp.env.params,
                                   config.rollout.max_turns)
    dataset = rows_to_dataset(rows)
    save_sft_dataset(dataset, out / "sft_data")
    export_jsonl(dataset, out / "sft_data.jsonl")
    log(f"SFT: {len(dataset)} conversations from the {comp.env.name} teacher ({c.teacher}); saved to {out / 'sft_data'}")
    return dataset


def heldout_rows(config: ExperimentConfig, comp: Components) -> list[dict] | None:
    """`sft.eval_rows` held-out rows of the SFT teacher, drawn with their own key (fold_in(sft_data, 1)):
    the teacher with num_games = eval_rows (one row a game or a position, as the teacher lays them out; rows
    of a games teacher's filter may be fewer). None when eval_rows = 0 or there is no teacher."""
    c = config.sft
    if not c.eval_rows or c.teacher is None:
        return None
    teacher = c.teacher
    if dataclasses.is_dataclass(teacher) and any(f.name == "num_games" for f in dataclasses.fields(teacher)):
        teacher = dataclasses.replace(teacher, num_games=c.eval_rows)
    key = jax.random.fold_in(stream(config.run.seed, "sft_data"), 1)  # not the training rows' key
    return list(comp.env.demonstrations(teacher, key, comp.env.params, config.rollout.max_turns))


def format_eval(result: dict[str, float]) -> str:
    """One line of the held-out decision metrics (`algos.sft.decision_eval`)."""
    line = (f"decision loss {result['decision_loss']:.4f}, format loss {result['format_loss']:.4f}, "
            f"decision accuracy {100 * result['decision_accuracy']:.1f} %")
    if "decision_loss_floor" in result:
        line += (f", floor (uniform over the legal choices) {result['decision_loss_floor']:.4f}, probability on "
                 f"illegal choices {100 * result['illegal_prob']:.2f} %, choice entropy {result['choice_entropy']:.3f}")
    return line


def run_sft(config: ExperimentConfig, comp: Components | None = None, log=print, dataset=None,
            on_event: EventHook = no_events) -> Any:
    """SFT warm-up on the env's teacher rows (or `dataset`); saves the params to `<run.output_dir>/sft`.

    Skipped (its params returned) when that checkpoint exists already; `sft.steps = 0` returns the fresh params.
    SFT has no checkpoint before its end: a run killed during SFT does it again from the start (the same
    steps, so the same metrics). One trainer per output folder (`run_lock.RunLock`). on_event: called after
    each step (`train.events`: sft_step).
    With LoRA ([lora] rank >= 1) only the adapters are trained and saved; the frozen base is `base_params`.
    Returns policy params (`components.policy_view`).
    """
    with RunLock(config.run.output_dir, log=log):
        return _run_sft_locked(config, comp, log, dataset, on_event)


def _run_sft_locked(config: ExperimentConfig, comp: Components | None, log, dataset, on_event: EventHook) -> Any:
    from jaxrl_llm.algos import sft

    comp = comp or build(config)
    folder = sft_dir(config)
    if folder.is_dir():
        with run_checkpointer(folder, read_only=True) as ckpt:
            if ckpt.latest_step() is not None:
                log(f"SFT checkpoint found in {folder}: skipping SFT")
                return policy_view(comp, initial_policy(comp))
    params = fresh_trainable(comp)
    c = config.sft
    if c.steps == 0:
        return policy_view(comp, params)
    out = Path(config.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    dataset = sft_rows(config, comp, log) if dataset is None else dataset
    sinks = open_sinks(config.run.log, out, log)
    writer = MetricsWriter(out / "sft_metrics.jsonl", sinks=sinks, group="sft")
    progress = Progress(c.steps, "sft", keys=("loss", "accuracy", "decision_loss", "illegal_prob"))

    def callback(step, record):
        writer.write(step + 1, record)
        on_event(LoopEvent("sft_step", step + 1))
        progress.update(**{k: record[k] for k in ("loss", "accuracy", "decision_loss", "illegal_prob") if k in record})
        if "check_exact" in record:
            log(f"SFT step {step + 1}: {100 * record['check_exact']:.2f} % of the check conversations exact "
                "(teacher-forced, greedy)")

    check_rows = comp.env.check_rows(c.teacher, comp.env.params) if c.check_every else None
    frozen = base_params(comp) if comp.lora is not None else None
    eval_rows = heldout_rows(config, comp)
    params, history = sft.train_sft(comp.module, params, comp.tokenizer, dataset, c,
                                    stream(config.run.seed, "sft_batches"), callback, check_rows=check_rows,
                                    frozen=frozen, grammar=comp.env.reply_grammar(comp.env.params),
                                    eval_rows=eval_rows)
    progress.close()
    writer.close()
    close_sinks(sinks)
    result = {k[len("eval_"):]: v for k, v in history[-1].items() if k.startswith("eval_")}
    if result:
        (out / "sft_eval.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        log(f"SFT held-out ({int(result['rows'])} rows): {format_eval(result)}; saved to {out / 'sft_eval.json'}")
    if check_rows is not None:
        last = history[-1]
        log(f"SFT: {len(history)} steps; teacher-forced check on {len(check_rows)} conversations: "
            f"{100 * last['check_exact']:.2f} % exact, token accuracy {100 * last['check_token_accuracy']:.3f} %")
    with run_checkpointer(folder, keep=1, async_save=False) as ckpt:
        ckpt.save(len(history), {"params": params}, config=config)
    return policy_view(comp, params)
