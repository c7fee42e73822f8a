"""Record golden Tic-Tac-Toe outputs BEFORE the environment-protocol port (run with the pre-port code).

    python tests/golden/record_tictactoe.py        # writes tests/golden/tictactoe.npz and .json

Recorded: a scripted rollout (reference preset, every kind of reply), rollouts of a fixed random tiny
model (compact and tiny presets, sampled, greedy, cache stages), the SFT rows of the CPU preset's teacher
and the committed checkpoint's evaluation. `tests/test_golden.py` checks the ported code against them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from envs import tictactoe as ttt  # noqa: E402
from jaxrl_llm import rollout as ro  # noqa: E402
from jaxrl_llm import sampling, text  # noqa: E402
from jaxrl_llm.tokenizer import load_tokenizer  # noqa: E402
from models.lfm2 import PRESETS, Lfm2ForCausalLM, init_cache  # noqa: E402

MAX_TURNS, MAX_NEW, CONTEXT = 8, 24, 1152


def scripted_replies(rng: random.Random, n: int) -> list[list[str]]:
    """Reply texts of every kind (valid-looking, occupied, garbage, missing, over-long), blind to the board."""
    games = []
    for _ in range(n):
        game = []
        for _ in range(MAX_TURNS):
            kind = rng.choices(["cell", "garbage", "missing", "long"], [0.7, 0.1, 0.1, 0.1])[0]
            think = rng.choice(["<think>Centre is strongest.</think>", "<think>I must block.</think>\n", ""])
            if kind == "cell":
                game.append(f"{think}<move>{rng.randrange(9)}</move>")
            elif kind == "garbage":
                game.append(f"{think}<move>{rng.choice(['10', 'x', '', '4 5', '-1', ' 3 '])}</move>")
            elif kind == "missing":
                game.append(rng.choice(["I play 4.", "<think>hmm</think>", "<move 4>", "move: 3"]))
            else:
                game.append(rng.choice([f"<move>{rng.randrange(9)}</move>", ""]) + " and then " * 12)
        games.append(game)
    return games


def trajectory_arrays(prefix: str, traj) -> dict[str, np.ndarray]:
    traj = jax.device_get(traj)
    fields = {
        "tokens": traj.tokens, "length": traj.length, "loss_mask": traj.loss_mask, "logprobs": traj.logprobs,
        "reply_lengths": traj.reply_lengths, "reply_format": traj.reply_format, "reply_moves": traj.reply_moves,
        "reply_truncated": traj.reply_truncated, "turns": traj.turns, "outcome": traj.outcome,
        "invalid_moves": traj.invalid_moves, "missing_moves": traj.missing_moves, "format_score": traj.format_score,
        "win_reward": traj.win_reward, "invalid_reward": traj.invalid_reward, "reward": traj.reward,
        "context_cut": traj.context_cut,
    }
    return {f"{prefix}/{k}": np.asarray(v) for k, v in fields.items()}


def main() -> None:
    tok = load_tokenizer()
    out: dict[str, np.ndarray] = {}

    # 1. Scripted rollout, reference preset.
    tables = text.build_text_tables(tok, text.PRESETS["reference"])
    rng = random.Random(2026)
    n = 128
    seeds = np.array([rng.randrange(2**32) for _ in range(n)], np.uint32)
    probs = np.array([rng.choice([0.0, 0.3, 0.7, 1.0]) for _ in range(n)], np.float32)
    reply_tokens, reply_lengths = ro.script_replies(tok, scripted_replies(rng, n), MAX_TURNS, MAX_NEW)
    policy = ro.scripted_policy(reply_tokens, reply_lengths, tables.eos_id)
    config = ro.RolloutConfig(context_length=CONTEXT, sampling=sampling.SamplingConfig(max_new_tokens=MAX_NEW))
    traj = jax.jit(lambda s, p, k: ro.rollout(policy, None, None, None, tables, s, p, k, config))(
        jnp.asarray(seeds), jnp.asarray(probs), jax.random.PRNGKey(0))
    out.update(trajectory_arrays("scripted", traj))
    out["scripted/seeds"], out["scripted/probs"] = seeds, probs
    out["scripted/reply_tokens"], out["scripted/reply_lengths_in"] = np.asarray(reply_tokens), np.asarray(reply_lengths)

    # 2. A fixed random tiny model: sampled (compact, tiny; cache stages), greedy (tiny).
    model_config = dataclasses.replace(PRESETS["tiny"], vocab_size=len(tok))
    module = Lfm2ForCausalLM(model_config)
    params = module.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]
    seeds = jnp.asarray(np.repeat(np.arange(8), 4), jnp.uint32)
    probs = jnp.asarray(np.tile([0.0, 0.5, 1.0, 0.25], 8), jnp.float32)
    cases = {
        "model_compact": ("compact", sampling.SamplingConfig(temperature=1.0, max_new_tokens=12), 448, 8, 1),
        "model_tiny_staged": ("tiny", sampling.SamplingConfig(temperature=1.25, max_new_tokens=16), 448, 7, 3),
        "model_tiny_greedy": ("tiny", sampling.SamplingConfig(greedy=True, max_new_tokens=16), 448, 8, 1),
    }
    for name, (preset, sconf, context, turns, stages) in cases.items():
        tab = text.build_text_tables(tok, text.PRESETS[preset])
        rc = ro.RolloutConfig(context_length=context, sampling=sconf, env=ttt.EnvParams(max_turns=turns),
                              cache_stages=stages)
        run = ro.make_rollout(sampling.lfm2_model_fn(module), lambda b, m: init_cache(model_config, b, m), tab, rc)
        out.update(trajectory_arrays(name, run(params, seeds, probs, jax.random.PRNGKey(3))))
    out["model/seeds"], out["model/probs"] = np.asarray(seeds), np.asarray(probs)

    np.savez_compressed(HERE / "tictactoe.npz", **out)

    # 3. SFT rows of the CPU preset's teacher and the tree; 4. the committed checkpoint's evaluation.
    from jaxrl_llm import sft
    from jaxrl_llm.config import load_config
    from jaxrl_llm.sft_data import exhaustive_expert_games, games_to_rows
    from jaxrl_llm.train import build, evaluate, policy_params

    config = load_config(ROOT / "experiments" / "presets" / "cpu.toml")
    c = config.sft
    scfg = sft.SftConfig(steps=c.steps, batch_size=c.batch_size, seq_len=c.seq_len, num_games=c.num_games,
                         teacher_random_move_prob=c.teacher_random_move_prob, teacher=c.teacher,
                         reasoning=c.reasoning, tree_copies=c.tree_copies,
                         opponent_p_min=c.opponent_p_range()[0], opponent_p_max=c.opponent_p_range()[1],
                         preset=config.prompt.preset, max_turns=config.env.max_turns, optim=c.optim)
    rows = sft.make_sft_dataset(scfg, jax.random.fold_in(jax.random.PRNGKey(config.run.seed), 1)).to_list()
    tree = games_to_rows(exhaustive_expert_games(), "tiny", reasoning="none")

    def digest(items) -> str:
        return hashlib.sha256(json.dumps(items, sort_keys=True).encode()).hexdigest()

    comp = build(config)
    ckpt = policy_params(config, comp, str(ROOT / "experiments" / "checkpoints" / "cpu"))
    results = evaluate(comp, ckpt)
    summary = {
        "sft_rows": len(rows), "sft_rows_sha256": digest(rows), "tree_rows": len(tree),
        "tree_rows_sha256": digest(tree), "committed_checkpoint_eval": results,
    }
    (HERE / "tictactoe.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
