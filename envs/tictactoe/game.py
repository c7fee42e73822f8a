"""Tic-Tac-Toe against a minimax opponent, the game alone: pure, jittable, vmappable JAX functions.

The model plays X, the opponent O. One call of `step` consumes one model reply (a parsed move) and,
when the game goes on, applies the opponent's deterministic reply, so the model is always the side to
move in a live `State`. Rules, randomness and the difficulty sampler follow `shared/TICTACTOE_SPEC.md`;
the text, the rubric and the protocol around this module are in `envs/tictactoe/env.py` (the
`envs/tictactoe` section of `docs/CONTRACTS.md`). There is no turn limit here: the rollout ends a game
after `max_turns` replies.

- Board: `int8[9]`, cells row-major, `EMPTY`/`X`/`O` = 0/1/2.
- The minimax table (every board x player to move) is built once by a jitted retrograde sweep
  (`build_minimax_table`) and closed over; lookups are O(1) gathers.
- The opponent's reply is a pure function of (seed, board after the model's move, p): with probability
  p a uniformly random free cell, else a uniform draw among ALL minimax-optimal moves. Its random
  words are those of jax.random.fold_in(PRNGKey(seed), salt * 2^18 + board bits), computed by an
  inlined threefry block that matches JAX's bit for bit.
- The readable rules (`winner` with its table of 8 lines, `legal_moves`, `board_index`) define the
  game and build the tables; `step` runs the same rules on bitboards (an int32 mask of cells per
  player) so a step costs one reduction over the board and a few integer ops and table reads.
- Speed notes (XLA:CPU, batched): a reduction or a gather ends a fusion and is computed once, while
  plain elementwise values get recomputed in every fusion that reads them, for a `[batch, 9]`
  output once per cell. So `step` routes what the board write needs through small table reads
  (`x_cell`, the pick), `reset` does not redo its hashes per cell (the opening is one table read),
  and a pass over `[batch, 9]` (the reduction, the write) is the costly part of a step.

Example, 4 096 games at once::

    import jax, jax.numpy as jnp
    from envs import tictactoe as ttt

    seeds = jnp.arange(4096, dtype=jnp.uint32)
    p = jnp.full((4096,), 0.5, jnp.float32)
    state = jax.jit(jax.vmap(ttt.reset))(seeds, p)
    moves = jnp.argmax(ttt.legal_moves(state.board), axis=-1)       # int32[4096]: first free cell
    state = jax.jit(jax.vmap(ttt.step))(state, moves)

Malformed input inside jit has a defined result (nothing raises under jit):
- a move other than -1..8 is an invalid reply (counted in `invalid_moves`, board unchanged);
- a board with a cell outside 0..2, |#X - #O| > 1, or three-in-a-row for both players fails
  `valid_board`; `step` then counts any tagged reply as invalid (a `NO_MOVE` reply stays a missing
  move), the opponent does not move, and the game never ends by itself. The same holds for a
  not-done State whose board already holds a line (only a hand-built State can); `winner`, `legal_moves`,
  `board_index` stay defined on such boards (out-of-range cells count as occupied and are clipped to
  0..2 in the index); `optimal_moves` is all False, `minimax_value` 0, `opponent_move` -1;
- a `player` other than X or O gives no optimal moves and value 0;
- `random_move_prob` is clipped to [0, 1] (NaN acts as 0).
Host-side arguments (Python/NumPy seeds and probabilities, sampler ranges) are
checked eagerly and raise ValueError.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from envs.prng import fold_in_words


# ---------------------------------------------------------------------------------------------------
# Constants (see docs/CONTRACTS.md)

EMPTY, X, O = 0, 1, 2

STATUS_START_MODEL_FIRST = 0  # "Game started. You are X."
STATUS_START_OPP_FIRST = 1  # "Game started. Opponent (O) played at position {k}."
STATUS_OPP_MOVED = 2  # "Opponent (O) played at position {k}."
STATUS_INVALID = 3  # "Invalid move."
STATUS_NO_MOVE = 4  # "Please provide a move inside <move>...</move> tags."
STATUS_WIN = 5  # "You win!"  (final)
STATUS_DRAW = 6  # "It's a draw!"  the model's move filled the board (final)
STATUS_LOSS = 7  # "Opponent (O) played at position {k}. You lose!"  (final)
STATUS_OPP_DRAW = 8  # "Opponent (O) played at position {k}. It's a draw!"  (final)
NUM_STATUS = 9

OUTCOME_ONGOING, OUTCOME_WIN, OUTCOME_DRAW, OUTCOME_LOSS = 0, 1, 2, 3
OUTCOME_NAMES = {OUTCOME_ONGOING: "ongoing", OUTCOME_WIN: "win", OUTCOME_DRAW: "draw", OUTCOME_LOSS: "loss"}

NO_MOVE = -1  # parser result: no <move> tag in the reply
INVALID_MOVE = 9  # parser result: a tag whose content is not a cell 0..8

NUM_CELLS = 9
NUM_BOARDS = 3**NUM_CELLS  # 19 683

# The 8 winning lines, row-major cells.
LINES = np.array(
    [[0, 1, 2], [3, 4, 5], [6, 7, 8], [0, 3, 6], [1, 4, 7], [2, 5, 8], [0, 4, 8], [2, 4, 6]],
    dtype=np.int32,
)
POW3 = (3 ** np.arange(NUM_CELLS)).astype(np.int32)  # cell 0 is the least significant digit

# Salts of the key derivation, distinct for the first-mover draw and the move draws: a draw reads the
# two words of fold_in(PRNGKey(seed), salt * 2^18 + board) (the board as 18 bits of X and O cells).
_SALT_FIRST_MOVER = 1
_SALT_MOVE = 2


# ---------------------------------------------------------------------------------------------------
# State


class State(NamedTuple):
    """One game (a pytree; for a batch every field gains a leading axis)."""

    board: jax.Array  # int8[9]: 0 empty, 1 X, 2 O
    to_play: jax.Array  # int8[]: 1 model to move, 0 when done
    turns: jax.Array  # int32[]: model replies consumed (valid, invalid and missing)
    invalid_moves: jax.Array  # int32[]: replies with a tag that is not a free cell
    missing_moves: jax.Array  # int32[]: replies without a <move> tag
    done: jax.Array  # bool[]
    outcome: jax.Array  # int8[]: OUTCOME_*
    last_opponent_move: jax.Array  # int8[]: -1 before the opponent has moved
    status: jax.Array  # int8[]: STATUS_* of the next environment message
    seed: jax.Array  # uint32[]: the example's seed
    random_move_prob: jax.Array  # float32[]: p of the opponent's mixture


# ---------------------------------------------------------------------------------------------------
# Rules


def winner(board: jax.Array) -> jax.Array:
    """int8[9] board -> int8[]: 0 no line, 1 X has three in a row, 2 O has (X is checked first)."""
    lines = board[..., LINES]  # [..., 8, 3]
    x_won = (lines == X).all(-1).any(-1)
    o_won = (lines == O).all(-1).any(-1)
    return jnp.where(x_won, jnp.int8(X), jnp.where(o_won, jnp.int8(O), jnp.int8(EMPTY)))


def legal_moves(board: jax.Array) -> jax.Array:
    """int8[9] board -> bool[9]: the free cells (does not look at whether the game is over)."""
    return board == EMPTY


def board_index(board: jax.Array) -> jax.Array:
    """int8[9] board -> int32[] in [0, 3^9): base 3, cell 0 least significant (cells clipped to 0..2)."""
    digits = jnp.clip(board.astype(jnp.int32), EMPTY, O)
    return (digits * POW3).sum(-1)


# Bitboards: bit c of an int32 is cell c. They make the per-move checks of `step` a few integer ops.
_FULL = (1 << NUM_CELLS) - 1
_LINE_MASKS = tuple(sum(1 << int(c) for c in line) for line in LINES)
_CELL_BITS = 1 << np.arange(NUM_CELLS, dtype=np.int32)


def _compact(bits: jax.Array) -> jax.Array:
    """int32[] with a bit at each even position 0, 2, .., 16 -> those 9 bits side by side."""
    bits = (bits | (bits >> 1)) & 0x33333333
    bits = (bits | (bits >> 2)) & 0x0F0F0F0F
    bits = (bits | (bits >> 4)) & 0x00FF00FF
    return (bits | (bits >> 8)) & 0x0000FFFF


_EVEN = sum(1 << (2 * c) for c in range(NUM_CELLS))


def _bitboards(board: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """int8[9] -> (X cells int32[], O cells int32[], every cell in 0..2 bool[]), from one reduction.

    Each cell becomes a 2-bit field (its value, 3 for anything outside 0..2: the unsigned minimum
    with 3), packed by one sum of cheap terms; X cells are the fields 1, O cells the fields 2 (exact
    on any board), and a field 3 marks a cell out of range.
    """
    fields = jnp.minimum(board.astype(jnp.uint8), jnp.uint8(3)).astype(jnp.int32)
    packed = (fields << (2 * np.arange(NUM_CELLS, dtype=np.int32))).sum(-1)
    low, high = packed & _EVEN, (packed >> 1) & _EVEN
    return _compact(low & ~high), _compact(high & ~low), (low & high) == 0


def _line_table() -> np.ndarray:
    """-> bool[512]: entry m is whether the cells of bit mask m hold one of the 8 lines."""
    masks = np.arange(1 << NUM_CELLS)[:, None]
    lines = np.array(_LINE_MASKS)[None, :]
    return ((masks & lines) == lines).any(1)


_HAS_LINE = _line_table()


def _has_line(bits: jax.Array) -> jax.Array:
    """int32[] cells of one player -> bool[]: three in a row (`winner` on a bit mask; a table read)."""
    return jnp.asarray(_HAS_LINE)[bits & _FULL]


def _consistent(xs: jax.Array, os: jax.Array) -> jax.Array:
    """Bitboards -> bool[]: disjoint, |#X - #O| <= 1, and not both players with a line."""
    diff = jax.lax.population_count(xs) - jax.lax.population_count(os)
    return ((xs & os) == 0) & (jnp.abs(diff) <= 1) & ~(_has_line(xs) & _has_line(os))


def _index_of(xs: jax.Array, os: jax.Array) -> jax.Array:
    """Bitboards -> int32[] board_index (elementwise, no reduction)."""
    index = jnp.zeros(jnp.shape(xs), jnp.int32)
    for cell in range(NUM_CELLS):
        digit = ((xs >> cell) & 1) + 2 * ((os >> cell) & 1)
        index = index + digit * int(POW3[cell])
    return index


def _cells_of(bits: jax.Array) -> jax.Array:
    """int32[] 9-bit mask -> bool[9]."""
    return ((bits[..., None] >> np.arange(NUM_CELLS, dtype=np.int32)) & 1) == 1


def is_finished(board: jax.Array) -> jax.Array:
    """int8[9] board -> bool[]: someone has three in a row or no cell is free."""
    return (winner(board) != EMPTY) | ~legal_moves(board).any(-1)


def valid_board(board: jax.Array) -> jax.Array:
    """int8[9] board -> bool[]: cells in 0..2, |#X - #O| <= 1 and not both players with a line."""
    xs, os, in_range = _bitboards(board)
    return in_range & _consistent(xs, os)


@functools.lru_cache(maxsize=1)
def terminal_tables() -> tuple[np.ndarray, np.ndarray]:
    """(winner int8[3^9], full bool[3^9]) of every board (row `board_index`), from the game's own `winner`
    and `legal_moves` (computed once, concretely, even when first asked for inside a trace)."""
    boards = ((np.arange(NUM_BOARDS)[:, None] // POW3) % 3).astype(np.int8)
    with jax.ensure_compile_time_eval():
        won = np.asarray(jax.vmap(winner)(jnp.asarray(boards)))
        full = ~np.asarray(jax.vmap(legal_moves)(jnp.asarray(boards))).any(1)
    return won, full



# ---------------------------------------------------------------------------------------------------
# Minimax table


def _all_boards() -> tuple[jax.Array, jax.Array]:
    """-> (index int32[3^9], board int8[3^9, 9]): every board, in index order."""
    index = jnp.arange(NUM_BOARDS, dtype=jnp.int32)
    return index, ((index[:, None] // POW3) % 3).astype(jnp.int8)


def _children(index: jax.Array, free: jax.Array) -> jax.Array:
    """int32[B], bool[B, 9] -> int32[B, 2, 9]: the index after X (row 0) or O (row 1) takes a cell."""
    players = jnp.array([X, O], jnp.int32)
    return jnp.where(free[:, None, :], index[:, None, None] + players[None, :, None] * POW3, 0)


@jax.jit
def build_minimax_table() -> jax.Array:
    """-> int8[3^9, 2]: depth-weighted minimax score for the player to move (column 0 X, 1 O).

    Scores for the player to move: a win for them +(1 + free cells), a loss -(1 + free cells) at the
    end of the game, a draw 0; negamax over the free cells. Retrograde analysis vectorized over all
    boards: the child of index b after player q takes cell c is b + q * 3^c; 9 sweeps (the longest
    game) make every entry exact. Defined for every board, reachable or not.
    """
    index, boards = _all_boards()
    free = legal_moves(boards)  # [B, 9]
    magnitude = (1 + free.sum(-1, dtype=jnp.int32))[:, None]
    won_by = winner(boards)[:, None]
    players = jnp.array([X, O], jnp.int8)
    # Terminal score for the player to move (columns: X, O).
    terminal = ((won_by != EMPTY) | ~free.any(-1, keepdims=True))
    terminal_score = jnp.where(won_by == EMPTY, 0, jnp.where(won_by == players, magnitude, -magnitude))
    children, other = _children(index, free), 1 - jnp.arange(2)[None, :, None]

    def sweep(_, score):
        # score[child, other]: the opponent's score after our move; ours is its negation.
        best = jnp.where(free[:, None, :], -score[children, other], -100).max(-1)
        return jnp.where(terminal, terminal_score, best)

    score = jax.lax.fori_loop(0, NUM_CELLS, sweep, terminal_score.astype(jnp.int32))
    return score.astype(jnp.int8)


@jax.jit
def build_optimal_table(score: jax.Array) -> jax.Array:
    """int8[3^9, 2] scores -> int32[3^9, 2]: bit c set when cell c is optimal for the player to move
    (column 0 X, 1 O); no bit on a finished board."""
    index, boards = _all_boards()
    free = legal_moves(boards)
    child_score = -score[_children(index, free), 1 - jnp.arange(2)[None, :, None]].astype(jnp.int32)
    optimal = free[:, None, :] & (child_score == score[:, :, None]) & ~is_finished(boards)[:, None, None]
    return (optimal.astype(jnp.int32) * _CELL_BITS).sum(-1)


@functools.lru_cache(maxsize=None)
def _tables() -> tuple[jax.Array, jax.Array]:
    """The cached (score int8[3^9, 2], optimal int32[3^9, 2]) tables, built once on first use."""
    with jax.ensure_compile_time_eval():  # concrete even when first called inside a trace
        score = build_minimax_table()
        optimal = build_optimal_table(score)
    return score, optimal


def minimax_table() -> jax.Array:
    """-> int8[3^9, 2]: the cached score table (row board_index, column player - 1)."""
    return _tables()[0]


def _player_column(player: jax.Array) -> tuple[jax.Array, jax.Array]:
    player = jnp.asarray(player, jnp.int32)
    return jnp.clip(player - 1, 0, 1), (player == X) | (player == O)


def minimax_score(board: jax.Array, player: jax.Array) -> jax.Array:
    """int8[9] board, int player to move (1 X / 2 O) -> int8[]: the depth-weighted score for player.

    0 on a malformed board (see `valid_board`) or for a player other than 1 or 2.
    """
    column, ok = _player_column(player)
    score = minimax_table()[board_index(board), column]
    return jnp.where(ok & valid_board(board), score, jnp.int8(0))


def minimax_value(board: jax.Array, player: jax.Array) -> jax.Array:
    """int8[9] board, int player to move -> int8[]: +1 win / 0 draw / -1 loss under perfect play."""
    return jnp.sign(minimax_score(board, player)).astype(jnp.int8)


def optimal_moves(board: jax.Array, player: jax.Array) -> jax.Array:
    """int8[9] board, int player to move -> bool[9]: every move maximizing the depth-weighted score.

    All False on a finished or malformed board, or for a player other than 1 or 2.
    """
    column, ok = _player_column(player)
    bits = _tables()[1][board_index(board), column]
    return _cells_of(bits) & ok & valid_board(board)


# ---------------------------------------------------------------------------------------------------
# Deterministic randomness and the opponent

# uint32[] seed, uint32[] data -> the two uint32[] words of fold_in(PRNGKey(seed), data): one Threefry
# block per draw, written out as uint32 ops so XLA fuses it with the game logic (`envs.prng`; a test
# checks it against jax.random.fold_in).
_draw = fold_in_words


def _move_data(xs: jax.Array, os: jax.Array) -> jax.Array:
    """Bitboards -> uint32[]: the fold_in data of a move draw, SALT_MOVE * 2^18 + X + O * 2^9."""
    return ((_SALT_MOVE << 18) | xs | (os << NUM_CELLS)).astype(jnp.uint32)


def _nth_cell_table() -> np.ndarray:
    """-> int32[512 * 9]: entry mask * 9 + r is the r-th (0-based) set cell of mask, -1 if fewer."""
    table = np.full((1 << NUM_CELLS, NUM_CELLS), -1, np.int32)
    for mask in range(1 << NUM_CELLS):
        cells = [c for c in range(NUM_CELLS) if mask >> c & 1]
        table[mask, : len(cells)] = cells
    return table.reshape(-1)


_NTH_CELL = _nth_cell_table()


def _pick(bits: jax.Array, word: jax.Array) -> jax.Array:
    """int32[] 9-bit mask, uint32[] random word -> int32[]: a uniform set cell, -1 if none.

    r = floor(u * #set) for u the top 24 bits of the word as a fraction in [0, 1) (a multiply and a
    shift instead of an integer division), then the r-th set cell comes from a 512 x 9 table. Being a
    gather, it also makes XLA compute the reply once instead of re-running the hash in every fusion
    that reads it.
    """
    count = jax.lax.population_count(bits).astype(jnp.uint32)
    r = (((word >> jnp.uint32(8)) * count) >> jnp.uint32(24)).astype(jnp.int32)
    return jnp.asarray(_NTH_CELL)[bits * NUM_CELLS + r]


def _reply(xs: jax.Array, os: jax.Array, live: jax.Array, seed: jax.Array, random_move_prob: jax.Array):
    """O's reply on the board given as bitboards (see `opponent_move`); -1 where not `live`."""
    free = ~(xs | os) & _FULL
    words = _draw(seed, _move_data(xs, os))
    uniform = (words[0] >> jnp.uint32(8)).astype(jnp.float32) * (1.0 / (1 << 24))  # in [0, 1)
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
# Reset and step


def reset(seed: jax.Array, random_move_prob: jax.Array) -> State:
    """uint32[] seed, f32[] p -> State with the model to move.

    The first mover is a fair draw from fold_in(PRNGKey(seed), SALT_FIRST_MOVER * 2^18). If the
    opponent starts, it plays its opening with the usual mixture on the empty board
    (STATUS_START_OPP_FIRST), else STATUS_START_MODEL_FIRST. Concrete seeds outside [0, 2^32) or p
    outside [0, 1] raise ValueError.
    """
    _check_seed_host(seed)
    _check_prob_host("random_move_prob", random_move_prob)
    seed = jnp.asarray(seed, jnp.uint32)
    p = jnp.clip(jnp.asarray(random_move_prob, jnp.float32), 0.0, 1.0)
    opponent_first = (_draw(seed, _SALT_FIRST_MOVER << 18)[0] >> jnp.uint32(31)) == 1
    # The opening is `_reply` on the empty board: every cell is free, so the mixture's two sides are
    # the constant masks below (equal when every opening is optimal) and only the pick draws.
    words = _draw(seed, _move_data(jnp.int32(0), jnp.int32(0)))
    optimal = int(np.asarray(_tables()[1])[0, O - 1])
    if optimal == _FULL:
        bits = jnp.int32(_FULL)
    else:
        uniform = (words[0] >> jnp.uint32(8)).astype(jnp.float32) * (1.0 / (1 << 24))
        bits = jnp.where(uniform < p, _FULL, optimal)
    # -1 unless the opponent starts; a gather, so what follows reads it without redoing the hashes.
    opening = _pick(jnp.where(opponent_first, bits, 0), words[1])
    cells = np.arange(NUM_CELLS, dtype=np.int32)
    board = jnp.where(cells == opening, jnp.int8(O), jnp.int8(EMPTY))
    return State(
        board=board,
        to_play=jnp.int8(1),
        turns=jnp.int32(0),
        invalid_moves=jnp.int32(0),
        missing_moves=jnp.int32(0),
        done=jnp.bool_(False),
        outcome=jnp.int8(OUTCOME_ONGOING),
        last_opponent_move=opening.astype(jnp.int8),
        status=jnp.where(opening >= 0, STATUS_START_OPP_FIRST, STATUS_START_MODEL_FIRST).astype(jnp.int8),
        seed=seed,
        random_move_prob=p,
    )


# Entry cell | placed << 4: the cell X's piece goes to, NUM_CELLS (off the board) when not placed.
_X_CELL = np.where(np.arange(32) >> 4 == 1, np.arange(32) & 15, NUM_CELLS).astype(np.int32)


def _first_true(cases: list[tuple[jax.Array, int]], default: int) -> jax.Array:
    """int8[]: the value of the first true condition, else default (nested selects)."""
    out = jnp.int8(default)
    for condition, value in reversed(cases):
        out = jnp.where(condition, jnp.int8(value), out)
    return out


def step(state: State, move: jax.Array) -> State:
    """State, int32[] move from the parser -> State after the reply (and O's answer).

    move -1: a missing move (missing_moves += 1, STATUS_NO_MOVE). A move outside 0..8, an occupied
    cell, or any tagged move on a malformed or already decided board: invalid (invalid_moves += 1, STATUS_INVALID, board
    unchanged, no opponent move). A legal move places X, then ends the game (WIN / DRAW) or lets O
    reply (LOSS / OPP_DRAW / OPP_MOVED). Every reply counts a turn. A done state is returned unchanged.

    The rules run on bitboards (`_has_line` is `winner` on a bit mask), so a step is one reduction
    over the board, a few small table reads (lines, X's cell, optimal replies, the pick), one
    inlined threefry block and one elementwise write of the board.
    """
    move = jnp.asarray(move, jnp.int32)
    turns = state.turns + 1
    xs, os, in_range = _bitboards(state.board)
    # A live game's board is valid and has no line yet; on any other board no move is legal.
    # (`_consistent` minus its both-lines test, implied by the no-line test; the lines as mask tests,
    # which fuse with their neighbours instead of being table reads of their own.)
    diff = jax.lax.population_count(xs) - jax.lax.population_count(os)
    any_line = functools.reduce(jnp.logical_or, [((xs & m) == m) | ((os & m) == m) for m in _LINE_MASKS])
    usable = in_range & ((xs & os) == 0) & (jnp.abs(diff) <= 1) & ~any_line

    missing = move == NO_MOVE
    on_board = (move >= 0) & (move < NUM_CELLS)
    cell_bit = jnp.left_shift(1, jnp.clip(move, 0, NUM_CELLS - 1))
    legal = on_board & usable & (((xs | os) & cell_bit) == 0)
    invalid = ~missing & ~legal

    # The model's move.
    xs = jnp.where(legal, xs | cell_bit, xs)
    x_won = legal & _has_line(xs)
    x_filled = legal & ~x_won & ((xs | os) == _FULL)
    opp_turn = legal & ~x_won & ~x_filled

    # The opponent's reply (computed for every game, applied where the game goes on; -1 for a done
    # game too, whose other fields are the old ones below).
    live = ~state.done
    reply = _reply(xs, os, opp_turn & live, state.seed, state.random_move_prob)  # -1 where O does not move
    os = jnp.where(opp_turn, os | jnp.left_shift(1, jnp.clip(reply, 0, NUM_CELLS - 1)), os)
    o_won = opp_turn & _has_line(os)
    o_filled = opp_turn & ~o_won & ((xs | os) == _FULL)

    # The board: X's cell (NUM_CELLS for none) comes from a table read and O's is the reply (also a
    # table read, -1 for none), so the elementwise write over the 9 cells does not redo the checks.
    x_cell = jnp.asarray(_X_CELL)[jnp.clip(move, 0, NUM_CELLS - 1) | ((legal & live).astype(jnp.int32) << 4)]
    cells = np.arange(NUM_CELLS, dtype=np.int32)
    board = jnp.where(cells == x_cell, jnp.int8(X), jnp.where(cells == reply, jnp.int8(O), state.board))
    status = _first_true(
        [(missing, STATUS_NO_MOVE), (invalid, STATUS_INVALID), (x_won, STATUS_WIN), (x_filled, STATUS_DRAW),
         (o_won, STATUS_LOSS), (o_filled, STATUS_OPP_DRAW)],
        STATUS_OPP_MOVED,
    )  # fmt: skip
    done = x_won | x_filled | o_won | o_filled
    outcome = _first_true(
        [(x_won, OUTCOME_WIN), (x_filled | o_filled, OUTCOME_DRAW), (o_won, OUTCOME_LOSS)], OUTCOME_ONGOING
    )  # fmt: skip

    new = State(
        board=board,
        to_play=jnp.where(done, 0, 1).astype(jnp.int8),
        turns=turns,
        invalid_moves=state.invalid_moves + invalid.astype(jnp.int32),
        missing_moves=state.missing_moves + missing.astype(jnp.int32),
        done=done,
        outcome=outcome,
        last_opponent_move=jnp.where(opp_turn, reply, state.last_opponent_move).astype(jnp.int8),
        status=status,
        seed=state.seed,
        random_move_prob=state.random_move_prob,
    )
    merged = jax.tree.map(lambda old, upd: jnp.where(state.done, old, upd), state, new)
    return merged._replace(board=board)  # the write above already leaves a done board alone


# ---------------------------------------------------------------------------------------------------
# The two halves of a step, for a person playing the opponent (`jaxrl-llm play`)


def model_move(state: State, move: jax.Array) -> State:
    """State, int32[] move -> the model's reply applied alone, without the opponent's answer.

    The same rules as the first half of `step` (missing, invalid, X's move, win or draw); a legal move
    that leaves the game open gives status STATUS_OPP_MOVED with the opponent still to move, which
    `opponent_move_applied` then makes. `step(s, m)` equals `opponent_move_applied(model_move(s, m),
    opponent_move(...))` whenever the game goes on (a test checks it). A done state comes back unchanged.
    """
    move = jnp.asarray(move, jnp.int32)
    cell = jnp.clip(move, 0, NUM_CELLS - 1)
    missing = move == NO_MOVE
    legal = ((move >= 0) & (move < NUM_CELLS) & valid_board(state.board) & ~is_finished(state.board)
             & (state.board[cell] == EMPTY))
    board = jnp.where(legal, state.board.at[cell].set(jnp.int8(X)), state.board)
    won = legal & (winner(board) == X)
    filled = legal & ~won & ~legal_moves(board).any()
    status = _first_true([(missing, STATUS_NO_MOVE), (~legal, STATUS_INVALID), (won, STATUS_WIN),
                          (filled, STATUS_DRAW)], STATUS_OPP_MOVED)
    done = won | filled
    new = state._replace(
        board=board, to_play=jnp.where(done, 0, 1).astype(jnp.int8), turns=state.turns + 1,
        invalid_moves=state.invalid_moves + (~missing & ~legal).astype(jnp.int32),
        missing_moves=state.missing_moves + missing.astype(jnp.int32), done=done,
        outcome=_first_true([(won, OUTCOME_WIN), (filled, OUTCOME_DRAW)], OUTCOME_ONGOING), status=status,
    )
    return jax.tree.map(lambda old, upd: jnp.where(state.done, old, upd), state, new)


def opponent_move_applied(state: State, cell: jax.Array) -> State:
    """State after a legal model move that left the game open, int32[] cell for O -> the state after O's
    move (status OPP_MOVED, LOSS or OPP_DRAW; last_opponent_move = cell). The cell must be free."""
    cell = jnp.asarray(cell, jnp.int32)
    board = state.board.at[jnp.clip(cell, 0, NUM_CELLS - 1)].set(jnp.int8(O))
    lost = winner(board) == O
    filled = ~lost & ~legal_moves(board).any()
    done = lost | filled
    return state._replace(
        board=board, to_play=jnp.where(done, 0, 1).astype(jnp.int8), done=done,
        outcome=_first_true([(lost, OUTCOME_LOSS), (filled, OUTCOME_DRAW)], OUTCOME_ONGOING),
        last_opponent_move=cell.astype(jnp.int8),
        status=_first_true([(lost, STATUS_LOSS), (filled, STATUS_OPP_DRAW)], STATUS_OPP_MOVED),
    )


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
