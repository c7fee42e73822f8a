"""The experiment driver: SFT warm-up, GRPO stages, evaluation, with checkpoints and exact resume.

Reading order: `build` (tokenizer, text tables, model from an `ExperimentConfig`), `make_grpo_step`
(ONE jitted program: stratified examples -> rollout -> group advantages -> optimizer passes -> metrics),
`train_grpo` (the loop over stages and steps: checkpoints, metrics, samples), `run_sft`, `evaluate`.

Resume: every checkpoint holds params, optimizer state, the global step and the run's base key; the
key of step s is `fold_in(base_key, s)` and the examples of step s come from it, so a run killed at
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
import numpy as np

from envs import tictactoe as ttt
from jaxrl_llm import rollout as ro
from jaxrl_llm import sampling, text
from jaxrl_llm.checkpoint import Checkpointer
from jaxrl_llm.config import OPPONENTS, ExperimentConfig
from jaxrl_llm.grpo import GrpoConfig, grpo_update_step
from jaxrl_llm.metrics import MetricsWriter, Progress
from jaxrl_llm.optim import learning_rate_schedule, make_optimizer
from jaxrl_llm.tokenizer import load_tokenizer
from models.lfm2 import Lfm2ForCausalLM, init_cache


@dataclasses.dataclass
class Components:
    """What every command needs, built once from the config (host objects; tables are device arrays)."""

    config: ExperimentConfig
    tokenizer: Any
    preset: text.PromptPreset
    tables: text.TextTables
    lfm2: Any  # models.lfm2.Lfm2Config
    module: Lfm2ForCausalLM
    compiled: dict = dataclasses.field(default_factory=dict)  # jitted programs, built on first use

    @property
    def model_fn(self) -> sampling.ModelFn:
        return sampling.lfm2_model_fn(self.module)

    def init_cache(self, batch: int, max_len: int):
        return init_cache(self.lfm2, batch, max_len)

    @property
    def eos_id(self) -> int:
        return self.tables.eos_id

    def rollout_config(self, stage: int | None) -> ro.RolloutConfig:
        """The rollout settings of GRPO stage `stage` (None: evaluation)."""
        return self.config.rollout_config(stage, stop_token_ids=(self.eos_id,), pad_id=self.tables.pad_id)


def build(config: ExperimentConfig) -> Components:
    """Tokenizer, prompt tables and model of `config` (checks the tokenizer fits the model)."""
    tokenizer = load_tokenizer(config.tokenizer.path)
    preset = text.PRESETS[config.prompt.preset]
    tables = text.build_text_tables(tokenizer, preset)
    lfm2 = config.model.lfm2_config()
    if len(tokenizer) > lfm2.vocab_size:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {lfm2.vocab_size}; "
            f"set model.vocab_size >= {len(tokenizer)} (e.g. --set model.vocab_size={len(tokenizer)})"
        )
    return Components(config, tokenizer, preset, tables, lfm2, Lfm2ForCausalLM(lfm2))


def fresh_params(comp: Components, key: jax.Array):
    """Initial policy params: the HF checkpoint `model.init_from` if set, else a random init."""
    if comp.config.model.init_from is not None:
        from models.hf import load_hf

        return load_hf(comp.config.model.init_from).params
    return comp.module.init(key, jnp.zeros((1, 8), jnp.int32))["params"]


def make_mesh(config: ExperimentConfig):
    """The device mesh of `config.mesh` (axes `data`, `fsdp`); None on a single device."""
    devices = jax.devices()
    if len(devices) == 1:
        return None
    from jax.sharding import Mesh

    data, fsdp = config.mesh.axis_sizes(len(devices))
    return Mesh(np.asarray(devices).reshape(data, fsdp), ("data", "fsdp"))


def shard_params(comp: Components, params, mesh):
    """Places params on `mesh`: the `embed` axis of every weight sharded over `fsdp`, the rest replicated
    (optimizer states follow, since optax builds them from the params)."""
    if mesh is None:
        return params
    from models.lfm2 import param_shardings

    return jax.device_put(params, param_shardings(comp.lfm2, mesh))


def sft_dir(config: ExperimentConfig) -> Path:
    return Path(config.run.output_dir) / "sft"


def initial_policy(comp: Components, key: jax.Array):
    """The params GRPO starts from: the SFT checkpoint of this run when there is one, else `fresh_params`."""
    folder = sft_dir(comp.config)
    if folder.is_dir():
        with Checkpointer(folder, read_only=True) as ckpt:
            if ckpt.latest_step() is not None:
                target = jax.eval_shape(lambda: fresh_params(comp, key))
                return ckpt.restore_subtree("params", target=target)
    return fresh_params(comp, key)


def _hf_params(comp: Components, folder: str, target):
    """The params of a Hugging Face LFM2 folder (`jaxrl-llm export`'s output), checked against the model."""
    from models.hf import load_hf

    loaded = load_hf(folder)
    if loaded.config.num_hidden_layers != comp.lfm2.num_hidden_layers or loaded.config.hidden_size != comp.lfm2.hidden_size \
            or loaded.config.vocab_size != comp.lfm2.vocab_size:
        raise ValueError(
            f"{folder} holds a model with {loaded.config.num_hidden_layers} layers, hidden {loaded.config.hidden_size}, "
            f"vocab {loaded.config.vocab_size}, but the config builds {comp.lfm2.num_hidden_layers} / "
            f"{comp.lfm2.hidden_size} / {comp.lfm2.vocab_size}: use the preset it was trained with")
    got = jax.tree_util.tree_map(lambda x: (x.shape, str(x.dtype)), loaded.params)
    want = jax.tree_util.tree_map(lambda x: (x.shape, str(x.dtype)), target)
    if got != want:
        raise ValueError(f"{folder}'s tensors do not match the config's model (shapes or dtypes differ); "
                         "use the preset it was trained with")
    print(f"params from {folder} (Hugging Face folder)")
    return loaded.params


def policy_params(config, comp, checkpoint: str | None):
    """Params to evaluate / play / export: `--checkpoint DIR` (a GRPO or SFT checkpoint folder, or a Hugging
    Face folder with config.json + safetensors such as `jaxrl-llm export` writes), else the
    run's latest GRPO checkpoint, else its SFT checkpoint, else `model.init_from` (a Hugging Face folder),
    else a fresh init (with a warning)."""
    target = jax.eval_shape(lambda: fresh_params(comp, jax.random.PRNGKey(0)))
    if checkpoint and (Path(checkpoint) / "config.json").is_file():
        return _hf_params(comp, checkpoint, target)
    candidates = [checkpoint] if checkpoint else [config.checkpoint_dir(), str(sft_dir(config))]
    for folder in candidates:
        try:
            with Checkpointer(folder, read_only=True) as ckpt:
                if ckpt.latest_step() is not None:
                    print(f"params from {folder} (step {ckpt.latest_step()})")
                    return ckpt.restore_subtree("params", target=target)
        except FileNotFoundError:
            if checkpoint:
                raise
    if config.model.init_from is not None:
        print(f"no checkpoint in {', '.join(map(str, candidates))}: params from model.init_from = {config.model.init_from}")
    else:
        print("warning: no checkpoint found: using freshly initialised params")
    return fresh_params(comp, jax.random.PRNGKey(config.run.seed))


# ----------------------------------------------------------------------------------------------------------
# GRPO: one jitted step
# ----------------------------------------------------------------------------------------------------------


def rollout_metrics(traj: ro.Trajectory) -> dict[str, jax.Array]:
    """Per-batch game figures (device scalars): outcome rates, format / invalid rates, reward parts, lengths."""
    turns = jnp.maximum(traj.turns.sum(), 1)
    out = {f"{name}_rate": jnp.mean(traj.outcome == code) for code, name in ro.OUTCOME_NAMES.items() if code}
    out.update(
        format_rate=traj.reply_format.sum() / turns,
        invalid_rate=jnp.mean(traj.invalid_moves > 0),
        missing_rate=jnp.mean(traj.missing_moves > 0),
        win_reward=jnp.mean(traj.win_reward),
        format_reward=jnp.mean(traj.format_reward),
        invalid_reward=jnp.mean(traj.invalid_reward),
        reply_length=traj.reply_lengths.sum() / turns,
        truncation_rate=traj.reply_truncated.sum() / turns,
        context_cut_rate=jnp.mean(traj.context_cut),
        turns=jnp.mean(traj.turns),
        sampled_tokens=traj.loss_mask.sum(),
        total_tokens=traj.length.sum(),
    )
    return {k: v.astype(jnp.float32) for k, v in out.items()}


def make_grpo_step(comp: Components, stage: int, mesh=None):
    """`step(params, opt_state, ref_params, key) -> (params, opt_state, metrics, trajectory)`, one `jit`.

    Inside: stratified examples of the stage (`num_prompts` x `group_size` games), the rollout, group
    advantages and `passes` x `num_minibatches` optimizer steps. params and opt_state are donated.
    With a mesh, the games are sharded over all its devices (the batch over data x fsdp) and the params
    as they are placed (`shard_params`); XLA inserts the collectives.
    """
    config = comp.config
    s = config.grpo[stage]
    gcfg = GrpoConfig(**s.grpo_fields())
    optimizer = make_optimizer(s.optim)
    rcfg = comp.rollout_config(stage)
    model_fn = comp.model_fn

    def step(params, opt_state, ref_params, key):
        k_examples, k_rollout, k_update = jax.random.split(key, 3)
        seeds, probs = ttt.stratified_examples(k_examples, s.num_prompts, s.group_size, s.p_min, s.p_max)
        if mesh is not None:
            from jax.sharding import NamedSharding, PartitionSpec

            rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
            seeds = jax.lax.with_sharding_constraint(seeds, rows)
            probs = jax.lax.with_sharding_constraint(probs, rows)
        policy = ro.model_policy(model_fn, params, rcfg.sampling)
        traj = ro.rollout(policy, model_fn, params, comp.init_cache, comp.tables, seeds, probs, k_rollout, rcfg)
        params, opt_state, metrics = grpo_update_step(
            comp.module, optimizer, gcfg, params, opt_state, ref_params,
            traj.tokens, traj.loss_mask, traj.logprobs, traj.reward, k_update,
        )
        metrics.update(rollout_metrics(traj))
        metrics["p_mean"] = jnp.mean(probs)
        return params, opt_state, metrics, traj

    return jax.jit(step, donate_argnums=(0, 1)), optimizer


def time_stage_rollout(comp: Components, stage: int, params, key: jax.Array, repeats: int = 2) -> float:
    """Seconds for the rollout alone of one step of GRPO stage `stage` (its batch, its settings; compiled
    first, best of `repeats`): with the stage's step_time it splits a GRPO step into rollout and update."""
    s = comp.config.grpo[stage]
    run = ro.make_rollout(comp.model_fn, comp.init_cache, comp.tables, comp.rollout_config(stage))
    seeds, probs = ttt.stratified_examples(key, s.num_prompts, s.group_size, s.p_min, s.p_max)
    jax.block_until_ready(run(params, seeds, probs, key))
    best = float("inf")
    for i in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run(params, seeds, probs, jax.random.fold_in(key, i)))
        best = min(best, time.perf_counter() - start)
    return best


def games_played(config: ExperimentConfig, global_step: int) -> int:
    """Games played by the first `global_step` GRPO steps (the data position)."""
    played, left = 0, global_step
    for s in config.grpo:
        n = min(left, s.steps)
        played, left = played + n * s.batch_size, left - n
    return played


def write_samples(stem: Path, tokenizer, traj: ro.Trajectory, count: int) -> None:
    """The first `count` games of a batch as JSONL (`stem.jsonl`) and as readable text (`stem.txt`)."""
    traj = jax.device_get(traj)
    ro.write_games_jsonl(stem.with_suffix(".jsonl"), tokenizer, traj, range(count))
    blocks = []
    for i in range(count):
        r = ro.game_record(tokenizer, traj, i)
        blocks.append(f"=== game {i}: {r['outcome']}, reward {r['reward']:.3f}, p {r['random_move_prob']:.2f}\n"
                      + r["conversation"])
    stem.with_suffix(".txt").write_text("\n\n".join(blocks) + "\n", encoding="utf-8")


def _global_stage(config: ExperimentConfig, global_step: int) -> tuple[int, int]:
    """(stage index, steps done inside it) for a global step count; past the end: (len, 0)."""
    start = 0
    for i, s in enumerate(config.grpo):
        if global_step < start + s.steps:
            return i, global_step - start
        start += s.steps
    return len(config.grpo), 0


def train_grpo(config: ExperimentConfig, comp: Components | None = None, stop_after: int | None = None,
               log=print) -> dict[str, Any]:
    """Runs (or resumes) every GRPO stage of `config`; returns {"params", "step", "metrics_path"}.

    Checkpoints go to `config.checkpoint_dir()` every `checkpoint.every_steps` steps and at the end of each
    stage; metrics to `<run.output_dir>/metrics.jsonl`, one JSON object per step; every
    `run.sample_every` steps a few games to `<run.output_dir>/samples/step_<n>.jsonl`.
    stop_after: end after this many global steps (tests, time budgets); a later call resumes.
    """
    comp = comp or build(config)
    out = Path(config.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    total = sum(s.steps for s in config.grpo)
    base_key = jax.random.PRNGKey(config.run.seed)
    ckpt = Checkpointer(config.checkpoint_dir(), keep=config.checkpoint.keep, async_save=config.checkpoint.async_save)
    try:
        latest = ckpt.latest_step() if config.checkpoint.resume else None
        params_target = jax.eval_shape(lambda: fresh_params(comp, base_key))
        params = opt_state = None
        step = 0
        if latest is not None:
            meta = ckpt.metadata(latest).get("metadata", {})
            stage_of_ckpt = int(meta.get("stage", 0))
            _, opt0 = make_grpo_step(comp, stage_of_ckpt)
            target = {
                "params": params_target,
                "opt_state": jax.eval_shape(opt0.init, params_target),
                "step": jax.ShapeDtypeStruct((), jnp.int32),
                "rng": jax.eval_shape(lambda: jax.random.key_data(base_key)),
            }
            state = ckpt.restore(latest, target=target, expect_config=config)
            params, opt_state, step = state["params"], state["opt_state"], int(state["step"])
            if _global_stage(config, step)[0] != stage_of_ckpt:
                opt_state = None  # the checkpoint closed its stage: the next stage starts a fresh optimizer
            log(f"resumed from {ckpt.directory} at step {step}/{total}")
        else:
            params = initial_policy(comp, jax.random.fold_in(base_key, 10**9))
        mesh = make_mesh(config)
        params = shard_params(comp, params, mesh)
        ref_params = shard_params(comp, initial_policy(comp, jax.random.fold_in(base_key, 10**9)), mesh)
        writer = MetricsWriter(out / "metrics.jsonl", resume_step=step)
        keys = ("reward_mean", "win_rate", "draw_rate", "loss_rate", "format_rate", "games_per_s")
        progress = Progress(total, "grpo", keys=keys)
        progress.update(advance=step)
        stop = total if stop_after is None else min(total, stop_after)
        while step < stop:
            stage, done_in_stage = _global_stage(config, step)
            s = config.grpo[stage]
            step_fn, optimizer = make_grpo_step(comp, stage, mesh)
            if opt_state is None or done_in_stage == 0:
                opt_state = optimizer.init(params)
            ref = ref_params if s.beta > 0 else None
            schedule = learning_rate_schedule(s.optim)
            stage_end = step - done_in_stage + s.steps
            while step < min(stage_end, stop):
                t0 = time.perf_counter()
                params, opt_state, metrics, traj = step_fn(params, opt_state, ref, jax.random.fold_in(base_key, step))
                metrics = jax.device_get(metrics)
                dt = time.perf_counter() - t0
                local = step - (stage_end - s.steps)
                record = {k: float(v) for k, v in metrics.items()}
                record.update(
                    stage=stage, learning_rate=float(schedule(local)), step_time=dt,
                    games_per_s=s.batch_size / dt, tokens_per_s=record["total_tokens"] / dt,
                    sampled_tokens_per_s=record["sampled_tokens"] / dt, temperature=s.temperature,
                )
                step += 1
                writer.write(step, record)
                progress.update(**{k: record[k] for k in keys})
                if config.run.sample_every and step % config.run.sample_every == 0:
                    write_samples(out / "samples" / f"step_{step:06d}", comp.tokenizer, traj, min(4, s.batch_size))
                if config.eval.every_steps and step % config.eval.every_steps == 0:
                    results = evaluate(comp, params)
                    with MetricsWriter(out / "eval_metrics.jsonl", resume_step=step - 1) as evals:
                        evals.write(step, {f"{opp}_{k}": v for opp, r in results.items() for k, v in r.items()})
                every = config.checkpoint.every_steps
                if (every and step % every == 0) or step == stage_end or step == stop:
                    # The RNG state: step s draws everything from fold_in(base_key, s), so (base key, step)
                    # is the whole of it; the data position is the number of games played so far.
                    ckpt.save(step, {"params": params, "opt_state": opt_state, "step": jnp.int32(step),
                                     "rng": jax.random.key_data(base_key)}, config=config,
                              metadata={"stage": stage, "stage_step": step - (stage_end - s.steps),
                                        "games_played": games_played(config, step)})
            if step == stage_end:
                opt_state = None
        progress.close()
        writer.close()
        ckpt.wait()
        return {"params": params, "step": step, "metrics_path": str(out / "metrics.jsonl")}
    finally:
        ckpt.close()


# ----------------------------------------------------------------------------------------------------------
# SFT
# ----------------------------------------------------------------------------------------------------------


def run_sft(config: ExperimentConfig, comp: Components | None = None, log=print, dataset=None) -> Any:
    """SFT warm-up on expert games (or `dataset`); saves the params to `<run.output_dir>/sft`.

    Skipped (its params returned) when that checkpoint exists already; `sft.steps = 0` returns the fresh params.
    """
    from jaxrl_llm import sft
    from jaxrl_llm.metrics import MetricsWriter

    comp = comp or build(config)
    base_key = jax.random.PRNGKey(config.run.seed)
    folder = sft_dir(config)
    if folder.is_dir():
        with Checkpointer(folder, read_only=True) as ckpt:
            if ckpt.latest_step() is not None:
                log(f"SFT checkpoint found in {folder}: skipping SFT")
                return initial_policy(comp, jax.random.fold_in(base_key, 10**9))
    params = fresh_params(comp, jax.random.fold_in(base_key, 10**9))
    c = config.sft
    if c.steps == 0:
        return params
    scfg = sft.SftConfig(
        steps=c.steps, batch_size=c.batch_size, seq_len=c.seq_len, num_games=c.num_games,
        teacher_random_move_prob=c.teacher_random_move_prob, teacher=c.teacher, reasoning=c.reasoning,
        tree_copies=c.tree_copies,
        opponent_p_min=c.opponent_p_range()[0], opponent_p_max=c.opponent_p_range()[1],
        preset=config.prompt.preset, max_turns=config.env.max_turns, optim=c.optim,
    )
    out = Path(config.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if dataset is None and c.dataset is not None:
        from jaxrl_llm.sft_data import load_sft_dataset

        dataset = load_sft_dataset(c.dataset)
        log(f"SFT: {len(dataset)} conversations from {c.dataset}")
    if dataset is None:
        from jaxrl_llm.sft_data import export_jsonl, save_sft_dataset

        dataset = sft.make_sft_dataset(scfg, jax.random.fold_in(base_key, 1))
        save_sft_dataset(dataset, out / "sft_data")
        export_jsonl(dataset, out / "sft_data.jsonl")
        tree = f" + {c.tree_copies} x the teacher's game tree" if c.tree_copies else ""
        log(f"SFT: {len(dataset)} expert games ({c.num_games} played, lost / unfinished dropped{tree}; "
            f"saved to {out / 'sft_data'})")
    writer = MetricsWriter(out / "sft_metrics.jsonl")
    progress = Progress(c.steps, "sft", keys=("loss", "accuracy"))

    def callback(step, record):
        writer.write(step + 1, record)
        progress.update(loss=record["loss"], accuracy=record["accuracy"])
        if "check_exact" in record:
            log(f"SFT step {step + 1}: {100 * record['check_exact']:.2f} % of the teacher's tree games exact "
                f"(teacher-forced, greedy)")

    check_rows = None
    if c.check_every:
        from jaxrl_llm.sft_data import exhaustive_expert_games, games_to_rows

        check_rows = games_to_rows(exhaustive_expert_games(), comp.preset, reasoning=c.reasoning)
    params, history = sft.train_sft(comp.module, params, comp.tokenizer, dataset, scfg,
                                    jax.random.fold_in(base_key, 2), callback, check_rows=check_rows,
                                    check_every=c.check_every, stop_when_exact=c.stop_when_exact)
    progress.close()
    writer.close()
    if check_rows is not None:
        last = history[-1]
        log(f"SFT: {len(history)} steps; teacher-forced check on the teacher's {len(check_rows)} tree games: "
            f"{100 * last['check_exact']:.2f} % exact, token accuracy {100 * last['check_token_accuracy']:.3f} %")
    with Checkpointer(folder, keep=1, async_save=False) as ckpt:
        ckpt.save(len(history), {"params": params}, config=config)
    return params


# ----------------------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------------------


def _eval_rollout(comp: Components):
    """The jitted evaluation rollout, compiled once per Components."""
    if "eval_rollout" not in comp.compiled:
        comp.compiled["eval_rollout"] = ro.make_rollout(comp.model_fn, comp.init_cache, comp.tables, comp.rollout_config(None))
    return comp.compiled["eval_rollout"]


def tree_check(comp: Components, params) -> dict:
    """`sft.teacher_forced_check` of `params` on every game the best teacher can meet (738 games, the run's
    prompt preset and reasoning style): exact = 1.0 means greedy play equals the teacher's against any
    opponent, so its evaluation results are the teacher's exact ones (95.6 % wins vs random, all draws vs
    optimal)."""
    from jaxrl_llm import sft
    from jaxrl_llm.sft_data import exhaustive_expert_games, games_to_rows

    rows = games_to_rows(exhaustive_expert_games(), comp.preset, reasoning=comp.config.sft.reasoning)
    data = sft.tokenize_sft(comp.tokenizer, rows, 4096)
    longest = int(data["lengths"].max())
    data = {k: v[:, :longest] if v.ndim == 2 else v for k, v in data.items()}
    return sft.teacher_forced_check(comp.module, params, data)


def summarize(traj: ro.Trajectory) -> dict[str, float]:
    """W/D/L rates, format rate (replies), invalid rate (games with an invalid move), of a batch (host)."""
    traj = jax.device_get(traj)
    turns = max(int(np.sum(traj.turns)), 1)
    return {
        "games": int(traj.outcome.shape[0]),
        "win": float(np.mean(traj.outcome == ttt.OUTCOME_WIN)),
        "draw": float(np.mean(traj.outcome == ttt.OUTCOME_DRAW)),
        "loss": float(np.mean(traj.outcome == ttt.OUTCOME_LOSS)),
        "unfinished": float(np.mean(traj.outcome == ttt.OUTCOME_UNFINISHED)),
        "format": float(np.sum(traj.reply_format) / turns),
        "invalid": float(np.mean(traj.invalid_moves > 0)),
        "reward": float(np.mean(traj.reward)),
    }


def evaluate(comp: Components, params, opponents=None, num_games: int | None = None, key=None,
             games_path: str | Path | None = None) -> dict[str, dict[str, float]]:
    """Plays `num_games` games against each opponent ("random": p = 1, "optimal": p = 0), first movers
    drawn from the seeds; returns {opponent: summary}; writes every game to `games_path` (JSONL) if given."""
    config = comp.config
    opponents = tuple(opponents or config.eval.opponents)
    num_games = num_games or config.eval.num_games
    key = jax.random.PRNGKey(config.run.seed + 7) if key is None else key
    run = _eval_rollout(comp)
    results = {}
    records = []
    for i, name in enumerate(opponents):
        if name not in OPPONENTS:
            raise ValueError(f"unknown opponent {name!r}; choose from {sorted(OPPONENTS)}")
        k_seeds, k_play = jax.random.split(jax.random.fold_in(key, i))
        seeds = jax.random.bits(k_seeds, (num_games,), jnp.uint32)
        probs = jnp.full((num_games,), OPPONENTS[name], jnp.float32)
        traj = jax.device_get(run(params, seeds, probs, k_play))
        results[name] = summarize(traj)
        if games_path is not None:
            records.append((name, traj))
    if games_path is not None:
        import json

        path = Path(games_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as f:
            for name, traj in records:
                for b in range(traj.tokens.shape[0]):
                    f.write(json.dumps({"opponent": name, **ro.game_record(comp.tokenizer, traj, b)}) + "\n")
    return results
