"""Train throughput: whole GRPO steps of the CPU preset, split into rollout and update, and the update's FLOP/s.

One run, the model and stage 1 of `experiments/presets/cpu.toml` (16 prompts x 8 games, context 400, 2
minibatches), with the committed checkpoint `experiments/checkpoints/cpu` when it is there (real game
lengths; else random weights, whose games end early on invalid moves):

* whole steps: `train.grpo_loop.make_grpo_step` (the jitted step the trainer runs), compiled first, then
  `--steps` calls; trained games/s = batch / median step time;
* rollout alone: the stage's rollout jitted by itself (`time_stage_rollout`), best of `--repeats`;
* update alone: `algos.grpo.make_grpo_update` on one batch of that rollout, best of `--repeats`, twice:
  as the trainer runs it (`skip_zero_advantage`: micro-batches whose rows all have advantage 0 skip their
  forward/backward; `--grad-accum-steps` micro-batches per minibatch) and computing every row (the
  FLOP-share figure: XLA counts both branches of the skip's `lax.cond`); the batch's share of groups
  without reward spread is printed with them;
* the update's useful FLOPs (`models.family.forward_flops` x 3: each row at its real length with causal
  attention, the LM head at the loss tokens; no padding), as FLOP/s and as a share of the float32 matmul
  peak measured in the same run (`machine.matmul_peak_flops`). XLA's `cost_analysis()` of the compiled
  update is printed beside it but is no measure of the work: it counts a loop body once (the
  minibatch x micro-batch `scan`s run it 8 times) and every branch of the bucket `switch`;
* the forward floor: the update's own no-gradient forward of the batch (`algos.grpo.forward_slot_logprobs`,
  at the same buckets), timed alone. A forward and its backward cost about 3 forwards, so 3x this time
  over the rollout is the least every_row_over_rollout an update could reach at the forward's FLOP/s
  (`update_floor_over_rollout`);
* the old path against the new, in the same run (issue 30): the update as before it (`length_buckets = 1`,
  `logits_at_loss_only = false`: every row at the full context, logits at every position) and as now
  (length buckets, logits at loss positions only), both computing every row, alone
  (`baseline_update_every_row_s` / `update_every_row_s`) and in whole trainer steps
  (`baseline_games_per_s_every_row` / `games_per_s_every_row`).
Targets: issue 15, update <= 2x rollout and >= 40 % of the peak; issue 30, every-row update <= 1.2x the
rollout and whole every-row steps >= 1.7x the old path's games/s. Prints the machine facts first and one
JSON object last.

    python experiments/benchmarks/train_throughput.py            # 4 steps after the compile
    python experiments/benchmarks/train_throughput.py --steps 2  # shorter
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import best_seconds, describe, machine_facts, matmul_peak_flops  # noqa: E402




def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default=str(ROOT / "experiments" / "presets" / "cpu.toml"))
    parser.add_argument("--checkpoint", default=str(ROOT / "experiments" / "checkpoints" / "cpu"))
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--steps", type=int, default=4, help="timed whole steps after the compiling one")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--grad-accum-steps", type=int, default=4,
                        help="micro-batches per minibatch (the skip's granularity); must divide its rows")
    args = parser.parse_args()

    from jaxrl_llm import train
    from jaxrl_llm.algos.grpo import forward_slot_logprobs, make_grpo_update, real_lengths
    from jaxrl_llm.config import load_config
    from jaxrl_llm.rollout import make_rollout
    from jaxrl_llm.train.components import fresh_trainable, policy_params
    from jaxrl_llm.train.grpo_loop import make_grpo_step, placed_like_outputs
    from jaxrl_llm.train.keys import stream
    from models.family import forward_flops

    facts = machine_facts()
    print(describe(facts), flush=True)
    peak = matmul_peak_flops()
    print(f"float32 matmul peak through JAX: {peak / 1e9:.0f} GFLOP/s", flush=True)

    base_overrides = ['run.output_dir="/tmp/train_throughput_unused"',
                      f"grpo.{args.stage}.loss.grad_accum_steps={args.grad_accum_steps}"]
    config = load_config(args.preset, base_overrides, check_paths=False)
    comp = train.build(config)
    s = config.grpo[args.stage]
    use_ckpt = Path(args.checkpoint, "config.json").is_file()
    params = policy_params(config, comp, args.checkpoint) if use_ckpt else fresh_trainable(comp)
    params = placed_like_outputs(jax.device_put(params, jax.devices()[0]))
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    print(f"model {n_params / 1e6:.2f}M parameters ({'checkpoint ' + args.checkpoint if use_ckpt else 'random'}); "
          f"stage {args.stage}: {s.num_prompts} x {s.group_size} games, context {s.rollout.context_length}, "
          f"{s.loss.num_minibatches} minibatches, {s.loss.passes} passes", flush=True)

    # The old path (issue 30's baseline, behind the switch): every micro-batch at the full context and the
    # logits at every position. Same model, batch, keys.
    old = [f"grpo.{args.stage}.loss.length_buckets=1", f"grpo.{args.stage}.loss.logits_at_loss_only=false"]
    every_row = [f"grpo.{args.stage}.loss.skip_zero_advantage=false"]

    def variant(extra):
        cfg = load_config(args.preset, base_overrides + extra, check_paths=False)
        return train.build(cfg)

    def whole_steps(comp_v):
        """(compile + first step s, step times, recompiled) of the jitted trainer step (params / opt_state
        are donated: our own copies)."""
        step_fn, optimizer = make_grpo_step(comp_v, args.stage)
        p = jax.tree_util.tree_map(lambda x: x.copy(), params)
        o = placed_like_outputs(optimizer.init(p))
        t = time.perf_counter()
        p, o, _, _ = step_fn(p, o, None, stream(0, "grpo", 0), None)
        jax.block_until_ready(p)
        compile_s = time.perf_counter() - t
        times = []
        for i in range(1, args.steps + 1):
            t = time.perf_counter()
            p, o, _, _ = step_fn(p, o, None, stream(0, "grpo", i), None)
            jax.block_until_ready(p)
            times.append(time.perf_counter() - t)
        return compile_s, times, step_fn._cache_size() != 1

    compile_s, times, recompiled = whole_steps(comp)  # as the trainer runs it (skipping), the new path
    step_s = float(np.median(times))
    every = {}
    for name, extra in (("new", every_row), ("old", every_row + old)):
        _, t_every, _ = whole_steps(variant(extra))
        every[name] = float(np.median(t_every))
    optimizer = make_grpo_step(comp, args.stage)[1]

    # Rollout alone, same batch and settings.
    run = make_rollout(comp.env, comp.model_fn, comp.init_cache, comp.tables, s.rollout, comp.sampling_config(s.sampling))
    key = stream(0, "grpo", 1)
    examples = comp.env.sample_examples(key, s.num_prompts, s.group_size, s.curriculum)
    traj = jax.block_until_ready(run(params, examples, key))
    rollout_s = best_seconds(lambda: run(params, examples, key), args.repeats, warmup=False)

    # Update alone on that batch, as the trainer runs it (skipping) and computing every row, new and old
    # path; the FLOPs (XLA's count) of the every-row updates.
    import dataclasses

    args_u = (traj.tokens, traj.loss_mask, traj.logprobs, traj.reward, key)
    copy_s = best_seconds(lambda: jax.tree_util.tree_map(lambda x: x.copy(), params), args.repeats, warmup=False)
    timed, flops = {}, {}
    base_cfg = s.grpo_config()
    for name, change in (("skip", {}), ("every_row", dict(skip_zero_advantage=False)),
                         ("baseline_every_row", dict(skip_zero_advantage=False, length_buckets=1,
                                                     logits_at_loss_only=False))):
        update = make_grpo_update(comp.module, optimizer, dataclasses.replace(base_cfg, **change),
                                  group_size=s.group_size, temperature=s.sampling.temperature)
        if name != "skip":
            cost = update.jitted.lower(params, optimizer.init(params), None, *args_u).compile().cost_analysis()
            cost = cost[0] if isinstance(cost, (list, tuple)) else cost
            flops[name] = float(cost.get("flops", float("nan")))

        def one_update(update=update):
            q = jax.tree_util.tree_map(lambda x: x.copy(), params)
            return update(q, placed_like_outputs(optimizer.init(q)), *args_u)[0]

        jax.block_until_ready(one_update())
        timed[name] = max(best_seconds(one_update, args.repeats, warmup=False) - copy_s, 1e-9)
    update_s, every_row_s = timed["skip"], timed["every_row"]
    # The forward floor: the update's own no-gradient forward of the batch, at the same buckets.
    forward = jax.jit(lambda p, t, m: forward_slot_logprobs(comp.module, base_cfg, p, t, m,
                                                            temperature=s.sampling.temperature)[0])
    forward_s = best_seconds(lambda: forward(params, traj.tokens, traj.loss_mask), args.repeats)
    need = np.asarray(real_lengths(traj.loss_mask))
    rewards = np.asarray(traj.reward).reshape(-1, s.group_size)
    zero_std = float(np.mean(np.all(rewards == rewards[:, :1], axis=1)))

    length = int(np.asarray(traj.length).max())
    sampled = float(np.asarray(traj.loss_mask).sum())
    x_new, x_old = flops["every_row"], flops["baseline_every_row"]
    f_new = 3 * forward_flops(comp.model_config, need, int(sampled))  # the same useful work, both paths
    f_forward = f_new / 3
    row = {
        "benchmark": "train_throughput", **facts, "matmul_peak_gflops": peak / 1e9, "params": n_params,
        "checkpoint": use_ckpt, "batch": s.batch_size, "context": s.rollout.context_length,
        "longest_game_tokens": length, "mean_game_tokens": float(np.asarray(traj.length).mean()),
        "sampled_tokens": sampled, "compile_s": compile_s, "step_s": step_s, "step_times": times,
        "second_call_recompiled": recompiled, "games_per_s": s.batch_size / step_s,
        "rollout_s": rollout_s, "update_s": update_s, "update_over_rollout": update_s / rollout_s,
        "grad_accum_steps": args.grad_accum_steps, "frac_zero_std_groups": zero_std,
        "update_every_row_s": every_row_s, "every_row_over_rollout": every_row_s / rollout_s,
        "update_flops": f_new, "flops_source": "useful matmul FLOPs: 3 x forward_flops (real lengths, causal "
                                               "attention, head at loss tokens)",
        "update_gflops_per_s": f_new / every_row_s / 1e9, "update_share_of_peak": f_new / every_row_s / peak,
        "xla_cost_analysis_flops": x_new, "baseline_xla_cost_analysis_flops": x_old,
        "forward_s": forward_s, "forward_over_rollout": forward_s / rollout_s,
        "forward_share_of_peak": f_forward / forward_s / peak, "every_row_over_forward": every_row_s / forward_s,
        "update_floor_over_rollout": 3 * forward_s / rollout_s,
        "length_buckets": base_cfg.length_buckets, "logits_at_loss_only": base_cfg.logits_at_loss_only,
        "step_every_row_s": every["new"], "games_per_s_every_row": s.batch_size / every["new"],
        "baseline_step_every_row_s": every["old"], "baseline_games_per_s_every_row": s.batch_size / every["old"],
        "baseline_update_every_row_s": timed["baseline_every_row"],
        "baseline_every_row_over_rollout": timed["baseline_every_row"] / rollout_s,
        "baseline_update_flops": f_new,  # the same useful work (the old path computes padding on top of it)
        "baseline_update_gflops_per_s": f_new / timed["baseline_every_row"] / 1e9,
    }
    row["every_row_games_speedup"] = row["games_per_s_every_row"] / row["baseline_games_per_s_every_row"]
    row["target_update_le_2x_rollout"] = row["update_over_rollout"] <= 2.0
    row["target_40pct_of_peak"] = row["update_share_of_peak"] >= 0.40
    row["target_every_row_le_1_2x_rollout"] = row["every_row_over_rollout"] <= 1.2
    row["target_every_row_games_1_7x"] = row["every_row_games_speedup"] >= 1.7
    print(f"compile + first step {compile_s:.1f} s; whole step {step_s:.2f} s (median of {len(times)}) = "
          f"{row['games_per_s']:.1f} trained games/s; second call recompiled: {recompiled}")
    print(f"rollout {rollout_s:.2f} s, update {update_s:.2f} s: update = {row['update_over_rollout']:.2f}x rollout "
          f"(target <= 2x: {'met' if row['target_update_le_2x_rollout'] else 'NOT met'}); "
          f"{zero_std:.0%} of the groups have no reward spread and skip")
    print(f"computing every row: update {every_row_s:.2f} s = {row['every_row_over_rollout']:.2f}x rollout (target "
          f"<= 1.2x: {'met' if row['target_every_row_le_1_2x_rollout'] else 'NOT met'}; old path "
          f"{timed['baseline_every_row']:.2f} s = {row['baseline_every_row_over_rollout']:.2f}x); whole step "
          f"{every['new']:.2f} s = {row['games_per_s_every_row']:.1f} games/s against the old path's {every['old']:.2f} s "
          f"= {row['baseline_games_per_s_every_row']:.1f} games/s: {row['every_row_games_speedup']:.2f}x (target >= "
          f"1.7x: {'met' if row['target_every_row_games_1_7x'] else 'NOT met'})")
    print(f"every-row update: {f_new / 1e9:.1f} GFLOP of useful work in {every_row_s:.2f} s = "
          f"{row['update_gflops_per_s']:.1f} GFLOP/s = {row['update_share_of_peak']:.1%} of the matmul peak (target >= 40 %: "
          f"{'met' if row['target_40pct_of_peak'] else 'NOT met'}; old path {row['baseline_update_gflops_per_s']:.1f} "
          f"GFLOP/s); XLA's cost analysis says {x_new / 1e9:.1f} GFLOP (old {x_old / 1e9:.1f}), counting each loop "
          f"body once; games: longest {length} tokens of the {s.rollout.context_length} context")
    print(f"forward floor: the update's no-gradient forward of the batch {forward_s:.2f} s = "
          f"{row['forward_over_rollout']:.2f}x rollout at {row['forward_share_of_peak']:.1%} of the peak; the every-row "
          f"update = {row['every_row_over_forward']:.2f}x it (forward + backward ~ 3x); an update at the forward's "
          f"FLOP/s would be {row['update_floor_over_rollout']:.2f}x the rollout")
    print(json.dumps(row))


if __name__ == "__main__":
    main()
