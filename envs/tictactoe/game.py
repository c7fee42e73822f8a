"""Tic-Tac-Toe against a minimax opponent, the game alone: pure, jittable, vmappable JAX functions.

The model plays X, the opponent O. One call of `step` consumes one model reply (a parsed move) and,
when the game goes on, applies the opponent's deterministic reply, so the model is always the side to
move in a live `State`. Rules, randomness and the difficulty sampler follow `shared/TICTACTOE_SPEC.md`;
the text, the rubric and the protocol around this module are in `envs/tictactoe/env.py` (the
`envs/tictactoe` section of `docs/CONTRACTS.md`). There is no turn limit here: the rollout ends a game
after `max_turns` replies.

The game is four modules, one job each; this one re-exports the names of the other three:
- `rules`: the board (`int8[9]`, cells row-major, `EMPTY`/`X`/`O` = 0/1/2), the constants, `State`, the
  readable rules (`winner`, `legal_moves`, `board_index`) and their bitboard form;
- `minimax`: the minimax table (every board x player to move), built once by a jitted retrograde sweep and
  closed over; lookups are O(1) gathers;
- `opponent`: the opponent's reply, a pure function of (seed, board after the model's move, p): with
  probability p a uniformly random free cell, else a uniform draw among ALL minimax-optimal moves; and the
  examples' stratified strengths;
- `game` (here): `reset`, `step` (its rules in `transition`) and the two halves of a step for a person
  playing O.
`step` runs the rules on bitboards (an int32 mask of cells per player) so a step costs one reduction over
the board and a few integer ops and table reads.
Speed notes (XLA:CPU, batched): a reduction or a gather ends a fusion and is computed once, while
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

import jax
import jax.numpy as jnp
import numpy as np

from envs.core import keep_finished
from envs.prng import unit_float
from envs.tictactoe.minimax import *  # noqa: F401,F403  (the game's public names, re-exported)
from envs.tictactoe.minimax import _tables
from envs.tictactoe.opponent import *  # noqa: F401,F403
from envs.tictactoe.opponent import (  # noqa: F401
    _SALT_FIRST_MOVER, _check_prob_host, _check_seed_host, _draw, _move_data, _pick, _reply,
)
from envs.tictactoe.rules import *  # noqa: F401,F403
from envs.tictactoe.rules import (  # noqa: F401
    EMPTY, INVALID_MOVE, NO_MOVE, NUM_BOARDS, NUM_CELLS, O, OUTCOME_DRAW, OUTCOME_LOSS, OUTCOME_NAMES,
    OUTCOME_ONGOING, OUTCOME_WIN, STATUS_DRAW, STATUS_INVALID, STATUS_LOSS, STATUS_NO_MOVE, STATUS_OPP_DRAW,
    STATUS_OPP_MOVED, STATUS_START_MODEL_FIRST, STATUS_START_OPP_FIRST, STATUS_WIN, X, State, _FULL,
    _HAS_LINE, _LINE_MASKS, _bitboards, _has_line, is_finished, legal_moves, valid_board, winner,
)


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
        uniform = unit_float(words[0])
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
    reply (LOSS / OPP_DRAW / OPP_MOVED). Every reply counts a turn. A done state is returned unchanged
    (`envs.core.keep_finished`, the protocol's one rule for finished games; the rules are `transition`).
    """
    return keep_finished(state.done, state, transition(state, move))


def transition(state: State, move: jax.Array) -> State:
    """`step`'s rules for a game that is not done (on a done state the result is meaningless: `step` keeps
    the old one).

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

    # The opponent's reply (computed for every game, applied where the game goes on).
    reply = _reply(xs, os, opp_turn, state.seed, state.random_move_prob)  # -1 where O does not move
    os = jnp.where(opp_turn, os | jnp.left_shift(1, jnp.clip(reply, 0, NUM_CELLS - 1)), os)
    o_won = opp_turn & _has_line(os)
    o_filled = opp_turn & ~o_won & ((xs | os) == _FULL)

    # The board: X's cell (NUM_CELLS for none) comes from a table read and O's is the reply (also a
    # table read, -1 for none), so the elementwise write over the 9 cells does not redo the checks.
    x_cell = jnp.asarray(_X_CELL)[jnp.clip(move, 0, NUM_CELLS - 1) | (legal.astype(jnp.int32) << 4)]
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

    return State(
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


# ---------------------------------------------------------------------------------------------------
# The two halves of a step, for a person playing the opponent (`jaxrl-llm play`)


def model_move(state: State, move: jax.Array) -> State:
    """State, int32[] move -> the model's reply applied alone, without the opponent's answer.

    The same rules as the first half of `step` (missing, invalid, X's move, win or draw); a legal move
    that leaves the game open gives status STATUS_OPP_MOVED with the opponent still to move, which
    `opponent_move_applied` then makes. `step(s, m)` equals `opponent_move_applied(model_move(s, m),
    opponent_move(...))` whenever the game goes on (a test checks it). A done state comes back unchanged.
    """
    return keep_finished(state.done, state, _model_rules(state, move))


def _model_rules(state: State, move: jax.Array) -> State:
    """`model_move`'s rules for a game that is not done."""
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
    return state._replace(
        board=board, to_play=jnp.where(done, 0, 1).astype(jnp.int8), turns=state.turns + 1,
        invalid_moves=state.invalid_moves + (~missing & ~legal).astype(jnp.int32),
        missing_moves=state.missing_moves + missing.astype(jnp.int32), done=done,
        outcome=_first_true([(won, OUTCOME_WIN), (filled, OUTCOME_DRAW)], OUTCOME_ONGOING), status=status,
    )


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
