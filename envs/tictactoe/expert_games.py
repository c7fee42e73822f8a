"""Tic-Tac-Toe teachers' games on device: `expert_games_device` plays many games at once (`jit` + `vmap` over
games, `lax.scan` over the model's turns) with the game's own `reset` / `step`, X a teacher (`teachers.teacher_move`)
and O the game's opponent at a per-game p drawn uniformly in the teacher's opponent range. Per model turn it
records the board before the move, the move, whether the teacher explored, the move's kind and the state that
the next environment message renders (`ExpertGames`); `generate_expert_games` is its checked host wrapper.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from envs.tictactoe import game as ttt
from envs.tictactoe.teachers import MAX_MODEL_MOVES, TEACHERS, move_kind, teacher_move


class ExpertGames(NamedTuple):
    """A batch of N expert games (device or NumPy arrays; T = MAX_MODEL_MOVES model turns).

    Turn t's entries are meaningful where `t < num_moves`; later ones are -1 / 0 / False.
    """

    seed: Any  # uint32[N]       the game's seed (first mover, opponent's draws)
    random_move_prob: Any  # float32[N]  the opponent's p
    first_board: Any  # int8[N, 9]      board of the first user message (O's opening if O started)
    first_status: Any  # int8[N]        its status (STATUS_START_*)
    first_last_opp: Any  # int8[N]      its last opponent move (-1: none)
    boards: Any  # int8[N, T, 9]        board before X's t-th move
    moves: Any  # int32[N, T]           X's t-th move (-1 after the game ended)
    kinds: Any  # int8[N, T]            MOVE_* of that move (-1 after the end)
    explored: Any  # bool[N, T]         the teacher took a random move instead of an optimal one
    after_boards: Any  # int8[N, T, 9]  board of the env message after move t (O's reply included)
    statuses: Any  # int8[N, T]         its status
    last_opp: Any  # int8[N, T]         its last opponent move
    num_moves: Any  # int32[N]          X's moves in the game
    outcome: Any  # int8[N]             OUTCOME_*
    teacher_random_move_prob: Any  # float32[N]  the teacher's exploration probability


def _play_one(state: ttt.State, uniform: jax.Array, bits: jax.Array, teacher_p: jax.Array, max_turns: int,
              teacher: str = "uniform"):
    """One game from its reset state: scan over the model's turns (a finished game stays unchanged; turns
    from `max_turns` on are not played). uniform f32[T], bits uint32[T]: the teacher's random numbers."""

    def turn(state, inputs):
        rand_u, rand_b, t = inputs
        live = ~state.done & (t < max_turns)
        move, explored = teacher_move(state.board, rand_u, rand_b, teacher_p, teacher)
        kind = move_kind(state.board, move)
        new = jax.tree.map(lambda a, b: jnp.where(live, a, b), ttt.step(state, move), state)
        record = (
            state.board,
            jnp.where(live, move, -1),
            jnp.where(live, kind, -1).astype(jnp.int8),
            live & explored,
            new.board,
            new.status,
            new.last_opponent_move,
        )
        return new, record

    steps = jnp.arange(uniform.shape[0], dtype=jnp.int32)
    final, rec = jax.lax.scan(turn, state, (uniform, bits, steps))
    num_moves = (rec[1] >= 0).sum().astype(jnp.int32)
    return final, rec, num_moves


@functools.partial(jax.jit, static_argnames=("num_games", "max_turns", "teacher"))
def expert_games_device(key: jax.Array, num_games: int, teacher_random_move_prob: jax.Array, p_min: jax.Array,
                        p_max: jax.Array, max_turns: int = 8, teacher: str = "uniform") -> ExpertGames:
    """Play `num_games` teacher-vs-opponent games on device -> ExpertGames of device arrays.

    key: PRNG key; teacher_random_move_prob, p_min, p_max: f32[] (traced: no recompile when they change);
    the opponent's p of each game is uniform in [p_min, p_max]. Static num_games, max_turns (the teacher's
    replies at most; a game still going then is unfinished) and teacher ("uniform" or "best", see
    `teacher_move`)."""
    k_seed, k_p, k_uniform, k_bits = jax.random.split(key, 4)
    seeds = jax.random.bits(k_seed, (num_games,), jnp.uint32)
    p = jax.random.uniform(k_p, (num_games,), jnp.float32, minval=p_min, maxval=p_max)
    p = jnp.clip(p, p_min, p_max)
    uniform = jax.random.uniform(k_uniform, (num_games, MAX_MODEL_MOVES), jnp.float32)
    bits = jax.random.bits(k_bits, (num_games, MAX_MODEL_MOVES), jnp.uint32)
    start = jax.vmap(ttt.reset)(seeds, p)
    teacher_p = jnp.asarray(teacher_random_move_prob, jnp.float32)
    final, rec, num_moves = jax.vmap(_play_one, in_axes=(0, 0, 0, None, None, None))(
        start, uniform, bits, teacher_p, max_turns, teacher)
    boards, moves, kinds, explored, after_boards, statuses, last_opp = rec
    return ExpertGames(
        seed=seeds, random_move_prob=start.random_move_prob, first_board=start.board,
        first_status=start.status, first_last_opp=start.last_opponent_move, boards=boards, moves=moves,
        kinds=kinds, explored=explored, after_boards=after_boards, statuses=statuses, last_opp=last_opp,
        num_moves=num_moves, outcome=final.outcome,
        teacher_random_move_prob=jnp.broadcast_to(teacher_p, (num_games,)),
    )


def _check_prob(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    if not 0.0 <= float(value) <= 1.0:  # also rejects NaN
        raise ValueError(f"{name} must lie in [0, 1], got {value!r}")
    return float(value)


def check_p_range(opponent_p_range: Sequence[float]) -> tuple[float, float]:
    """Validate an opponent p range (p_min, p_max) with 0 <= p_min <= p_max <= 1; raises ValueError."""
    try:
        p_min, p_max = opponent_p_range
    except (TypeError, ValueError):
        raise ValueError(f"opponent_p_range must be a pair (p_min, p_max), got {opponent_p_range!r}") from None
    p_min, p_max = _check_prob("opponent p_min", p_min), _check_prob("opponent p_max", p_max)
    if p_min > p_max:
        raise ValueError(f"opponent_p_range needs p_min <= p_max, got ({p_min}, {p_max})")
    return p_min, p_max


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def generate_expert_games(key: jax.Array, num_games: int, *, teacher_random_move_prob: float = 0.0,
                          opponent_p_range: Sequence[float] = (0.0, 1.0), max_turns: int = 8,
                          teacher: str = "uniform") -> ExpertGames:
    """Host wrapper: validate the arguments, play on device, return ExpertGames of NumPy arrays (all games)."""
    _check_choice("teacher", teacher, TEACHERS)
    if isinstance(num_games, bool) or not isinstance(num_games, (int, np.integer)) or num_games < 1:
        raise ValueError(f"num_games must be an int >= 1, got {num_games!r}")
    teacher_p = _check_prob("teacher_random_move_prob", teacher_random_move_prob)
    p_min, p_max = check_p_range(opponent_p_range)
    games = expert_games_device(key, int(num_games), jnp.float32(teacher_p), jnp.float32(p_min),
                                jnp.float32(p_max), int(max_turns), teacher)
    return ExpertGames(*(np.asarray(x) for x in jax.device_get(games)))
