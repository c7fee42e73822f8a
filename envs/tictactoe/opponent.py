"""Tic-Tac-Toe's opponent: a pure function of (seed, board after the model's move, p), and the examples' strengths.

With probability p a uniformly random free cell, else a uniform draw among ALL minimax-optimal moves. Its
random words are those of jax.random.fold_in(PRNGKey(seed), salt * 2^18 + board bits), computed by an inlined
threefry block that matches JAX's bit for bit (`envs.prng`). `stratified_examples` draws the examples' seeds
and opponent strengths p. Host-side arguments (Python/NumPy seeds and probabilities, sampler ranges) are
checked eagerly and raise ValueError; `random_move_prob` is clipped to [0, 1] (NaN acts as 0) inside jit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from envs.prng import fold_in_words, pick_set_bit, unit_float
from envs.tictactoe.minimax import _tables
from envs.tictactoe.rules import NUM_CELLS, O, _FULL, _bitboards, _consistent, _has_line, _index_of

# Salts of the key derivation, distinct for the first-mover draw and the move draws: a draw reads the
# two words of fold_in(PRNGKey(seed), salt * 2^18 + board) (the board as 18 bits of X and O cells).
_SALT_FIRST_MOVER = 1
_SALT_MOVE = 2


# uint32[] seed, uint32[] data -> the two uint32[] words of fold_in(PRNGKey(seed), data): one Threefry
# block per draw, written out as uint32 ops so XLA fuses it with the game logic (`envs.prng`; a test
# checks it against jax.random.fold_in).
_draw = fold_in_words


def _move_data(xs: jax.Array, os: jax.Array) -> jax.Array:
    """Bitboards -> uint32[]: the fold_in data of a move draw, SALT_MOVE * 2^18 + X + O * 2^9."""
    return ((_SALT_MOVE << 18) | xs | (os << NUM_CELLS)).astype(jnp.uint32)


def _pick(bits: jax.Array, word: jax.Array) -> jax.Array:
    """int32[] 9-bit mask, uint32[] random word -> int32[]: a uniform set cell, -1 if none (`envs.prng.pick_set_bit`).

    Being a gather, it also makes XLA compute the reply once instead of re-running the hash in every fusion
    that reads it."""
    return pick_set_bit(bits, word, NUM_CELLS)


def _reply(xs: jax.Array, os: jax.Array, live: jax.Array, seed: jax.Array, random_move_prob: jax.Array):
    """O's reply on the board given as bitboards (see `opponent_move`); -1 where not `live`."""
    free = ~(xs | os) & _FULL
    words = _draw(seed, _move_data(xs, os))
    uniform = unit_float(words[0])  # in [0, 1)
    p = jnp.clip(jnp.asarray(random_move_prob, jnp.float32), 0.0, 1.0)
    optimal = _tables()[1][_index_of(xs, os), O - 1]
    bits = jnp.where(uniform < p, free, optimal)
    return _pick(jnp.where(live, bits, 0), words[1])


def opponent_move(board: jax.Array, seed: jax.Array, random_move_prob: jax.Array) -> jax.Array:
    """int8[9] board (after the model's move), uint32[] seed, f32[] p -> int32[] cell for O.

    With probability p a uniformly random free cell, else a uniform draw among all optimal O moves.
    Its random words are fold_in(PRNGKey(seed), SALT_MOVE * 2^18 + X cells + O cells * 2^9), with
    the board's cells as bit masks, and p only sets the threshold: every game of a group that reaches
    the same board meets the same reply. -1 on a finished or malformed board.
    """
    xs, os, in_range = _bitboards(board)
    live = in_range & _consistent(xs, os) & ~_has_line(xs) & ~_has_line(os) & ((xs | os) != _FULL)
    return _reply(xs, os, live, seed, random_move_prob)


def _check_prob_host(name: str, value: object) -> None:
    """Raise ValueError for a concrete probability outside [0, 1]; traced values pass (clipped later)."""
    if isinstance(value, jax.core.Tracer):
        return
    arr = np.asarray(value, dtype=np.float64)
    if not np.all((arr >= 0.0) & (arr <= 1.0)):  # also rejects NaN
        raise ValueError(f"{name} must lie in [0, 1], got {value!r}")


def _check_seed_host(value: object) -> None:
    if isinstance(value, jax.core.Tracer):
        return
    arr = np.asarray(value)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"seed must be an integer in [0, 2**32), got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 2**32):
        raise ValueError(f"seed must be an integer in [0, 2**32), got {value!r}")


# ---------------------------------------------------------------------------------------------------
# Stratified difficulty


def stratified_examples(
    key: jax.Array, num_prompts: int, group_size: int, p_min: float, p_max: float
) -> tuple[jax.Array, jax.Array]:
    """PRNG key, static ints and floats -> (seeds uint32[num_prompts * group_size], p f32[same]).

    [p_min, p_max] is cut into num_prompts buckets of equal width; prompt i lands in bucket i with
    p = p_min + i * width + uniform(0, width), so a batch holds exactly one example per bucket. Each
    prompt is repeated group_size times consecutively (rows i*group_size .. (i+1)*group_size - 1 share
    seed and p). Seeds are random bits from key. Raises ValueError on bad sizes or ranges.
    """
    for name, value in (("num_prompts", num_prompts), ("group_size", group_size)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    _check_prob_host("p_min", p_min)
    _check_prob_host("p_max", p_max)
    if not isinstance(p_min, jax.core.Tracer) and not isinstance(p_max, jax.core.Tracer):
        if float(p_min) > float(p_max):
            raise ValueError(f"p_min must be <= p_max, got p_min={p_min} > p_max={p_max}")
    seed_key, p_key = jax.random.split(key)
    seeds = jax.random.bits(seed_key, (num_prompts,), jnp.uint32)
    p_min = jnp.asarray(p_min, jnp.float32)
    p_max = jnp.asarray(p_max, jnp.float32)
    width = (p_max - p_min) / num_prompts
    bucket = jnp.arange(num_prompts) % num_prompts
    lower = p_min + bucket * width
    p = lower + jax.random.uniform(p_key, (num_prompts,), jnp.float32) * width
    p = jnp.clip(p, lower, jnp.minimum(lower + width, p_max))  # float rounding stays in the bucket
    return jnp.repeat(seeds, group_size), jnp.repeat(p, group_size)
