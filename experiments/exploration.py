"""Exploration effects: how opponent strength and sampling temperature change a policy's reward.

The reference run reported that a weaker opponent (a higher random-move probability p) gives more reward
and more reward spread within a GRPO group, and that a higher temperature explores more until the replies
fall apart (1.40 collapsed into gibberish). This script measures the same two effects for one of our
checkpoints with the evaluation rollout: for every temperature T and opponent p of a grid it plays
`--games` games (first movers from the seeds) and records the mean reward, W/D/L, the invalid rate and the
within-group reward spread of `--group` rollouts of each example (the signal GRPO learns from).

    python experiments/exploration.py experiments/presets/cpu.toml --checkpoint runs/cpu/sft \
        --out experiments/results/exploration

Writes `<out>.json` and `<out>.png` (reward and group spread vs p, one curve per temperature); the last
stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


def sweep(config_path: str, checkpoint: str | None, temperatures, probs, games: int, group: int, overrides=()):
    from envs import tictactoe as ttt
    from jaxrl_llm import rollout as ro
    from jaxrl_llm.config import load_config
    from jaxrl_llm.train import build, policy_params

    config = load_config(config_path, overrides)
    comp = build(config)
    params = policy_params(config, comp, checkpoint)
    base = config.eval.sampling
    examples = games // group
    key = jax.random.PRNGKey(config.run.seed + 11)
    rows = []
    for t_index, temperature in enumerate(temperatures):
        sampling = dataclasses.replace(base, greedy=temperature == 0.0, temperature=max(temperature, 1e-3))
        run = ro.make_rollout(comp.env, comp.model_fn, comp.init_cache, comp.tables, config.eval.rollout,
                              comp.sampling_config(sampling))
        for p_index, p in enumerate(probs):
            k_seed, k_play = jax.random.split(jax.random.fold_in(key, 1000 * t_index + p_index))
            seeds = jnp.repeat(jax.random.bits(k_seed, (examples,), jnp.uint32), group)
            start = time.perf_counter()
            games_ex = ttt.Example(seeds, jnp.full((examples * group,), p, jnp.float32))
            traj = jax.device_get(run(params, games_ex, k_play))
            reward = np.asarray(traj.reward).reshape(examples, group)
            rows.append({
                "temperature": float(temperature), "p": float(p), "games": int(reward.size),
                "reward": float(reward.mean()), "group_std": float(reward.std(axis=1).mean()),
                **{k: float(np.mean(traj.metrics[k])) for k in ("win", "draw", "loss", "invalid")},
                "seconds": time.perf_counter() - start,
            })
            r = rows[-1]
            print(f"T={temperature:<5} p={p:<5} reward {r['reward']:.3f}  group std {r['group_std']:.3f}  "
                  f"W/D/L {100 * r['win']:.0f}/{100 * r['draw']:.0f}/{100 * r['loss']:.0f}  "
                  f"invalid {100 * r['invalid']:.0f}%", flush=True)
    return rows


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for temperature in sorted({r["temperature"] for r in rows}):
        sel = [r for r in rows if r["temperature"] == temperature]
        label = "greedy" if temperature == 0.0 else f"T = {temperature}"
        axes[0].plot([r["p"] for r in sel], [r["reward"] for r in sel], marker="o", label=label)
        axes[1].plot([r["p"] for r in sel], [r["group_std"] for r in sel], marker="o", label=label)
    axes[0].set(xlabel="opponent random-move probability p", ylabel="mean reward", title="reward")
    axes[1].set(xlabel="opponent random-move probability p", ylabel="reward std within a group",
                title="GRPO signal (group spread)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--checkpoint", default=None, help="checkpoint folder (default: the run's latest)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7, 1.0, 1.25, 1.5, 2.0],
                        help="0 = greedy")
    parser.add_argument("--p", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    parser.add_argument("--games", type=int, default=256, help="games per (temperature, p); a multiple of --group")
    parser.add_argument("--group", type=int, default=8, help="rollouts per example (as a GRPO group)")
    parser.add_argument("--out", default="exploration", help="output path without suffix")
    args = parser.parse_args(argv)
    if args.games < args.group or args.games % args.group:
        parser.error(f"--games ({args.games}) must be a positive multiple of --group ({args.group})")
    if any(t < 0 for t in args.temperatures):
        parser.error("temperatures must be >= 0 (0 = greedy)")
    if any(not 0.0 <= p <= 1.0 for p in args.p):
        parser.error("--p values must lie in [0, 1]")
    rows = sweep(args.config, args.checkpoint, args.temperatures, args.p, args.games, args.group, args.set)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    plot(rows, out.with_suffix(".png"))
    print(json.dumps({"exploration": rows, "png": str(out.with_suffix(".png"))}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
