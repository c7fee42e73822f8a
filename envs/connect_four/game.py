"""Connect Four against a depth-limited negamax opponent, the game alone: pure, jittable, vmappable JAX.

The standard game: 6 rows x 7 columns, a piece dropped into a column lands on the lowest free cell, four in
a row (horizontal, vertical or diagonal) wins, a full board is a draw. The model plays X, the opponent O.
One call of `step` consumes one model reply (a parsed column) and, when the game goes on, applies the
opponent's reply, so the model is always the side to move in a live `State`. There is no turn limit
here (the rollout ends a game after `max_turns` replies); the text and the protocol around this module
are `envs/connect_four/text.py` and `env.py`.

Bitboards. A position is two bitboards, one per player, each `uint32[2]` (42 cells do not fit one 32-bit
word; JAX has no 64-bit integers by default). The cells are column-major, 6 bits a column from the
bottom: column c < 5 lives in word 0 at bits 6c .. 6c + 5, column c >= 5 in word 1 at bits 6(c - 5) ..
(`cell_bit`). Dropping a piece is one addition per word: (occupied + bottom bit of c) & column mask of c
is the landing cell (0 when the column is full: the carry leaves the column's mask). Each of the 69
lines of four is a pair of constant masks (`LINE_MASKS`), so a line's piece count is two popcounts and
a win test two compares: the rules and the search are elementwise integer ops, no gathers.

The opponent (`opponent_move`, deterministic per (seed, board, p) and the search depth): with
probability p a uniformly random legal column, else a uniform draw among the best columns of a
full-width negamax search of `depth` plies (1 .. `max_depth`; `search_values`). The search is a fixed-shape
tree: level L holds 7^L nodes (illegal ones masked), so it is vmappable and its cost is that of
`max_depth` whatever the per-game depth (a traced value; the levels below it are computed and unused).
Alpha-beta would return the same root values but prunes data-dependently, which buys nothing when
every lane of a SIMD batch evaluates the whole tree anyway.

Values, from the side to move at a node:
  - the previous mover connected four at ply L of the search (L = 1 at the root's children): L - WIN
    (the winner prefers the fastest win, the loser the slowest loss);
  - a full board without a line: 0 (draw);
  - at the horizon (ply == depth): the open-line evaluation `evaluate`: over the 69 lines of four, a
    line holding k >= 1 pieces of one side and none of the other scores 4^(k-1) (1, 4, 16 for one,
    two, three pieces) for that side; the value is the side to move's total minus the other's;
  - otherwise the negamax of the legal children: max over columns of -value(child).
The random words are fold_in(PRNGKey(seed), salt) folded with the four board words (`_words`), so every
game of a group that reaches the same board meets the same reply, and p only sets the threshold.

Example, 4 096 games at once::

    import jax, jax.numpy as jnp
    from envs.connect_four import game as c4

    n = 4096
    state = jax.jit(jax.vmap(c4.reset, (0, 0, 0, None)), static_argnums=3)(
        jnp.arange(n, dtype=jnp.uint32), jnp.full(n, 0.5), jnp.full(n, 2, jnp.int32), 4)
    moves = jnp.argmax(jax.vmap(c4.legal_columns)(state.x, state.o), axis=-1)   # the first free column
    state = jax.jit(jax.vmap(c4.step, (0, 0, None)), static_argnums=2)(state, moves, 4)

Malformed input inside jit has a defined result (nothing raises under jit): a move other than -1..6 or
into a full column is an invalid reply (counted, board unchanged, no opponent move); a hand-built State
whose bitboards overlap or hold a line is "not live" and every tagged reply on it is invalid.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from envs.core import keep_finished
from envs.prng import pick_set_bit, unit_float

ROWS, COLUMNS = 6, 7
NUM_CELLS = ROWS * COLUMNS
MAX_DEPTH = 5  # the deepest search a Params may compile (7^5 = 16 807 leaves a move)
EMPTY, X, O = 0, 1, 2

# Status of the message a state shows (same ids as Tic-Tac-Toe's; 5..8 end the game).
(STATUS_START_MODEL_FIRST, STATUS_START_OPP_FIRST, STATUS_OPP_MOVED, STATUS_INVALID, STATUS_NO_MOVE,
 STATUS_WIN, STATUS_DRAW, STATUS_LOSS, STATUS_OPP_DRAW) = range(9)
NUM_STATUS = 9
FIRST_FINAL_STATUS = STATUS_WIN
OUTCOME_ONGOING, OUTCOME_WIN, OUTCOME_DRAW, OUTCOME_LOSS = 0, 1, 2, 3
OUTCOME_NAMES = {OUTCOME_ONGOING: "ongoing", OUTCOME_WIN: "win", OUTCOME_DRAW: "draw", OUTCOME_LOSS: "loss"}
NO_MOVE, INVALID_MOVE = -1, COLUMNS  # move codes of a parsed reply: no tag, a tag without a column 0..6

WIN = 1 << 20  # a decided game's value magnitude (far above any open-line evaluation, at most 69 * 16)
NEG = -(1 << 30)  # the value of an illegal move

_SALT_FIRST_MOVER, _SALT_MOVE = 1, 2


# ---------------------------------------------------------------------------------------------------
# The board layout (constants built once on the host)


def cell_bit(row: int, col: int) -> tuple[int, int]:
    """(word, bit) of the cell at `row` (0 = bottom) and `col` (0 = left)."""
    if not (0 <= row < ROWS and 0 <= col < COLUMNS):
        raise ValueError(f"cell ({row}, {col}) is off the {ROWS} x {COLUMNS} board")
    return (0, 6 * col + row) if col < 5 else (1, 6 * (col - 5) + row)


def _lines() -> list[list[tuple[int, int]]]:
    """The 69 lines of four as (row, col) cells: horizontal, vertical, diagonal up-right, up-left."""
    lines = []
    for dr, dc in ((0, 1), (1, 0), (1, 1), (1, -1)):
        for r in range(ROWS):
            for c in range(COLUMNS):
                cells = [(r + k * dr, c + k * dc) for k in range(4)]
                if all(0 <= rr < ROWS and 0 <= cc < COLUMNS for rr, cc in cells):
                    lines.append(cells)
    return lines


LINES = _lines()


def _masks(cells) -> np.ndarray:
    out = np.zeros(2, np.uint32)
    for r, c in cells:
        w, b = cell_bit(r, c)
        out[w] |= np.uint32(1 << b)
    return out


LINE_MASKS = np.stack([_masks(line) for line in LINES])  # uint32[69, 2]
COLUMN_MASKS = np.stack([_masks([(r, c) for r in range(ROWS)]) for c in range(COLUMNS)])  # uint32[7, 2]
BOTTOM = np.stack([_masks([(0, c)]) for c in range(COLUMNS)])  # uint32[7, 2]
FULL = COLUMN_MASKS.sum(0, dtype=np.uint32)  # uint32[2]: every cell
CELL_WORD = np.array([[cell_bit(r, c)[0] for c in range(COLUMNS)] for r in range(ROWS)], np.int32)  # [6, 7]
CELL_SHIFT = np.array([[cell_bit(r, c)[1] for c in range(COLUMNS)] for r in range(ROWS)], np.uint32)  # [6, 7]
assert len(LINES) == 69 and int(FULL[0]) == (1 << 30) - 1 and int(FULL[1]) == (1 << 12) - 1


def _u32(a) -> jax.Array:
    return jnp.asarray(a, jnp.uint32)


# ---------------------------------------------------------------------------------------------------
# Rules on bitboards (any leading batch shape; the last axis is the two words)


def drop_bits(occupied: jax.Array) -> jax.Array:
    """uint32[..., 2] occupied cells -> uint32[..., 7, 2]: the landing cell of each column (0 if full)."""
    occ = _u32(occupied)[..., None, :]
    return (occ + _u32(BOTTOM)) & _u32(COLUMN_MASKS)


def legal_columns(x: jax.Array, o: jax.Array) -> jax.Array:
    """uint32[..., 2] X and O bitboards -> bool[..., 7]: the columns that are not full."""
    drops = drop_bits(_u32(x) | _u32(o))
    return (drops[..., 0] | drops[..., 1]) != 0


def line_counts(bits: jax.Array) -> jax.Array:
    """uint32[..., 2] one player's bitboard -> int32[..., 69]: that player's pieces on each line of four."""
    b = _u32(bits)[..., None, :] & _u32(LINE_MASKS)
    return jax.lax.population_count(b).astype(jnp.int32).sum(-1)


def has_four(bits: jax.Array) -> jax.Array:
    """uint32[..., 2] one player's bitboard -> bool[...]: four of its pieces on a line."""
    b = _u32(bits)[..., None, :]
    return ((b & _u32(LINE_MASKS)) == _u32(LINE_MASKS)).all(-1).any(-1)


def is_full(x: jax.Array, o: jax.Array) -> jax.Array:
    """bool[...]: no free cell left."""
    return ((_u32(x) | _u32(o)) == _u32(FULL)).all(-1)


def play(mover: jax.Array, other: jax.Array, column: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One ply: uint32[2] bitboards of the side to move and the other, int32[] column ->
    (the mover's new bitboard, bool[] legal). An illegal column (full, or outside 0..6) leaves it as is."""
    column = jnp.asarray(column, jnp.int32)
    drops = drop_bits(_u32(mover) | _u32(other))  # [7, 2]
    on_board = (column >= 0) & (column < COLUMNS)
    bit = jnp.where(on_board, drops[jnp.clip(column, 0, COLUMNS - 1)], _u32(0))
    legal = on_board & ((bit[0] | bit[1]) != 0)
    return _u32(mover) | bit, legal


def cells(x: jax.Array, o: jax.Array) -> jax.Array:
    """uint32[2] X and O bitboards -> int8[6, 7]: EMPTY / X / O, row 0 at the bottom."""
    xw = (_u32(x)[jnp.asarray(CELL_WORD)] >> _u32(CELL_SHIFT)) & 1
    ow = (_u32(o)[jnp.asarray(CELL_WORD)] >> _u32(CELL_SHIFT)) & 1
    return jnp.where(xw == 1, jnp.int8(X), jnp.where(ow == 1, jnp.int8(O), jnp.int8(EMPTY)))


def from_cells(board) -> tuple[np.ndarray, np.ndarray]:
    """int[6, 7] cells (row 0 at the bottom; 0 empty, 1 X, 2 O) -> (X, O) uint32[2] bitboards (host)."""
    board = np.asarray(board)
    if board.shape != (ROWS, COLUMNS):
        raise ValueError(f"a board is {ROWS} x {COLUMNS} cells, got shape {board.shape}")
    x, o = np.zeros(2, np.uint32), np.zeros(2, np.uint32)
    for r in range(ROWS):
        for c in range(COLUMNS):
            w, b = cell_bit(r, c)
            if board[r, c] == X:
                x[w] |= np.uint32(1 << b)
            elif board[r, c] == O:
                o[w] |= np.uint32(1 << b)
            elif board[r, c] != EMPTY:
                raise ValueError(f"cell ({r}, {c}) holds {board[r, c]}; cells are 0 (empty), 1 (X), 2 (O)")
    return x, o


def heights(x: jax.Array, o: jax.Array) -> jax.Array:
    """int32[..., 7]: pieces in each column."""
    occ = (_u32(x) | _u32(o))[..., None, :] & _u32(COLUMN_MASKS)
    return jax.lax.population_count(occ).astype(jnp.int32).sum(-1)


# ---------------------------------------------------------------------------------------------------
# Evaluation and search


def _line_value(k: jax.Array) -> jax.Array:
    """Integer piece count k (any int dtype) -> 4^(k-1) for k >= 1, 0 for k = 0 (1, 4, 16, 64)."""
    return jnp.left_shift(jnp.ones_like(k), 2 * k) >> 2


def _evaluate_counts(mine: jax.Array, theirs: jax.Array) -> jax.Array:
    """int32[..., 69] line counts of the side to move and the other -> int32[...]: the open-line value."""
    own = jnp.where(theirs == 0, _line_value(mine), 0).sum(-1)
    their = jnp.where(mine == 0, _line_value(theirs), 0).sum(-1)
    return own - their


def evaluate(to_move: jax.Array, other: jax.Array) -> jax.Array:
    """uint32[..., 2] bitboards of the side to move and the other -> int32[...]: the open-line evaluation
    (see the module docstring) from the side to move's point of view."""
    return _evaluate_counts(line_counts(to_move), line_counts(other))


def _planes(bits: jax.Array) -> jax.Array:
    """uint32[2] bitboard -> int8[6, 7]: 1 where the player has a piece (row 0 at the bottom)."""
    return ((_u32(bits)[jnp.asarray(CELL_WORD)] >> _u32(CELL_SHIFT)) & 1).astype(jnp.int8)


def _direction_sums(p: jax.Array) -> tuple[jax.Array, ...]:
    """int8[6, 7, m] piece planes -> the pieces on every line of four, per direction: horizontal [6, 4, m],
    vertical [3, 7, m], diagonal up-right [3, 4, m], up-left [3, 4, m] (69 lines in all)."""
    horizontal = p[:, 0:4] + p[:, 1:5] + p[:, 2:6] + p[:, 3:7]
    vertical = p[0:3] + p[1:4] + p[2:5] + p[3:6]
    up_right = p[0:3, 0:4] + p[1:4, 1:5] + p[2:5, 2:6] + p[3:6, 3:7]
    up_left = p[0:3, 3:7] + p[1:4, 2:6] + p[2:5, 1:5] + p[3:6, 0:4]
    return horizontal, vertical, up_right, up_left


# The cells of the line starting at (r, c) in each direction are (r + k*dr, c + k*dc), k = 0..3; a line
# sum array of a direction is indexed by its start (up-left lines start at columns 3..6).
_DIRECTIONS = ((0, 1), (1, 0), (1, 1), (1, -1))
_WIN_FLAG = 256  # added to a line's gain when a piece on it completes four (other gains sum below 256)


def _to_cells(per_line: jax.Array, direction: int) -> jax.Array:
    """A direction's per-line values [rows, cols, m] (indexed by line start) -> [6, 7, m]: at each cell the
    sum over the lines of that direction through it (one pad, then four shifted slices)."""
    dr, dc = _DIRECTIONS[direction]
    r0, c0 = per_line.shape[0], per_line.shape[1]
    first_col = 3 if dc < 0 else 0
    padded = jnp.pad(per_line, ((3, ROWS - r0), (3 + first_col, COLUMNS + 3 - first_col - c0), (0, 0)))
    out = 0
    for k in range(4):
        out = out + padded[3 - k * dr: 3 - k * dr + ROWS, 3 - k * dc: 3 - k * dc + COLUMNS]
    return out


def _line_facts(mine: jax.Array, theirs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Planes int8[6, 7, m] of the side to move and the other -> (int32[m] the open-line evaluation for the
    side to move, int16[6, 7, m] the gain map: what a piece of the side to move on each empty cell adds to
    that evaluation, plus _WIN_FLAG per line of four it would complete).

    A line with c own and e enemy pieces scores w(c) when e = 0 and -w(e) when c = 0 (w(k) = 4^(k-1),
    w(0) = 0). An own piece on it adds w(c + 1) - w(c) when e = 0 and w(e) when c = 0 (it kills the
    enemy's line), nothing otherwise. A cell lies on at most 16 lines, so the gains without flags stay
    below 16 * 16 = 256 (a line with c = 3 is flagged: its gain no longer matters)."""
    value = jnp.zeros(mine.shape[-1], jnp.int32)
    gain = 0
    for d, (c, e) in enumerate(zip(_direction_sums(mine), _direction_sums(theirs))):
        c, e = c.astype(jnp.int16), e.astype(jnp.int16)
        wc, we = _line_value(c), _line_value(e)
        value = value + (jnp.where(e == 0, wc, 0) - jnp.where(c == 0, we, 0)).sum((0, 1), dtype=jnp.int32)
        own = _line_value(c + 1) - wc + jnp.where(c == 3, jnp.int16(_WIN_FLAG), jnp.int16(0))
        gain = gain + _to_cells(jnp.where(e == 0, own, jnp.where(c == 0, we, 0)).astype(jnp.int16), d)
    return value, gain


def search_values(to_move: jax.Array, other: jax.Array, depth: jax.Array, max_depth: int) -> jax.Array:
    """Negamax root values: uint32[2] bitboards (side to move, other), int32[] depth in 1..max_depth
    (traced), static max_depth -> int32[7]: the value of each column for the side to move (NEG if
    illegal; all NEG on a finished board). See the module docstring for the values.

    The tree is laid out for SIMD: a level's nodes are the last axis of int8 piece planes [6, 7, nodes],
    node j's child in column c at j * 7 + c, so every line sum is a slice add over whole node vectors.
    A child's facts (won, evaluation) come from its parent's per-cell gains (`_line_facts`), so the
    deepest level is never laid out as planes: the search costs about one evaluation per inner node."""
    if not isinstance(max_depth, int) or not 1 <= max_depth <= MAX_DEPTH:
        raise ValueError(f"max_depth must be an int in 1..{MAX_DEPTH}, got {max_depth!r}")
    depth = jnp.clip(jnp.asarray(depth, jnp.int32), 1, max_depth)
    to_move, other = _u32(to_move), _u32(other)
    root_live = ~has_four(to_move) & ~has_four(other) & ~is_full(to_move, other) & ((to_move & other) == 0).all()
    # tm: the side to move at each node, jm: the side that just moved; h: column heights [7, nodes].
    tm, jm = _planes(to_move)[..., None], _planes(other)[..., None]
    h, live = heights(to_move, other)[:, None], root_live[None]
    rows = jnp.arange(ROWS, dtype=jnp.int32)[:, None, None]
    moves = jnp.arange(COLUMNS, dtype=jnp.int32)
    value_here = None
    levels = []  # per level 1..max_depth: (legal, terminal, terminal value, horizon value)
    for level in range(1, max_depth + 1):
        n = tm.shape[-1]
        value_tm, gain = _line_facts(tm, jm)
        value_here = value_tm if value_here is None else value_here
        at = rows == h[None]  # [6, 7, n]: the landing cell of each column
        child_gain = jnp.where(at, gain, 0).sum(0, dtype=jnp.int32)  # [7, n]
        child_won = child_gain >= _WIN_FLAG
        legal = (live[None] & (h < ROWS)).T.reshape(-1)  # [n * 7], child j * 7 + c
        won = child_won.T.reshape(-1)
        horizon = -(value_here[:, None] + child_gain.T).reshape(-1)  # for the side to move at the child
        new_h = (h[:, :, None] + (moves[:, None, None] == moves[None, None, :])).reshape(COLUMNS, n * COLUMNS)
        terminal = won | (new_h >= ROWS).all(0)
        value_terminal = jnp.where(won, jnp.int32(level - WIN), jnp.int32(0))
        levels.append((legal, terminal, value_terminal, horizon))
        if level < max_depth:
            piece = ((moves[None, :, None, None] == moves) & (rows[..., None] == h.T[None, None])).astype(jnp.int8)
            new_jm = (tm[..., None] | piece).reshape(ROWS, COLUMNS, n * COLUMNS)
            tm, jm = jnp.broadcast_to(jm[..., None], piece.shape).reshape(ROWS, COLUMNS, n * COLUMNS), new_jm
            h, live, value_here = new_h, legal & ~terminal, horizon
    value = None
    for level in range(max_depth, 0, -1):
        legal, terminal, value_terminal, horizon = levels[level - 1]
        if value is None:
            inner = horizon
        else:  # the children's negamax (`value` holds level + 1's values)
            child = jnp.where(levels[level][0], -value, NEG).reshape(-1, COLUMNS)
            inner = jnp.where(level >= depth, horizon, child.max(-1))
        value = jnp.where(terminal, value_terminal, inner)
    return jnp.where(levels[0][0], -value, NEG).astype(jnp.int32)


def best_columns(to_move: jax.Array, other: jax.Array, depth: jax.Array, max_depth: int) -> jax.Array:
    """bool[7]: the columns of maximal search value (all False on a finished board)."""
    values = search_values(to_move, other, depth, max_depth)
    return (values == values.max()) & (values > NEG)


# ---------------------------------------------------------------------------------------------------
# Deterministic randomness and the opponent


def _words(seed: jax.Array, salt: int, board: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """uint32[2] random words of fold_in(PRNGKey(seed), salt), folded with the board's four words."""
    key = jax.random.fold_in(jax.random.PRNGKey(jnp.asarray(seed, jnp.uint32)), salt)
    if board is not None:
        for w in (*_u32(board[0]), *_u32(board[1])):
            key = jax.random.fold_in(key, w)
    return jax.random.bits(key, (2,), jnp.uint32)


def pick(allowed: jax.Array, word: jax.Array) -> jax.Array:
    """bool[7] allowed columns, uint32[] random word -> int32[]: a uniform allowed column, -1 if none
    (`envs.prng.pick_set_bit` on the columns' mask)."""
    mask = (jnp.asarray(allowed, jnp.int32) << jnp.arange(COLUMNS, dtype=jnp.int32)).sum()
    return pick_set_bit(mask, word, COLUMNS)


_uniform = unit_float  # uint32 word -> f32 in [0, 1)


def opponent_move(x: jax.Array, o: jax.Array, seed: jax.Array, random_move_prob: jax.Array, depth: jax.Array,
                  max_depth: int) -> jax.Array:
    """O's reply: uint32[2] bitboards, uint32[] seed, f32[] p, int32[] depth, static max_depth -> int32[] column.

    With probability p a uniformly random legal column, else a uniform draw among `best_columns` of a
    depth-`depth` search; -1 on a finished board. A pure function of (seed, board, p, depth)."""
    words = _words(seed, _SALT_MOVE, (x, o))
    p = jnp.clip(jnp.asarray(random_move_prob, jnp.float32), 0.0, 1.0)
    best = best_columns(o, x, depth, max_depth)
    legal = legal_columns(x, o) & best.any()  # none on a finished board
    return pick(jnp.where(_uniform(words[0]) < p, legal, best), words[1])


# ---------------------------------------------------------------------------------------------------
# The game state, reset and step


class State(NamedTuple):
    """One game (batched: a leading axis on every field)."""

    x: jax.Array  # uint32[2] the model's pieces
    o: jax.Array  # uint32[2] the opponent's pieces
    turns: jax.Array  # int32 replies consumed
    invalid_moves: jax.Array  # int32
    missing_moves: jax.Array  # int32
    done: jax.Array  # bool
    outcome: jax.Array  # int8 OUTCOME_*
    last_opponent_move: jax.Array  # int8 column, -1 none
    status: jax.Array  # int8 STATUS_* of the message this state shows
    seed: jax.Array  # uint32
    random_move_prob: jax.Array  # float32
    depth: jax.Array  # int32 the opponent's search depth


def _first_true(cases, default: int) -> jax.Array:
    out = jnp.int8(default)
    for condition, value in reversed(cases):
        out = jnp.where(condition, jnp.int8(value), out)
    return out


def reset(seed: jax.Array, random_move_prob: jax.Array, depth: jax.Array, max_depth: int) -> State:
    """uint32[] seed, f32[] p, int32[] depth, static max_depth -> State with the model to move.

    The first mover is a fair draw from fold_in(PRNGKey(seed), 1); if the opponent starts, it plays its
    usual mixture on the empty board (STATUS_START_OPP_FIRST), else STATUS_START_MODEL_FIRST."""
    seed = _u32(seed)
    p = jnp.clip(jnp.asarray(random_move_prob, jnp.float32), 0.0, 1.0)
    depth = jnp.clip(jnp.asarray(depth, jnp.int32), 1, max_depth)
    opponent_first = (_words(seed, _SALT_FIRST_MOVER)[0] >> 31) == 1
    empty = jnp.zeros(2, jnp.uint32)
    opening = jnp.where(opponent_first, opponent_move(empty, empty, seed, p, depth, max_depth), -1)
    o, _ = play(empty, empty, opening)
    return State(
        x=empty, o=o, turns=jnp.int32(0), invalid_moves=jnp.int32(0), missing_moves=jnp.int32(0),
        done=jnp.bool_(False), outcome=jnp.int8(OUTCOME_ONGOING), last_opponent_move=opening.astype(jnp.int8),
        status=jnp.where(opponent_first, STATUS_START_OPP_FIRST, STATUS_START_MODEL_FIRST).astype(jnp.int8),
        seed=seed, random_move_prob=p, depth=depth,
    )


def live(state: State) -> jax.Array:
    """bool[]: the position can take a move (not done, consistent bitboards, no line, not full)."""
    return (~state.done & ((state.x & state.o) == 0).all() & ~has_four(state.x) & ~has_four(state.o)
            & ~is_full(state.x, state.o))


def model_move(state: State, move: jax.Array) -> State:
    """State, int32[] move -> the model's reply alone (no opponent answer): missing (-1), invalid, or X's
    piece with WIN / DRAW, else status STATUS_OPP_MOVED with O still to move. A done state is unchanged."""
    return keep_finished(state.done, state, _model_rules(state, move))


def _model_rules(state: State, move: jax.Array) -> State:
    """`model_move`'s rules for a game that is not done."""
    move = jnp.asarray(move, jnp.int32)
    missing = move == NO_MOVE
    x, legal = play(state.x, state.o, move)
    legal = legal & live(state)
    x = jnp.where(legal, x, state.x)
    won = legal & has_four(x)
    filled = legal & ~won & is_full(x, state.o)
    return state._replace(
        x=x, turns=state.turns + 1, invalid_moves=state.invalid_moves + (~missing & ~legal).astype(jnp.int32),
        missing_moves=state.missing_moves + missing.astype(jnp.int32), done=won | filled,
        outcome=_first_true([(won, OUTCOME_WIN), (filled, OUTCOME_DRAW)], OUTCOME_ONGOING),
        status=_first_true([(missing, STATUS_NO_MOVE), (~legal, STATUS_INVALID), (won, STATUS_WIN),
                            (filled, STATUS_DRAW)], STATUS_OPP_MOVED),
    )


def opponent_move_applied(state: State, column: jax.Array) -> State:
    """State after a legal model move that left the game open, int32[] column for O -> the state after O's
    move (STATUS_OPP_MOVED, LOSS or OPP_DRAW; last_opponent_move = column). The column must be legal."""
    column = jnp.asarray(column, jnp.int32)
    o, _ = play(state.o, state.x, column)
    lost = has_four(o)
    filled = ~lost & is_full(state.x, o)
    return state._replace(
        o=o, done=lost | filled,
        outcome=_first_true([(lost, OUTCOME_LOSS), (filled, OUTCOME_DRAW)], OUTCOME_ONGOING),
        last_opponent_move=column.astype(jnp.int8),
        status=_first_true([(lost, STATUS_LOSS), (filled, STATUS_OPP_DRAW)], STATUS_OPP_MOVED),
    )


def step(state: State, move: jax.Array, max_depth: int) -> State:
    """State, int32[] move (-1 no tag, 0..6 a column, anything else invalid), static max_depth -> State.

    A missing move counts in missing_moves (STATUS_NO_MOVE); an invalid one (outside 0..6, a full
    column) in invalid_moves (STATUS_INVALID, board unchanged, no opponent move). A legal move drops X,
    then ends the game (WIN / DRAW) or lets O reply (`opponent_move`: LOSS / OPP_DRAW / OPP_MOVED).
    Every reply counts a turn. A done state comes back unchanged (`envs.core.keep_finished`, the protocol's
    one rule for finished games; the rules are `transition`)."""
    return keep_finished(state.done, state, transition(state, move, max_depth))


def transition(state: State, move: jax.Array, max_depth: int) -> State:
    """`step`'s rules for a game that is not done: the model's reply (`model_move`), then O's answer where
    the game goes on."""
    after = _model_rules(state, move)
    opp_turn = after.status == STATUS_OPP_MOVED
    reply = opponent_move(after.x, after.o, state.seed, state.random_move_prob, state.depth, max_depth)
    answered = opponent_move_applied(after, reply)
    return jax.tree.map(lambda a, b: jnp.where(opp_turn, a, b), answered, after)


@functools.partial(jax.jit, static_argnums=(3, 4))
def search_values_batch(to_move, other, depth, max_depth: int, chunk: int = 0):
    """`search_values` vmapped over a leading batch axis (jitted; a helper for tests and benchmarks)."""
    del chunk
    return jax.vmap(search_values, (0, 0, 0, None))(to_move, other, depth, max_depth)
