"""The Connect Four teacher for SFT: search games played on device, rendered as prompt/completion rows on the host.

X, the model's side, is the game's own search (`game.best_columns` at the teacher's depth; among the best
columns a uniform draw from the game's seed and the board, or with `tie_break = "center"` the best columns
nearest the centre column 3, a uniform draw only between 3 - d and 3 + d) and, with probability `explore_prob`, a
uniformly random legal column; O is the game's opponent (`game.step`) with p uniform in
[opponent_p_min, opponent_p_max] and the teacher's `opponent_depth`. One `lax.scan` step is one model turn
(`jit` + `vmap` over games). Lost and unfinished games are dropped. A row is one whole game in the
conversational layout of `jaxrl_llm.data` (system prompt, every environment message of `envs.connect_four.text`,
every reply `<think></think><move>c</move>`), with `info` {seed, random_move_prob, depth, moves, outcome}.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from envs.connect_four import game, text
from jaxrl_base.checks import ConfigError, check_int, check_probability

MAX_MODEL_MOVES = 21  # X makes at most 21 moves (42 cells)
_SALT_TEACHER = 7


def reply_text(column: int) -> str:
    """The teacher's reply for `column`."""
    return f"<think></think><move>{int(column)}</move>"


TIE_BREAKS = ("uniform", "center")
CENTER = (game.COLUMNS - 1) // 2


def nearest_center(allowed: jax.Array) -> jax.Array:
    """bool[7] -> bool[7]: the allowed columns at the smallest distance from the centre column."""
    distance = jnp.abs(jnp.arange(game.COLUMNS, dtype=jnp.int32) - CENTER)
    nearest = jnp.where(allowed, distance, game.COLUMNS).min()
    return allowed & (distance == nearest)


def teacher_move(state: game.State, depth: int, explore_prob: float, max_depth: int,
                 tie_break: str = "uniform") -> jax.Array:
    """X's move in a live state (int32[]): a best column of a depth-`depth` search (ties: see the module
    docstring), or with probability explore_prob a uniform legal column; words from (seed, board)."""
    key = jax.random.fold_in(jax.random.PRNGKey(state.seed), _SALT_TEACHER)
    for w in (*state.x, *state.o):
        key = jax.random.fold_in(key, w)
    words = jax.random.bits(key, (2,), jnp.uint32)
    best = game.best_columns(state.x, state.o, jnp.int32(depth), max_depth)
    if tie_break == "center":
        best = nearest_center(best)
    legal = game.legal_columns(state.x, state.o)
    explore = game._uniform(words[0]) < explore_prob
    return jnp.maximum(game.pick(jnp.where(explore, legal, best), words[1]), 0)


@functools.partial(jax.jit, static_argnames=("num", "depth", "explore_prob", "p_min", "p_max", "opponent_depth",
                                             "max_depth", "tie_break"))
def play_games(key, num: int, depth: int, explore_prob: float, p_min: float, p_max: float, opponent_depth: int,
               max_depth: int, tie_break: str = "uniform"):
    """`num` teacher games -> (first State, per-turn moves int32[num, 21], per-turn States after each reply).

    Turn t's entries are meaningful while the game was live before it (moves -1 after the end)."""
    k_seed, k_p = jax.random.split(key)
    seeds = jax.random.bits(k_seed, (num,), jnp.uint32)
    probs = jax.random.uniform(k_p, (num,), jnp.float32, p_min, p_max)
    depths = jnp.full((num,), opponent_depth, jnp.int32)
    first = jax.vmap(game.reset, (0, 0, 0, None))(seeds, probs, depths, max_depth)

    def turn(state, _):
        move = jax.vmap(teacher_move, (0, None, None, None, None))(state, depth, explore_prob, max_depth, tie_break)
        move = jnp.where(state.done, -1, move)
        new = jax.vmap(game.step, (0, 0, None))(state, move, max_depth)
        return new, (move, new)

    _, (moves, after) = jax.lax.scan(turn, first, None, length=MAX_MODEL_MOVES)
    return first, moves.T, jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), after)


def _board(x, o) -> np.ndarray:
    return np.asarray(jax.device_get(game.cells(jnp.asarray(x), jnp.asarray(o)))).astype(int)


def games_to_rows(first, moves, after, preset: str) -> list[dict]:
    """Host: the won and drawn games as rows (see the module docstring)."""
    p = text.PRESETS[preset]
    first, moves, after = jax.device_get((first, moves, after))
    boards_first = np.asarray(jax.vmap(game.cells)(jnp.asarray(first.x), jnp.asarray(first.o)))
    n, t = moves.shape
    boards_after = np.asarray(jax.vmap(jax.vmap(game.cells))(jnp.asarray(after.x), jnp.asarray(after.o)))
    system = text.system_prompt(p)
    rows = []
    for i in range(n):
        num = int((moves[i] >= 0).sum())
        outcome = int(after.outcome[i, num - 1])
        if not bool(after.done[i, num - 1]) or outcome == game.OUTCOME_LOSS:
            continue
        prompt = [{"role": "system", "content": system},
                  {"role": "user", "content": text.render_message(p, boards_first[i], int(first.status[i]),
                                                                  int(first.last_opponent_move[i]))}]
        completion = []
        for j in range(num):
            completion.append({"role": "assistant", "content": reply_text(moves[i, j])})
            completion.append({"role": "user", "content": text.render_message(
                p, boards_after[i, j], int(after.status[i, j]), int(after.last_opponent_move[i, j]))})
        rows.append({"prompt": prompt, "completion": completion,
                     "info": {"seed": int(first.seed[i]), "random_move_prob": float(first.random_move_prob[i]),
                              "depth": int(first.depth[i]), "moves": [int(m) for m in moves[i, :num]],
                              "outcome": game.OUTCOME_NAMES[outcome]}})
    return rows


@dataclasses.dataclass(frozen=True)
class Teacher:
    """Connect Four SFT data (the `[sft.teacher]` table): `num_games` games of the search teacher.

    depth: the teacher's search depth (1..MAX_DEPTH); explore_prob: how often it plays a random legal column
    instead; the opponent plays at p uniform in [opponent_p_min, opponent_p_max] with search depth
    opponent_depth. Both depths must be <= the env's max_depth (checked when the rows are made). tie_break:
    "uniform" (any best column) or "center" (the best columns nearest column 3: a lower-entropy target)."""

    num_games: int = 2000
    depth: int = 4
    explore_prob: float = 0.0
    opponent_p_min: float = 0.0
    opponent_p_max: float = 1.0
    opponent_depth: int = 2
    tie_break: str = "uniform"

    def __post_init__(self) -> None:
        check_int(self, "num_games", 1)
        check_int(self, "depth", 1, game.MAX_DEPTH)
        check_int(self, "opponent_depth", 1, game.MAX_DEPTH)
        check_probability(self, "explore_prob")
        check_probability(self, "opponent_p_min")
        check_probability(self, "opponent_p_max")
        if self.tie_break not in TIE_BREAKS:
            raise ConfigError(f"must be one of {TIE_BREAKS} (got {self.tie_break!r})", ("tie_break",), "Teacher")
        if self.opponent_p_min > self.opponent_p_max:
            raise ConfigError(f"must be <= opponent_p_max (got {self.opponent_p_min} > {self.opponent_p_max})",
                              ("opponent_p_min",), "Teacher")

    def rows(self, key: jax.Array, preset: str, max_depth: int) -> list[dict]:
        for name in ("depth", "opponent_depth"):
            if getattr(self, name) > max_depth:
                raise ConfigError(f"is {getattr(self, name)}, above the env's max_depth {max_depth}; raise "
                                  "env.params.max_depth or lower it", (name,), "Teacher")
        out = play_games(key, self.num_games, self.depth, float(self.explore_prob), float(self.opponent_p_min),
                         float(self.opponent_p_max), self.opponent_depth, max_depth, self.tie_break)
        return games_to_rows(*out, preset)
