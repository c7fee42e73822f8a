"""Host helpers around rollouts: scripted replies from text, games read back as text and JSON records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from envs.core import Env
from jaxrl_llm import distributed
from jaxrl_llm.rollout.rollout import Trajectory

REPLY_KINDS = {-1: "not played", 0: "no tag", 1: "invalid", 2: "valid"}


def script_replies(tokenizer, replies: Sequence[Sequence[str]], max_turns: int, max_new_tokens: int,
                   end_turn: bool = True):
    """Reply texts per game and turn -> (int32[B, T, N] tokens, int32[B, T] lengths) for `scripted_policy`.

    Each reply is tokenized as the chat template would (`tokenizer.encode` without special tokens) and,
    with `end_turn`, closed by the end-of-turn token; replies longer than max_new_tokens are cut there
    (as the sampler would cut them, without the end-of-turn token).
    """
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.pad_token_id or 0
    tokens = np.full((len(replies), max_turns, max_new_tokens), pad, np.int32)
    lengths = np.zeros((len(replies), max_turns), np.int32)
    for b, game in enumerate(replies):
        if len(game) > max_turns:
            raise ValueError(f"game {b} has {len(game)} scripted replies but max_turns is {max_turns}")
        for t, reply in enumerate(game):
            ids = tokenizer.encode(reply, add_special_tokens=False) + ([eos] if end_turn else [])
            ids = ids[:max_new_tokens]
            tokens[b, t, : len(ids)] = ids
            lengths[b, t] = len(ids)
    return jnp.asarray(tokens), jnp.asarray(lengths)


def decode_game(tokenizer, trajectory: Trajectory, index: int) -> str:
    """The conversation of game `index` as text, special tokens included (host)."""
    n = int(trajectory.length[index])
    ids = np.asarray(trajectory.tokens[index, :n]).tolist()
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def outcome_label(env: Env, metrics: dict[str, float]) -> str:
    """The name of the first of the env's `outcome_metrics` that is 1 for a game ("" when none is)."""
    return next((name for name in env.outcome_metrics if metrics.get(name, 0.0) >= 0.5), "")


def unsent_message(env: Env, trajectory: Trajectory, index: int) -> str | None:
    """The env's message for game `index`'s final state when the transcript ends before it: the rollout stopped
    the game (its turn limit or the context) after the model's last reply, so the env's answer to that reply
    (the opponent's last move, "Higher.") was never sent. None when the game ended in the env (host)."""
    if not bool(np.asarray(trajectory.truncated)[index]):
        return None
    state = jax.tree_util.tree_map(lambda x: np.asarray(x)[index], trajectory.final_state)
    return env.render_message(state, env.params)


def game_record(env: Env, tokenizer, trajectory: Trajectory, index: int) -> dict[str, Any]:
    """One game as a JSON-ready dict: its example, outcome, reward and parts, metrics, per-turn facts, text
    (`conversation`: what the model saw; `unsent_message`: the env's last message when the rollout stopped the
    game before the model could see it, else None)."""
    turns = int(trajectory.turns[index])
    metrics = {k: float(np.asarray(v)[index]) for k, v in trajectory.metrics.items()}
    example = jax.tree_util.tree_map(lambda x: np.asarray(x)[index], trajectory.examples)
    return {
        "index": int(index),
        **env.example_info(example),
        "outcome": outcome_label(env, metrics),
        "reward": float(trajectory.reward[index]),
        "reward_parts": {k: float(np.asarray(v)[index]) for k, v in trajectory.reward_parts.items()},
        "metrics": metrics,
        "turns": turns,
        "reply_kinds": [REPLY_KINDS[int(k)] for k in np.asarray(trajectory.reply_kind[index, :turns])],
        "reply_values": np.asarray(trajectory.reply_value[index, :turns]).tolist(),
        "reply_lengths": np.asarray(trajectory.reply_lengths[index, :turns]).tolist(),
        "context_cut": bool(trajectory.context_cut[index]),
        "truncated": bool(trajectory.truncated[index]),
        "conversation": decode_game(tokenizer, trajectory, index),
        "unsent_message": unsent_message(env, trajectory, index),
    }


def write_games_jsonl(path: str | Path, env: Env, tokenizer, trajectory: Trajectory,
                      indices: Sequence[int] | None = None, extra: dict[str, Any] | None = None) -> Path:
    """Writes games (default: all) as JSON lines to `path` (each with `extra` merged in); returns the path. In
    a multi-host run every process calls it (the games are gathered) and process 0 alone writes."""
    trajectory = distributed.gather(trajectory)
    if indices is None:
        indices = range(trajectory.tokens.shape[0])
    path = Path(path)
    if not distributed.is_writer():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for i in indices:
            f.write(json.dumps({**(extra or {}), **game_record(env, tokenizer, trajectory, int(i))}) + "\n")
    return path


def games_text(env: Env, tokenizer, trajectory: Trajectory, count: int) -> str:
    """The first `count` games as readable text blocks (a header line each, then the conversation). In a
    multi-host run every process calls it (the games are gathered from every host)."""
    trajectory = distributed.gather(trajectory)
    blocks = []
    for i in range(count):
        r = game_record(env, tokenizer, trajectory, i)
        example = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in
                            env.example_info(jax.tree_util.tree_map(lambda x: np.asarray(x)[i],
                                                                    trajectory.examples)).items())
        last = "" if r["unsent_message"] is None else (f"\n[the rollout stopped the game here; the env's last "
                                                         f"message, not sent to the model:]\n{r['unsent_message']}")
        blocks.append(f"=== game {i}: {r['outcome'] or 'over'}, reward {r['reward']:.3f}, {example}\n"
                      + r["conversation"] + last)
    return "\n\n".join(blocks) + "\n"
