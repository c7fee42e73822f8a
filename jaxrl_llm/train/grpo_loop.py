"""GRPO: one jitted step (examples -> rollout -> group advantages -> optimizer passes) and its stages in the
shared training loop (`train.loop`).

Resume: every checkpoint holds params, optimizer state, the global step and the run's base key; the
key of step s is `keys.stream(seed, "grpo", s)` and the examples of step s come from it, so a run killed at
any point and started again with the same command continues from its last checkpoint and produces
the same metrics, bit for bit on the CPU, as a run that was never interrupted.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_llm import distributed
from jaxrl_llm.algos.advantages import advantage_inputs, advantage_metrics
from jaxrl_llm.algos.grpo import grpo_update_step
from jaxrl_llm.algos.optim import make_optimizer
from jaxrl_llm.checkpoint import Checkpointer
from jaxrl_llm.checks import ConfigError
from jaxrl_llm.compat import run_checkpointer
from jaxrl_llm.config import ExperimentConfig
from jaxrl_llm.metrics import MetricsWriter, log_name, metric_kind
from jaxrl_llm.rollout import Trajectory, games_text, make_rollout, model_policy, rollout, write_games_jsonl
from jaxrl_llm.run_config import check_resumed_config
from jaxrl_llm.run_lock import RunLock
from jaxrl_llm.text import require_reply_template
from jaxrl_llm.train.components import (Components, base_params, build, initial_policy, make_mesh,
                                        policy_view, replicate, sft_trainable, shard_params, trainable_target)
from jaxrl_llm.train.env_values import check_env_values
from jaxrl_llm.train.evaluate import GENERIC_SUMMARY
from jaxrl_llm.train.events import EventHook, no_events
from jaxrl_llm.train.keys import stream
from jaxrl_llm.train.loop import (  # noqa: F401  (placed_like_outputs, refuse_existing_run: their old home)
    Loop, RunLog, TrainState, check_finite_step, checkpoint_target, periodic_eval, placed_like_outputs,
    refuse_existing_run, restore_state, run_loop, save_state,
)
from models import lora


def rollout_metrics(traj: Trajectory, kinds=None) -> dict[str, jax.Array]:
    """Per-batch figures (device scalars): the env's metrics as `<name>_rate`, or `<name>_mean` for a metric
    the env's `metric_kinds` (`kinds`) declares a mean (means over the games where the
    metric is not NaN; NaN when it is NaN for all), the reward parts as
    `<name>_reward` (unweighted), format / truncation / context-cut rates, reply lengths, tokens."""
    clash = set(traj.metrics) & set(GENERIC_SUMMARY)
    if clash:
        raise ValueError(f"env metric names {sorted(clash)} are reserved for the generic summary; rename them")
    replies = jnp.maximum(traj.turns.sum(), 1)
    out = {log_name(name, metric_kind(kinds, name)): jnp.nanmean(v)  # NaN: not this game's metric
           for name, v in traj.metrics.items()}
    out.update({f"{name}_reward": jnp.mean(v) for name, v in traj.reward_parts.items()})
    out.update(
        format_rate=traj.reply_format.sum() / replies,
        reply_length=traj.reply_lengths.sum() / replies,
        truncation_rate=traj.reply_truncated.sum() / replies,
        context_cut_rate=jnp.mean(traj.context_cut),
        stopped_rate=jnp.mean(traj.truncated),
        turns=jnp.mean(traj.turns),
        sampled_tokens=traj.loss_mask.sum(),
        total_tokens=traj.length.sum(),
    )
    return {k: v.astype(jnp.float32) for k, v in out.items()}


def decision_inputs(traj: Trajectory, tables) -> dict[str, jax.Array]:
    """The optional inputs of `grpo_update_step` that a trajectory and the text tables can give: the
    decision mask (`Trajectory.decision_mask`), and for a grammar of single-token choices whose legality the
    env can say, choice_legal bool[B, L, C] (each model token's turn's legal choices, all True off the
    model's tokens) with choice_tokens int32[C] (`TextTables.choice_tokens`). Empty when absent."""
    out = {}
    decision = getattr(traj, "decision_mask", None)
    if decision is None:
        return out
    out["decision_mask"] = decision
    legal, turn = getattr(traj, "turn_legal", None), getattr(traj, "token_turn", None)
    choices = getattr(tables, "choice_tokens", None)
    if legal is not None and turn is not None and choices is not None and legal.shape[-1] > 0 \
            and legal.shape[-1] == choices.shape[0]:
        per_token = jnp.take_along_axis(legal, jnp.clip(turn, 0, legal.shape[1] - 1)[..., None], axis=1)
        out["choice_legal"] = jnp.where((turn >= 0)[..., None], per_token, True)
        out["choice_tokens"] = jnp.asarray(choices, jnp.int32)
    return out


def make_grpo_step(comp: Components, stage: int, mesh=None):
    """`step(params, opt_state, ref_params, key, frozen=None) -> (params, opt_state, metrics, trajectory)`,
    one `jit`.

    Inside: the stage's examples from the env's curriculum (`num_prompts` x `group_size` games), the
    rollout, group advantages and `passes` x `num_minibatches` optimizer steps (`grpo_update_step` with the
    stage's `group_size` and its sampler's temperature, `sampling.temperature`). params and opt_state are
    donated. With a mesh, the games are sharded over all its devices (the batch over data x fsdp) and the
    params as they are placed (`shard_params`); XLA inserts the collectives. LoRA: params are the adapters
    and frozen the base (not donated); the games are played by `lora.join(frozen, params)`.
    """
    s = comp.config.grpo[stage]
    gcfg = s.grpo_config()
    optimizer = make_optimizer(s.optim_config())
    sconf = comp.sampling_config(s.sampling)
    env, model_fn = comp.env, comp.model_fn
    # Constrained replies: the update recomputes the content tokens' log-probs over their allowed sets.
    sets = require_reply_template(comp.tables).sets if sconf.constrained else None

    def step(params, opt_state, ref_params, key, frozen=None):
        k_examples, k_rollout, k_update = jax.random.split(key, 3)
        examples = env.sample_examples(k_examples, s.num_prompts, s.group_size, s.curriculum)
        if mesh is not None:
            rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
            examples = jax.tree_util.tree_map(lambda x: jax.lax.with_sharding_constraint(x, rows), examples)
        playing = params if frozen is None else lora.join(frozen, params)
        policy = model_policy(model_fn, playing, sconf)
        traj = rollout(env, policy, model_fn, playing, comp.init_cache, comp.tables, examples, k_rollout, s.rollout,
                       sconf)
        params, opt_state, metrics = grpo_update_step(
            comp.module, optimizer, gcfg, params, opt_state, ref_params,
            traj.tokens, traj.loss_mask, traj.logprobs, traj.reward, k_update, frozen=frozen,
            group_size=s.group_size, temperature=sconf.temperature,
            **decision_inputs(traj, comp.tables), **advantage_inputs(gcfg, traj, s.group_size),
            **({} if sets is None else {"choice_set": traj.choice_set, "choice_sets": sets}),
        )
        metrics.update(advantage_metrics(gcfg, traj, s.group_size))
        metrics.update(rollout_metrics(traj, env.metric_kinds))
        metrics.update({k: jnp.asarray(v, jnp.float32) for k, v in env.example_metrics(examples).items()})
        return params, opt_state, metrics, traj

    return jax.jit(step, donate_argnums=(0, 1)), optimizer


def time_stage_rollout(comp: Components, stage: int, params, key: jax.Array, repeats: int = 2) -> float:
    """Seconds for the rollout alone of one step of GRPO stage `stage` (its batch, its settings; compiled
    first, best of `repeats`): with the stage's step_time it splits a GRPO step into rollout and update."""
    s = comp.config.grpo[stage]
    run = make_rollout(comp.env, comp.model_fn, comp.init_cache, comp.tables, s.rollout,
                       comp.sampling_config(s.sampling))
    examples = comp.env.sample_examples(key, s.num_prompts, s.group_size, s.curriculum)
    jax.block_until_ready(run(params, examples, key))
    best = float("inf")
    for i in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run(params, examples, jax.random.fold_in(key, i)))
        best = min(best, time.perf_counter() - start)
    return best


def games_played(config: ExperimentConfig, global_step: int) -> int:
    """Games played by the first `global_step` GRPO steps (the data position)."""
    played, left = 0, global_step
    for s in config.grpo:
        n = min(left, s.steps)
        played, left = played + n * s.batch_size, left - n
    return played


def write_samples(stem: Path, comp: Components, traj: Trajectory, count: int, sinks=(), step: int = 0) -> None:
    """The first `count` games of a batch as JSONL (`stem.jsonl`) and as readable text (`stem.txt`; also
    to each log sink as text `samples` at `step`)."""
    write_games_jsonl(stem.with_suffix(".jsonl"), comp.env, comp.tokenizer, traj, range(count))
    text = games_text(comp.env, comp.tokenizer, traj, count)
    distributed.write_text(stem.with_suffix(".txt"), text)  # multi-host: process 0 writes
    for sink in sinks:
        sink.text("samples", step, text)


def global_stage(config: ExperimentConfig, global_step: int) -> tuple[int, int]:
    """(stage index, steps done inside it) for a global step count; past the end: (len, 0)."""
    start = 0
    for i, s in enumerate(config.grpo):
        if global_step < start + s.steps:
            return i, global_step - start
        start += s.steps
    return len(config.grpo), 0


def progress_keys(comp: Components) -> tuple[str, ...]:
    """The figures the progress bar shows: reward, the env's table metrics, format rate, games/s."""
    metrics = [log_name(m, metric_kind(comp.env.metric_kinds, m)) for _, m in comp.env.results_columns if m != "format"]
    return ("reward_mean", *metrics, "format_rate", "games_per_s")



def train_grpo(config: ExperimentConfig, comp: Components | None = None, stop_after: int | None = None,
               log=print, on_event: EventHook = no_events) -> dict[str, Any]:
    """Runs (or resumes) every GRPO stage of `config`; returns {"params" (policy params:
    `components.policy_view`), "step", "metrics_path"}.

    Checkpoints go to `config.checkpoint_dir()` every `checkpoint.every_steps` steps and at the end of each
    stage; metrics to `<run.output_dir>/metrics.jsonl`, one JSON object per step; every
    `run.sample_every` steps a few games to `<run.output_dir>/samples/step_<n>.jsonl`.
    stop_after: end after this many global steps (tests, time budgets); a later call resumes.
    on_event: called at the loop's moments (`train.events`: grpo_step, eval, save).
    One trainer per output folder (`run_lock.RunLock`); resuming skips a damaged newest checkpoint for the
    newest good one, with a warning naming both; checkpoint.resume = false on an existing run is refused.
    The steps run in the shared loop (`train.loop.run_loop`), one stage at a time (`_run_stage`).
    """
    if sum(s.steps for s in config.grpo) == 0:
        raise ConfigError("there is no GRPO step to run: add a [[grpo]] stage with steps >= 1 to the preset"
                          if not config.grpo else "every [[grpo]] stage has steps = 0: nothing to train", ("grpo",))
    with RunLock(config.run.output_dir, log=log):
        return _train_grpo_locked(config, comp, stop_after, log, on_event)


def _train_grpo_locked(config: ExperimentConfig, comp: Components | None, stop_after: int | None,
                       log, on_event: EventHook) -> dict[str, Any]:
    comp = comp or build(config)
    out = Path(config.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    total = sum(s.steps for s in config.grpo)
    ckpt = run_checkpointer(config.checkpoint_dir(), keep=config.checkpoint.keep,
                            async_save=config.checkpoint.async_save)
    try:
        if not config.checkpoint.resume:
            refuse_existing_run(config, ckpt)
        state = _start_state(config, comp, ckpt, total, log)
        note = check_resumed_config(_saved_config(ckpt, state.step), config, state.step, "grpo",
                                    f"the run in {config.run.output_dir}", log) if state.step else {}
        mesh = make_mesh(config)
        state, ref_params = _placed(comp, state, mesh)
        run = RunLog(config, "metrics.jsonl", "grpo", total, progress_keys(comp), log, resume_step=state.step)
        run.notes.update(note)  # an accepted config change or an extended schedule, in the first new row
        if (out / "eval_metrics.jsonl").exists():  # evaluations after the resumed step are redone
            MetricsWriter(out / "eval_metrics.jsonl", resume_step=state.step).close()
        stop = total if stop_after is None else min(total, stop_after)
        while state.step < stop:
            state = _run_stage(config, comp, state, ref_params, mesh, stop, run, ckpt, on_event)
        run.close()
        ckpt.wait()
        return {"params": policy_view(comp, state.params), "step": state.step,
                "metrics_path": str(out / "metrics.jsonl")}
    finally:
        ckpt.close()


def _saved_config(ckpt: Checkpointer, step: int) -> dict | None:
    """The config dict a checkpoint step was saved with (None when the step records none)."""
    return ckpt.metadata(step).get("config") if step in ckpt.all_steps() else None


def _start_state(config: ExperimentConfig, comp: Components, ckpt: Checkpointer, total: int, log) -> TrainState:
    """The run's first state: the newest good checkpoint's (checkpoint.resume = true and one exists; its
    optimizer state dropped when that checkpoint closed its stage), else the initial policy at step 0. The
    base key is PRNGKey(run.seed); step s draws from `keys.stream(seed, "grpo", s)`."""
    base_key = jax.random.PRNGKey(config.run.seed)
    latest = ckpt.latest_step() if config.checkpoint.resume else None
    if latest is None:
        return TrainState(initial_policy(comp), None, 0, base_key)
    params_target = trainable_target(comp)
    stage_of = {}

    def target_of(at: int):  # the optimizer state's structure is that of the checkpoint's stage
        stage_of[at] = int(ckpt.metadata(at).get("metadata", {}).get("stage", 0))
        _, opt0 = make_grpo_step(comp, stage_of[at])
        return checkpoint_target(params_target, jax.eval_shape(opt0.init, params_target), base_key)

    latest, state = restore_state(ckpt, target_of, config, base_key, log=log)
    if global_stage(config, state.step)[0] != stage_of[latest]:
        state = dataclasses.replace(state, opt_state=None)  # it closed its stage: the next starts a fresh optimizer
    if state.step >= total:  # the config now asks for fewer steps than the run has made
        log(f"resumed from {ckpt.directory} at step {state.step}: the run is already past its end (the stages now "
            f"total {total} steps); nothing to train. Raise grpo.N.steps to train on")
    else:
        log(f"resumed from {ckpt.directory} at step {state.step}/{total}")
    return state


def _placed(comp: Components, state: TrainState, mesh) -> tuple[TrainState, Any]:
    """(state with its params placed for the step and the frozen LoRA base set, the KL reference params).
    Without LoRA the params are sharded over `mesh` and the reference is the initial policy. With LoRA one
    frozen base: the policy is base + adapters; the reference is the base with the adapters off, or base +
    the SFT adapters when GRPO starts from them (as the full model's reference is SFT's)."""
    if comp.lora is None:
        frozen = None
        params = shard_params(comp, state.params, mesh)
        ref_params = shard_params(comp, initial_policy(comp), mesh)
    else:
        frozen = base_params(comp, mesh)
        params = replicate(state.params, mesh)
        start = sft_trainable(comp)
        ref_params = frozen if start is None else lora.join(frozen, replicate(start, mesh))
    return dataclasses.replace(state, params=placed_like_outputs(params, mesh), frozen=frozen), ref_params


def _run_stage(config: ExperimentConfig, comp: Components, state: TrainState, ref_params, mesh, stop: int,
               run: RunLog, ckpt: Checkpointer, on_event: EventHook) -> TrainState:
    """The steps of the stage that `state.step` is in, up to its end or `stop`, in `run_loop`: the stage's
    jitted step (a fresh optimizer at the stage's start or after a stage-closing checkpoint), then samples,
    evaluation and checkpoints. The state leaves without an optimizer state when the stage is done."""
    stage, done_in_stage = global_stage(config, state.step)
    s = config.grpo[stage]
    step_fn, optimizer = make_grpo_step(comp, stage, mesh)
    opt_state = optimizer.init(state.params) if state.opt_state is None or done_in_stage == 0 else state.opt_state
    state = dataclasses.replace(state, opt_state=placed_like_outputs(opt_state, mesh))  # else step 2 compiles again
    ref = ref_params if s.loss.beta > 0 else None
    stage_end = state.step - done_in_stage + s.steps

    def step(state: TrainState):
        t0 = time.perf_counter()
        params, opt_state, metrics, traj = step_fn(state.params, state.opt_state, ref,
                                                   stream(config.run.seed, "grpo", state.step), state.frozen)
        metrics = jax.device_get(metrics)
        dt = time.perf_counter() - t0
        record = {k: float(v) for k, v in metrics.items()}  # learning_rate: the mean rate applied
        check_env_values(record, comp.env, "GRPO", state.step + 1)  # a NaN reward is the env's, named first
        check_finite_step(record, "GRPO", state.step + 1,
                          f"Lower [grpo.optim] learning_rate (stage {stage}: {s.optim.learning_rate}) or raise "
                          "its eps, and check the run's samples for broken replies.")
        record.update(stage=stage, step_time=dt, games_per_s=s.batch_size / dt,
                      tokens_per_s=record["total_tokens"] / dt, sampled_tokens_per_s=record["sampled_tokens"] / dt,
                      temperature=s.sampling.temperature)
        return dataclasses.replace(state, params=params, opt_state=opt_state, step=state.step + 1), record, traj

    def samples(state: TrainState, record, traj) -> None:
        if config.run.sample_every and state.step % config.run.sample_every == 0:
            write_samples(run.out / "samples" / f"step_{state.step:06d}", comp, traj, min(4, s.batch_size),
                          run.sinks, state.step)

    def save(state: TrainState, record, traj) -> None:
        every = config.checkpoint.every_steps
        if (every and state.step % every == 0) or state.step in (stage_end, stop):
            # The RNG state: step s draws everything from stream(seed, "grpo", s), so (base key, step) is the
            # whole of it; the data position is the number of games played so far.
            save_state(ckpt, state, config, {"stage": stage, "stage_step": state.step - (stage_end - s.steps),
                                             "games_played": games_played(config, state.step)}, on_event)

    after = (samples, periodic_eval(config, comp, run, on_event), save)
    state = run_loop(state, min(stage_end, stop), Loop("grpo_step", step, after), run, on_event)
    return dataclasses.replace(state, opt_state=None) if state.step == stage_end else state
