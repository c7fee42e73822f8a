"""Tic-Tac-Toe's `tiny_lines` prompt preset: `tiny` plus one line with the board's columns and diagonals.

Its messages equal the independent reference (`reference_text.tiny_lines_message`) on every reachable board
with every status, through the host renderer and through the text bridge's slots (device codes); the other
presets keep their six slots and codes; the env checker passes; the project tokenizer and a GPT-2-style one
encode its slots piecewise exactly as whole conversations."""

from __future__ import annotations

import random

import jax
import numpy as np
import pytest

import envs
import reference_text as ref
import reference_tictactoe as ref_game
from envs import tictactoe as ttt
from envs.check import check_env
from envs.tictactoe import text as ttt_text
from jaxrl_llm import text
from jaxrl_llm.text.tokenizer import load_tokenizer

PRESET = ttt_text.PRESETS["tiny_lines"]


def env_of(preset: str) -> ttt.TicTacToe:
    return ttt.TicTacToe(ttt.Params(prompt=preset))


def _states(boards, statuses, ks) -> ttt.State:
    """A batch of game states showing `boards` with `statuses` and last opponent moves `ks`."""
    n = len(statuses)
    z = np.zeros(n, np.int32)
    statuses = np.asarray(statuses, np.int32)
    return ttt.State(board=np.asarray(boards, np.int8), to_play=np.ones(n, np.int8), turns=z, invalid_moves=z,
                     missing_moves=z, done=statuses >= ttt_text.FIRST_FINAL_STATUS, outcome=z.astype(np.int8),
                     last_opponent_move=np.asarray(ks, np.int8), status=statuses.astype(np.int8),
                     seed=z.astype(np.uint32), random_move_prob=z.astype(np.float32))


def _all_messages():
    """Every reachable board (either side first, finished ones included) with every status id."""
    boards = sorted({b for b, _ in ref_game.reachable_positions()})
    out = []
    for i, board in enumerate(boards):
        for status in range(9):
            out.append((board, status, (7 * i + status) % 9))
    return out


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def test_format_example():
    board = [1, 0, 0, 0, 2, 0, 0, 0, 1]
    expected = "O played 4.\nX12\n3O5\n67X\nLines: X36 1O7 25X XOX 2O6\nFree: [1, 2, 3, 5, 6, 7]\nYour move."
    assert ref.tiny_lines_message(board, 2, 4) == expected
    assert ttt_text.render_message(PRESET, board, 2, 4) == expected
    won = [1, 1, 1, 0, 2, 2, 0, 0, 0]
    assert ttt_text.render_message(PRESET, won, 5, 4) == "You win!\nXXX\n3OO\n678\nLines: X36 XO7 XO8 XO8 XO6"
    assert ttt_text.system_prompt(PRESET) == ref.TINY_LINES_SYSTEM == ttt_text.system_prompt(ttt_text.PRESETS["tiny"])


def test_every_reachable_message_equals_the_reference():
    env = env_of("tiny_lines")
    spec = env.message_spec(env.params)
    assert tuple(s.name for s in spec.slots) == ttt_text.slot_names(PRESET) == (
        "status", "row0", "row1", "row2", "col0", "col1", "col2", "diag0", "diag1", "free", "turn")
    messages = _all_messages()
    boards, statuses, ks = zip(*messages)
    codes = jax.jit(jax.vmap(lambda s: env.message_codes(s, env.params)))(_states(boards, statuses, ks))
    codes = np.asarray(codes)
    assert codes.shape == (len(messages), 11) and codes.dtype == np.int32
    for (board, status, k), row in zip(messages, codes):
        expected = ref.tiny_lines_message(board, status, k)
        assert spec.render(row.tolist()) == expected
        assert ttt_text.render_message(PRESET, board, status, k) == expected
    # the env's own host path (one state, through message_spec and message_codes)
    board, status, k = messages[1234]
    one = jax.tree_util.tree_map(lambda a: a[0], _states([board], [status], [k]))
    assert env.render_message(one, env.params) == ref.tiny_lines_message(board, status, k)


def test_every_piece_combination_renders_as_the_host():
    """The five line slots: every code of each, with every final flag, is the host's line text."""
    spec = ttt_text.message_spec(PRESET)
    names = [s.name for s in spec.slots]
    for final in (0, 1):
        for line in range(5):
            slot = spec.slots[names.index(ttt_text.LINE_SLOT_NAMES[line])]
            for code in range(27):
                values = [code // 3**j % 3 for j in range(3)]
                board = [0] * 9
                for j, cell in enumerate(ttt_text.LINE_CELLS[line]):
                    board[cell] = values[j]
                status = 5 if final else 2
                whole = ttt_text.render_message(PRESET, board, status, 0)
                piece = slot.pieces[final * 27 + code]
                assert piece in whole
                shown = "".join("XO"[v - 1] if v else str(c) for c, v in zip(ttt_text.LINE_CELLS[line], values))
                assert piece.strip().endswith(shown)


@pytest.mark.parametrize("preset", ["reference", "compact", "tiny"])
def test_other_presets_keep_their_slots_and_codes(preset):
    env = env_of(preset)
    spec = env.message_spec(env.params)
    assert tuple(s.name for s in spec.slots) == ttt_text.SLOT_NAMES == ttt_text.slot_names(env.params.preset)
    assert [len(s.pieces) for s in spec.slots] == [81, 54, 54, 54, 1024, 2]
    rng = random.Random(7)
    rows = [([rng.choice([0, 0, 1, 2]) for _ in range(9)], rng.randrange(9), rng.randrange(9)) for _ in range(50)]
    boards, statuses, ks = zip(*rows)
    state = _states(boards, statuses, ks)
    codes = np.asarray(jax.vmap(lambda s: env.message_codes(s, env.params))(state))
    assert codes.shape == (50, 6)
    np.testing.assert_array_equal(codes, np.asarray(jax.vmap(ttt_text.message_codes)(state)))
    render = {"reference": ref.message, "tiny": ref.tiny_message}.get(preset)
    for (board, status, k), row in zip(rows, codes):
        board_arr = np.asarray(board)
        rows_code = [int((board_arr[3 * r: 3 * r + 3] * [1, 3, 9]).sum()) for r in range(3)]
        final = int(status >= ttt_text.FIRST_FINAL_STATUS)
        mask = sum(1 << i for i in range(9) if board[i] == 0)
        assert row.tolist() == [status * 9 + k, *(final * 27 + c for c in rows_code), final * 512 + mask, final]
        if render is not None:
            assert spec.render(row.tolist()) == render(board, status, k)


def test_env_check_passes():
    passed = check_env(envs.make("tictactoe", prompt="tiny_lines"), max_turns=4)
    assert len(passed) == 6


def test_project_tokenizer_encodes_a_game_without_unknown_tokens(tok):
    rng = random.Random(11)
    messages, replies = ref.random_game(rng)
    conv = ref.conversation(messages, replies, len(messages) - 1, system=ref.TINY_LINES_SYSTEM,
                            render=ref.tiny_lines_message)
    ids = tok.apply_chat_template(conv, tokenize=True, return_dict=False)
    assert tok.unk_token_id is None or tok.unk_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=False).count("Lines: ") == len(messages)


# ---------------------------------------------------------------------------------------------------------
# the text bridge: on-device rendering == apply_chat_template of the host-rendered conversation
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["project", "lfm2-like"])
def test_device_conversation_tiny_lines(tok, which):
    from test_text import gpt2_style_tokenizer

    from test_text import _check_conversations

    tokenizer = tok if which == "project" else gpt2_style_tokenizer()
    tables = text.tables_for_env(tokenizer, env_of("tiny_lines"))  # checks each adjacent pair of pieces encodes
    assert tables.slot_names == ttt_text.slot_names(PRESET)
    assert ttt_text.system_prompt(PRESET) == ref.TINY_LINES_SYSTEM
    _check_conversations(tokenizer, PRESET, tables, n_games=60, seed=5, render=ref.tiny_lines_message)
