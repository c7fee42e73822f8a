"""SFT: `train_sft` (batches of tokenized rows -> `algos.sft`'s step, in the shared loop `train.loop.run_loop`) and
the experiment's warm-up `run_sft` (the env's teacher rows or a data set on disk -> `train_sft` -> <output_dir>/sft)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import distributed
from jaxrl_llm.algos.optim import learning_rate_schedule, make_optimizer
from jaxrl_llm.algos.sft import (SftConfig, check_group_exact, choice_token_ids, decision_eval, make_sft_step,
                                 teacher_forced_check, tokenize_sft)
from jaxrl_llm.compat import run_checkpointer
from jaxrl_llm.config import ExperimentConfig
from jaxrl_llm.data.sft_data import export_jsonl, load_sft_dataset, rows_to_dataset, save_sft_dataset
from jaxrl_llm.run_lock import RunLock
from jaxrl_llm.train.components import (Components, base_params, build, fresh_trainable, initial_policy, policy_view,
                                        sft_dir)
from jaxrl_llm.train.events import EventHook, no_events
from jaxrl_llm.train.keys import stream
from jaxrl_llm.train.loop import AfterFn, Loop, RunLog, TrainState, check_finite_step, run_loop
from jaxrl_llm.train.sft_resume import (last_record, remove_progress, restore_sft, save_hook, sft_progress_dir,
                                        with_key)
from models import lora


def sft_rows(config: ExperimentConfig, comp: Components, log=print):
    """The SFT conversations: sft.dataset if set, else the env's teacher's rows (saved next to the run)."""
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


SFT_KEYS = ("loss", "accuracy", "decision_loss", "illegal_prob")  # the figures the progress bar shows


def _batch_indices(key: jax.Array, num_rows: int, batch_size: int, steps: int) -> np.ndarray:
    """int[steps, batch_size]: consecutive slices of a stream of per-epoch permutations (epoch e: fold_in(key, e))."""
    needed = steps * batch_size
    epochs = math.ceil(needed / num_rows)
    order = np.concatenate([np.asarray(jax.random.permutation(jax.random.fold_in(key, e), num_rows))
                            for e in range(epochs)])
    return order[:needed].reshape(steps, batch_size)


def _sft_data(tokenizer, dataset, config: SftConfig, grammar: Any) -> tuple[dict[str, np.ndarray], Any, bool]:
    """(the rows' `tokenize_sft` arrays, the choice token ids, whether the rows give legal choices), with the
    checks of `train_sft`'s arguments (ValueError)."""
    if not isinstance(config, SftConfig):
        raise ValueError(f"config must be an SftConfig, got {type(config).__name__}")
    if config.steps < 1:
        raise ValueError(f"train_sft needs config.steps >= 1 (got {config.steps}); steps = 0 skips SFT")
    data = tokenize_sft(tokenizer, dataset, config.seq_len, overflow=config.overflow, grammar=grammar)
    choice_tokens = choice_token_ids(tokenizer, grammar)
    has_legal = choice_tokens is not None and bool(data.get("choice_legal", np.zeros(0, bool)).any())
    if grammar is None and config.decision_weight != 1.0:
        raise ValueError("decision_weight != 1 needs the reply grammar (train_sft(..., grammar=...))")
    if config.legal_targets and not has_legal:
        raise ValueError("legal_targets needs a \"cell\" reply grammar and rows whose info gives legal_choices")
    if data["tokens"].shape[0] == 0:
        raise ValueError("train_sft: the dataset holds no usable conversation")
    return data, choice_tokens, has_legal


def _sft_step(module, tokenizer, config: SftConfig, optimizer, key: jax.Array, frozen, data: dict[str, np.ndarray],
              choice_tokens, has_legal: bool, grammar: Any, check_rows, eval_rows):
    """The SFT step for `run_loop`: state -> (state, metrics row, whether the check found every row exact).
    Step s trains on row s of `_batch_indices(key, ...)`; LoRA dropout keys come from `key`'s second split.
    Every check_every steps (and at the last) the teacher-forced check; at the last the held-out eval."""
    num_rows = data["tokens"].shape[0]
    schedule = learning_rate_schedule(config.optim.for_steps(config.steps))
    step_fn = make_sft_step(module, optimizer, choice_tokens if has_legal else None, config.decision_weight,
                            config.legal_targets)
    batches = _batch_indices(key, num_rows, config.batch_size, config.steps)
    drop_root = jax.random.split(key)[1] if frozen is not None else None
    check_data = None
    if check_rows is not None and config.check_every > 0:
        check_data = tokenize_sft(tokenizer, check_rows, config.seq_len, overflow=config.overflow)

    def measure(s: int, params, record: dict) -> bool:  # the check and the held-out eval of step s; exact?
        exact = False
        policy = params if frozen is None else lora.join(frozen, params)
        if check_data is not None and ((s + 1) % config.check_every == 0 or s + 1 == config.steps):
            result = teacher_forced_check(module, policy, check_data)
            record["check_exact"], record["check_token_accuracy"] = result["exact"], result["token_accuracy"]
            record.update(check_group_exact(check_rows, result["exact_rows"]))
            exact = result["exact"] == 1.0
        last = s + 1 == config.steps or (config.stop_when_exact and exact)
        if last and eval_rows is not None and grammar is not None:
            eval_data = tokenize_sft(tokenizer, eval_rows, config.seq_len, overflow=config.overflow, grammar=grammar)
            record.update({f"eval_{k}": v for k, v in decision_eval(module, policy, eval_data, choice_tokens).items()})
        return exact

    def step(state: TrainState):
        s, idx = state.step, batches[state.step]
        drop_key = None if frozen is None else jax.random.fold_in(drop_root, s)
        extra = {}
        if grammar is not None:
            extra["decision_mask"] = distributed.place_batch(data["decision_mask"], idx)
            if has_legal:
                extra["choice_legal"] = distributed.place_batch(data["choice_legal"], idx)
        # multi-host: each process reads and places only its own rows of the batch (`distributed.place_batch`)
        tokens, loss_mask = (distributed.place_batch(data[name], idx) for name in ("tokens", "loss_mask"))
        params, opt_state, metrics = step_fn(state.params, state.opt_state, tokens, loss_mask, frozen, drop_key,
                                             **extra)
        record = {k: float(v) for k, v in jax.device_get(metrics).items()}
        check_finite_step(record, "SFT", s + 1, f"Lower [sft.optim] learning_rate ({config.optim.learning_rate}) "
                          "or add warmup_steps, and check the data for rows without a loss token.")
        if not has_legal:
            for name in ("decision_loss_floor", "illegal_prob", "choice_entropy"):
                record.pop(name, None)
        record["learning_rate"] = float(schedule(s))
        record["epoch"] = (s + 1) * config.batch_size / num_rows
        exact = measure(s, params, record)
        return dataclasses.replace(state, params=params, opt_state=opt_state, step=s + 1), record, exact

    return step


def train_sft(module, params, tokenizer, dataset, config: SftConfig, key: jax.Array,
              callback: Callable[[int, dict], None] | None = None, check_rows=None,
              frozen=None, grammar: Any = None, eval_rows=None, *, run: RunLog | None = None,
              on_event: EventHook = no_events, start: TrainState | None = None,
              after: Sequence[AfterFn] = ()) -> tuple[Any, list[dict]]:
    """SFT for `config.steps` steps in the shared loop (`train.loop.run_loop`) -> (params, history: one dict of
    floats per step).

    dataset: rows with prompt/completion (a `datasets.Dataset` or a list), tokenized with `tokenize_sft`
    at config.seq_len; batches of config.batch_size are drawn from shuffled epochs (key). The caller's params
    are copied first (the step donates its inputs). callback(step, metrics) runs after every step; metrics hold
    loss, accuracy, grad_norm, tokens, learning_rate, epoch. With check_rows and config.check_every > 0,
    every check_every steps (and after the last) `teacher_forced_check` runs on those rows and adds
    check_exact and check_token_accuracy to that step's metrics; config.stop_when_exact ends training at
    the first check with every row exact. Check rows whose `info` names a `check_group` also give
    check_exact_<group>, the exact rate of that group's rows (e.g. one per arithmetic level).
    frozen: None, or the frozen base of a LoRA policy: params are then its adapters (trained and
    returned alone; dropout keys from `key`'s second split, the batch order is unchanged).
    grammar: the env's reply grammar (`envs.core.ReplyGrammar`, None: no decision metrics): each step's
    metrics then add decision_loss, format_loss, decision_accuracy, decision_tokens and, where the rows
    give their legal choices (`tokenize_sft`), decision_loss_floor, illegal_prob and choice_entropy;
    config.decision_weight weighs the decision tokens in the objective. eval_rows: held-out rows; after the
    last step `decision_eval` runs on them and the last record gets its figures prefixed `eval_`.
    run: where each step's row goes (`train.loop.RunLog`; None: nowhere); on_event: the `sft_step` event.
    start: a restored state to go on from (`train.sft_resume.restore_sft`; its params and optimizer state, its
    step; params is then ignored); after: more after-step hooks (e.g. `sft_resume.save_hook`)."""
    data, choice_tokens, has_legal = _sft_data(tokenizer, dataset, config, grammar)
    optimizer = make_optimizer(config.optim.for_steps(config.steps))
    if start is None:
        params = distributed.replicated(jax.tree.map(jnp.array, params))  # a private copy: the step donates it
        state = TrainState(params, optimizer.init(params), 0, key, frozen)
    else:
        state = with_key(start, key, frozen)
    step = _sft_step(module, tokenizer, config, optimizer, key, frozen, data, choice_tokens, has_legal, grammar,
                     check_rows, eval_rows)
    history = []

    def keep(state: TrainState, record: dict, exact: bool) -> bool:
        history.append(record)
        if callback is not None:
            callback(state.step - 1, record)
        return config.stop_when_exact and exact

    state = run_loop(state, config.steps, Loop("sft_step", step, (keep, *after)), run, on_event)
    return state.params, history


def run_sft(config: ExperimentConfig, comp: Components | None = None, log=print, dataset=None,
            on_event: EventHook = no_events) -> Any:
    """SFT warm-up on the env's teacher rows (or `dataset`); saves the params to `<run.output_dir>/sft`.

    Skipped (its params returned) when that checkpoint exists already; `sft.steps = 0` returns the fresh params.
    While it runs, SFT checkpoints every `[checkpoint] every_steps` steps to `<run.output_dir>/sft_progress`, and
    a run killed during SFT resumes from there with the same metrics (`train.sft_resume`). One trainer per
    output folder (`run_lock.RunLock`). on_event: called after each step (`train.events`: sft_step, sft_save).
    With LoRA ([lora] rank >= 1) only the adapters are trained and saved; the frozen base is `base_params`.
    Returns policy params (`components.policy_view`).
    """
    with RunLock(config.run.output_dir, log=log):
        return _run_sft_locked(config, comp, log, dataset, on_event)


def _run_sft_locked(config: ExperimentConfig, comp: Components | None, log, dataset, on_event: EventHook) -> Any:
    folder = sft_dir(config)
    done = False
    if folder.is_dir():
        with run_checkpointer(folder, read_only=True) as ckpt:
            done = ckpt.latest_step() is not None
    if not done and dataset is None and config.sft.steps and config.sft.dataset is not None:
        dataset = sft_rows(config, comp, log)  # a user's data is checked before anything is built
    comp = comp or build(config)
    if done:
        log(f"SFT checkpoint found in {folder}: skipping SFT")
        return policy_view(comp, initial_policy(comp))
    c = config.sft
    if c.steps == 0:
        return policy_view(comp, fresh_trainable(comp))
    out = Path(config.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    key = stream(config.run.seed, "sft_batches")
    progress = run_checkpointer(sft_progress_dir(config), keep=config.checkpoint.keep,
                                async_save=config.checkpoint.async_save)
    try:
        start, note, stopped = restore_sft(progress, comp, make_optimizer(c.optim.for_steps(c.steps)), key, log)
        params = fresh_trainable(comp) if start is None else None
        dataset = sft_rows(config, comp, log) if dataset is None else dataset
        run = RunLog(config, "sft_metrics.jsonl", "sft", c.steps, SFT_KEYS, log,
                     resume_step=None if start is None else start.step)
        run.notes.update(note)  # an accepted config change or more steps, in the first new row

        def check_line(step: int, record: dict) -> None:
            if "check_exact" in record:
                log(f"SFT step {step + 1}: {100 * record['check_exact']:.2f} % of the check conversations exact "
                    "(teacher-forced, greedy)")

        check_rows = comp.env.check_rows(c.teacher, comp.env.params) if c.check_every else None
        frozen = base_params(comp) if comp.lora is not None else None
        eval_rows = heldout_rows(config, comp)
        if stopped:  # the resumed step had ended SFT early (stop_when_exact)
            params, history = start.params, []
        else:
            params, history = train_sft(comp.module, params, comp.tokenizer, dataset, c, key, check_line,
                                        check_rows=check_rows, frozen=frozen,
                                        grammar=comp.env.reply_grammar(comp.env.params), eval_rows=eval_rows,
                                        run=run, on_event=on_event, start=start,
                                        after=(save_hook(progress, config, on_event),))
        run.close()
        progress.wait()
    finally:
        progress.close()
    steps_done = (0 if start is None else start.step) + len(history)
    last = last_record(config, history)
    result = {k[len("eval_"):]: v for k, v in last.items() if k.startswith("eval_")}
    if result:
        distributed.write_text(out / "sft_eval.json", json.dumps(result, indent=1) + "\n")
        log(f"SFT held-out ({int(result['rows'])} rows): {format_eval(result)}; saved to {out / 'sft_eval.json'}")
    if check_rows is not None and "check_exact" in last:
        log(f"SFT: {steps_done} steps; teacher-forced check on {len(check_rows)} conversations: "
            f"{100 * last['check_exact']:.2f} % exact, token accuracy {100 * last['check_token_accuracy']:.3f} %")
    with run_checkpointer(folder, keep=1, async_save=False) as ckpt:
        ckpt.save(steps_done, {"params": params}, config=config)
    remove_progress(config)  # the finished SFT is committed: its progress checkpoints are not needed
    return policy_view(comp, params)
    out = Path(config.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    dataset = sft_rows(config, comp, log) if dataset is None else dataset
    run = RunLog(config, "sft_metrics.jsonl", "sft", c.steps, SFT_KEYS, log)

    def check_line(step: int, record: dict) -> None:
        if "check_exact" in record:
            log(f"SFT step {step + 1}: {100 * record['check_exact']:.2f} % of the check conversations exact "
                "(teacher-forced, greedy)")

    check_rows = comp.env.check_rows(c.teacher, comp.env.params) if c.check_every else None
    frozen = base_params(comp) if comp.lora is not None else None
    eval_rows = heldout_rows(config, comp)
    params, history = train_sft(comp.module, params, comp.tokenizer, dataset, c, stream(config.run.seed, "sft_batches"),
                                check_line, check_rows=check_rows, frozen=frozen,
                                grammar=comp.env.reply_grammar(comp.env.params), eval_rows=eval_rows, run=run,
                                on_event=on_event)
    run.close()
    result = {k[len("eval_"):]: v for k, v in history[-1].items() if k.startswith("eval_")}
    if result:
        distributed.write_text(out / "sft_eval.json", json.dumps(result, indent=1) + "\n")
        log(f"SFT held-out ({int(result['rows'])} rows): {format_eval(result)}; saved to {out / 'sft_eval.json'}")
    if check_rows is not None:
        last = history[-1]
        log(f"SFT: {len(history)} steps; teacher-forced check on {len(check_rows)} conversations: "
            f"{100 * last['check_exact']:.2f} % exact, token accuracy {100 * last['check_token_accuracy']:.3f} %")
    with run_checkpointer(folder, keep=1, async_save=False) as ckpt:
        ckpt.save(len(history), {"params": params}, config=config)
    return policy_view(comp, params)
