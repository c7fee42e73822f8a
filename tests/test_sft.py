"""SFT: Tic-Tac-Toe's teachers (expert games on device, the tree, their rendering), dataset I/O, assistant-only
masks, the loss and a short run."""

import dataclasses
import json
import re
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from envs import tictactoe as ttt
from envs.tictactoe import teacher
from envs.tictactoe import text
from jaxrl_llm.algos import sft
from jaxrl_llm.algos.optim import OptimConfig
from jaxrl_llm.data import sft_data
from jaxrl_llm.text import load_tokenizer

NUM_GAMES = 256  # one compiled generator (and replay) serves every test
REPLY_RE = re.compile(r"^<think>(.*)</think>\n<move>([0-8])</move>$")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def perfect_games():
    """Teacher without exploration (its moves must all be optimal)."""
    return teacher.generate_expert_games(jax.random.PRNGKey(0), NUM_GAMES, teacher_random_move_prob=0.0,
                                          opponent_p_range=(0.0, 1.0))


@pytest.fixture(scope="module")
def explore_games():
    """Teacher exploring 40% of the time (some games are lost and must be filtered out)."""
    return teacher.generate_expert_games(jax.random.PRNGKey(1), NUM_GAMES, teacher_random_move_prob=0.4,
                                          opponent_p_range=(0.0, 0.5))


@pytest.fixture(scope="module")
def rows(perfect_games, explore_games):
    return {
        "reference": teacher.games_to_rows(perfect_games, "reference"),
        "compact": teacher.games_to_rows(explore_games, "compact"),
    }


# ---------------------------------------------------------------------------------------------------------
# Independent helpers (plain Python)


def py_kind(board, move):
    """Move kind from first principles: win / block / centre / corner / other."""
    lines = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]
    through = [ln for ln in lines if move in ln]
    if any(all(board[c] == ttt.X for c in ln if c != move) for ln in through):
        return "win"
    if any(all(board[c] == ttt.O for c in ln if c != move) for ln in through):
        return "block"
    return "centre" if move == 4 else ("corner" if move in (0, 2, 6, 8) else "other")


@jax.jit
def _replay(seeds, p, moves):
    """Replay recorded moves int32[R, 5] (-1 padding never reaches a live game) -> per-turn states."""
    start = jax.vmap(ttt.reset)(seeds, p)

    def turn(state, move):
        new = jax.vmap(ttt.step)(state, move)
        return new, new

    _, states = jax.lax.scan(turn, start, moves.T)
    return start, states


def replay_rows(rows):
    """Replay rows (padded to NUM_GAMES, so one compilation serves every call)."""
    seeds = np.zeros(NUM_GAMES, np.uint32)
    p = np.zeros(NUM_GAMES, np.float32)
    moves = np.full((NUM_GAMES, teacher.MAX_MODEL_MOVES), -1, np.int32)
    for i, r in enumerate(rows):
        seeds[i] = r["info"]["example_seed"]
        p[i] = r["info"]["random_move_prob"]
        moves[i, : len(r["info"]["moves"])] = r["info"]["moves"]
    start, states = jax.device_get(_replay(jnp.asarray(seeds), jnp.asarray(p), jnp.asarray(moves)))
    return start, states


_optimal_x = jax.jit(jax.vmap(lambda board: ttt.optimal_moves(board, ttt.X)))


# ---------------------------------------------------------------------------------------------------------
# Games


def test_move_kind_examples():
    move_kind = jax.jit(teacher.move_kind)
    b = np.zeros(9, np.int8)
    x, o = ttt.X, ttt.O
    win = b.copy(); win[[0, 1]] = x; win[[3, 4]] = o  # noqa: E702
    assert int(move_kind(win, 2)) == teacher.MOVE_WIN
    assert int(move_kind(win, 5)) == teacher.MOVE_BLOCK  # O would complete 3-4-5
    assert int(move_kind(win, 8)) == teacher.MOVE_CORNER
    assert int(move_kind(b, 4)) == teacher.MOVE_CENTRE
    assert int(move_kind(b, 7)) == teacher.MOVE_OTHER
    both = b.copy(); both[[0, 1]] = x; both[[5, 8]] = o  # noqa: E702  cell 2 wins for X and blocks O
    assert int(move_kind(both, 2)) == teacher.MOVE_WIN


def test_games_legal_finished_optimal(perfect_games, explore_games):
    for games, optimal_teacher in ((perfect_games, True), (explore_games, False)):
        n = games.num_moves
        assert ((n >= 1) & (n <= 5)).all()
        assert np.isin(games.outcome, [ttt.OUTCOME_WIN, ttt.OUTCOME_DRAW, ttt.OUTCOME_LOSS]).all()  # all finished
        live = np.arange(5)[None, :] < n[:, None]
        assert (games.moves[~live] == -1).all() and (games.kinds[~live] == -1).all()
        boards, moves = games.boards[live], games.moves[live]
        assert (boards[np.arange(len(moves)), moves] == ttt.EMPTY).all()  # every move on a free cell
        optimal = np.asarray(_optimal_x(jnp.asarray(games.boards.reshape(-1, 9)))).reshape(NUM_GAMES, 5, 9)[live]
        is_opt = optimal[np.arange(len(moves)), moves]
        explored = games.explored[live]
        assert is_opt[~explored].all()  # a move that did not explore is always optimal
        kinds = [teacher.MOVE_KIND_NAMES[k] for k in games.kinds[live]]
        assert kinds == [py_kind(list(bd), int(m)) for bd, m in zip(boards, moves)]
        if optimal_teacher:
            assert not explored.any() and is_opt.all()
            assert (games.outcome != ttt.OUTCOME_LOSS).all()  # perfect play never loses
    assert explore_games.explored.any()
    assert (explore_games.outcome == ttt.OUTCOME_LOSS).any()  # so the filter below has something to drop
    p = explore_games.random_move_prob
    assert (p >= 0.0).all() and (p <= 0.5).all() and p.std() > 0.05


def test_rows_drop_lost_games(explore_games, rows):
    kept = np.isin(explore_games.outcome, [ttt.OUTCOME_WIN, ttt.OUTCOME_DRAW])
    assert len(rows["compact"]) == kept.sum() < NUM_GAMES
    assert {r["info"]["outcome"] for r in rows["compact"]} <= {"win", "draw"}
    with_losses = teacher.games_to_rows(explore_games, "compact", keep_losses=True)
    assert len(with_losses) == NUM_GAMES


@pytest.mark.parametrize("preset_name", ["reference", "compact"])
def test_conversations_parse_back(rows, preset_name):
    preset = text.PRESETS[preset_name]
    rs = rows[preset_name]
    start, states = replay_rows(rs)
    for i, r in enumerate(rs):
        info = r["info"]
        assert [m["role"] for m in r["prompt"]] == ["system", "user"]
        assert r["prompt"][0]["content"] == text.system_prompt(preset)
        assert r["prompt"][1]["content"] == text.render_message(
            preset, start.board[i], int(start.status[i]), int(start.last_opponent_move[i]))
        comp = r["completion"]
        n = len(info["moves"])
        assert [m["role"] for m in comp] == ["assistant", "user"] * n
        for t in range(n):
            match = REPLY_RE.match(comp[2 * t]["content"])
            assert match, comp[2 * t]["content"]
            assert int(match.group(2)) == info["moves"][t]
            s = jax.tree.map(lambda a: a[t, i], states)
            assert comp[2 * t + 1]["content"] == text.render_message(
                preset, s.board, int(s.status), int(s.last_opponent_move))
            assert bool(s.done) == (t == n - 1)
        final = jax.tree.map(lambda a: a[n - 1, i], states)
        assert int(final.status) >= text.FIRST_FINAL_STATUS
        assert {ttt.OUTCOME_WIN: "win", ttt.OUTCOME_DRAW: "draw"}[int(final.outcome)] == info["outcome"]


def test_reasoning_matches_move_kind(rows):
    seen = set()
    for preset_name, rs in rows.items():
        start, states = replay_rows(rs)
        for i, r in enumerate(rs):
            board = start.board[i]
            for t, move in enumerate(r["info"]["moves"]):
                reasoning = REPLY_RE.match(r["completion"][2 * t]["content"]).group(1)
                kind = teacher.MOVE_KIND_NAMES[teacher.kind_of_reasoning(reasoning)]
                assert kind == py_kind(list(board), move) == r["info"]["move_kinds"][t]
                after = jax.tree.map(lambda a: a[t, i], states)
                if kind == "win":  # a win phrase only where the move wins, and every winning move says so
                    assert int(after.status) == ttt.STATUS_WIN
                if int(after.status) == ttt.STATUS_WIN:
                    assert kind == "win"
                seen.add(kind)
                board = after.board
    assert seen == set(teacher.MOVE_KIND_NAMES)
    with pytest.raises(ValueError):
        teacher.kind_of_reasoning("I like this cell.")


def test_generation_argument_errors():
    key = jax.random.PRNGKey(0)
    with pytest.raises(ValueError, match="teacher_random_move_prob"):
        teacher.generate_expert_games(key, 4, teacher_random_move_prob=1.5)
    with pytest.raises(ValueError, match="p_min <= p_max"):
        teacher.generate_expert_games(key, 4, opponent_p_range=(0.6, 0.2))
    with pytest.raises(ValueError, match="num_games"):
        teacher.generate_expert_games(key, 0)
    with pytest.raises(ValueError, match="preset"):
        teacher.expert_rows(key, 4, preset="nope")


# ---------------------------------------------------------------------------------------------------------
# Dataset I/O


def test_dataset_round_trips(tmp_path, rows):
    rs = rows["compact"][:20]
    ds = sft_data.rows_to_dataset(rs)
    assert ds.column_names == ["prompt", "completion", "info"]
    assert ds.to_list() == rs
    sft_data.save_sft_dataset(ds, tmp_path / "disk")
    assert sft_data.load_sft_dataset(tmp_path / "disk").to_list() == rs
    sft_data.export_jsonl(ds, tmp_path / "games.jsonl")
    lines = (tmp_path / "games.jsonl").read_text().splitlines()
    assert len(lines) == len(rs) and json.loads(lines[0]) == rs[0]
    assert sft_data.load_sft_dataset(tmp_path / "games.jsonl").to_list() == rs
    # A DatasetDict on disk and a Hub-style folder of Parquet files load through the same function.
    import datasets

    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "dict"))
    assert sft_data.load_sft_dataset(tmp_path / "dict").to_list() == rs
    (tmp_path / "hub" / "data").mkdir(parents=True)
    ds.to_parquet(str(tmp_path / "hub" / "data" / "train-00000-of-00001.parquet"))
    assert sft_data.load_sft_dataset(tmp_path / "hub").to_list() == rs


def test_load_public_layout(tmp_path, tok, rows):
    """A row shaped like anakin87/tictactoe-filtered (extra columns, its own info struct) loads and tokenizes."""
    r = rows["reference"][0]
    public = {
        "example_id": 7, "prompt": r["prompt"], "completion": r["completion"], "task": "default", "reward": 1.2,
        "info": {"example_seed": 12, "initial_board": [None] * 9, "random_move_prob": 0.3},
        "win_reward_func": 1.0, "format_reward_func": 1.0, "invalid_move_penalty_func": 0.0,
    }
    (tmp_path / "public.jsonl").write_text(json.dumps(public) + "\n")
    ds = sft_data.load_sft_dataset(tmp_path / "public.jsonl")
    assert ds[0]["prompt"] == r["prompt"] and ds[0]["completion"] == r["completion"]
    a = sft.tokenize_sft(tok, ds, 1024)
    b = sft.tokenize_sft(tok, [r], 1024)
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    np.testing.assert_array_equal(a["loss_mask"], b["loss_mask"])
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    with pytest.raises(ValueError, match="prompt"):
        sft_data.load_sft_dataset(tmp_path / "bad.jsonl")
    with pytest.raises(FileNotFoundError):
        sft_data.load_sft_dataset(tmp_path / "missing")


def test_tfds_round_trip(tmp_path, rows):
    missing = "the optional 'tfds' extra ({}) is not installed: pip install 'jaxrl_llm[tfds]'"
    pytest.importorskip("tensorflow_datasets", reason=missing.format("tensorflow-datasets"))
    pytest.importorskip("array_record", reason=missing.format("array-record"))
    rs = rows["reference"][:6]
    folder = sft_data.export_tfds(rs, tmp_path / "tfds")
    assert any("array_record" in p.name for p in folder.iterdir())
    assert sft_data.load_tfds(folder) == rs
    assert sft_data.load_sft_dataset(tmp_path / "tfds").to_list() == rs
    with pytest.raises(FileExistsError):
        sft_data.export_tfds(rs, tmp_path / "tfds")
    assert sft_data.load_tfds(sft_data.export_tfds(rs[:2], tmp_path / "tfds", overwrite=True)) == rs[:2]


def test_tfds_missing_extra_error(monkeypatch, rows):
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # import now raises ImportError
    with pytest.raises(ImportError, match=r"jaxrl_llm\[tfds\]"):
        sft_data.export_tfds(rows["reference"][:1], "/nonexistent")


# ---------------------------------------------------------------------------------------------------------
# Tokenization and the loss mask


def independent_mask(tok, ids):
    """Mask from the token ids alone: after `<|im_start|>` + role `assistant` + newline, every token up to and
    including the next `<|im_end|>`."""
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    mask = np.zeros(len(ids), np.float32)
    i = 0
    while i < len(ids):
        if ids[i] == im_start:
            j, header = i + 1, ""
            while "\n" not in header:
                header += tok.decode([ids[j]])
                j += 1
            if header == "assistant\n":
                k = j
                while ids[k] != im_end:
                    mask[k] = 1.0
                    k += 1
                mask[k] = 1.0
                i = k
        i += 1
    return mask


def test_loss_mask_exact(tok, rows):
    rs = rows["reference"][:12] + rows["compact"][:12]
    seq_len = 720
    out = sft.tokenize_sft(tok, rs, seq_len)
    assert out["tokens"].dtype == np.int32 and out["loss_mask"].dtype == np.float32
    assert out["tokens"].shape == out["loss_mask"].shape == (len(rs), seq_len)
    for i, r in enumerate(rs):
        messages = r["prompt"] + r["completion"]
        ids = tok.apply_chat_template(messages, tokenize=True, return_dict=False)
        n = len(ids)
        assert out["lengths"][i] == n <= seq_len
        np.testing.assert_array_equal(out["tokens"][i, :n], ids)
        assert (out["tokens"][i, n:] == tok.pad_token_id).all() and (out["loss_mask"][i, n:] == 0).all()
        np.testing.assert_array_equal(out["loss_mask"][i, :n], independent_mask(tok, ids))
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        expected = sum(len(tok(c, add_special_tokens=False)["input_ids"]) + 1 for c in replies)
        assert out["loss_mask"][i].sum() == expected
        masked = out["tokens"][i][out["loss_mask"][i] == 1]
        assert (masked == tok.convert_tokens_to_ids("<|im_end|>")).sum() == len(replies)


def test_overflow_truncate_and_drop(tok, rows):
    rs = rows["compact"][:8]
    lengths = sft.tokenize_sft(tok, rs, 2048)["lengths"]
    seq_len = int(np.median(lengths))
    n_long = int((lengths > seq_len).sum())
    assert n_long > 0
    with pytest.warns(UserWarning, match=f"{n_long} of 8 conversations truncated"):
        cut = sft.tokenize_sft(tok, rs, seq_len)
    assert cut["tokens"].shape == (8, seq_len) and (cut["lengths"] <= seq_len).all()
    full = sft.tokenize_sft(tok, rs, 2048)
    np.testing.assert_array_equal(cut["loss_mask"], full["loss_mask"][:, :seq_len])
    with pytest.warns(UserWarning, match=f"{n_long} of 8 conversations dropped"):
        kept = sft.tokenize_sft(tok, rs, seq_len, overflow="drop")
    assert kept["tokens"].shape[0] == 8 - n_long
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sft.tokenize_sft(tok, rs, 2048)  # nothing too long: no warning
    with pytest.raises(ValueError, match="overflow"):
        sft.tokenize_sft(tok, rs, 64, overflow="wrap")


def test_sft_loss_uses_target_positions():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32)
    tokens = rng.integers(0, 7, size=(2, 5)).astype(np.int32)
    mask = np.zeros((2, 5), np.float32)
    mask[0, 3] = 1.0  # predicted from logits[0, 2]
    mask[1, 1] = 1.0  # predicted from logits[1, 0]
    loss_fn = jax.jit(sft.sft_loss)
    loss, aux = loss_fn(jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(mask))

    def nll(row, t):
        lg = logits[row, t - 1].astype(np.float64)
        return -(lg[tokens[row, t]] - np.log(np.exp(lg).sum()))

    assert float(loss) == pytest.approx((nll(0, 3) + nll(1, 1)) / 2, rel=1e-5)
    hits = int(np.argmax(logits[0, 2]) == tokens[0, 3]) + int(np.argmax(logits[1, 0]) == tokens[1, 1])
    assert float(aux["accuracy"]) == pytest.approx(hits / 2)
    assert float(aux["tokens"]) == 2.0
    zero, _ = loss_fn(jnp.asarray(logits), jnp.asarray(tokens), jnp.zeros((2, 5), jnp.float32))
    assert float(zero) == 0.0


# ---------------------------------------------------------------------------------------------------------
# Config and training


def test_sft_config_errors():
    sft.SftConfig()  # the defaults are valid
    for kwargs, match in [
        ({"steps": -1}, "steps"), ({"batch_size": 1.5}, "batch_size"), ({"seq_len": 1}, "seq_len"),
        ({"overflow": "wrap"}, "overflow"), ({"optim": {"learning_rate": 1e-3}}, "optim"),
        ({"check_every": -1}, "check_every"), ({"stop_when_exact": True}, "stop_when_exact"),
    ]:
        with pytest.raises(ValueError, match=match):
            sft.SftConfig(**kwargs)
    for kwargs, match in [
        ({"num_games": True}, "num_games"), ({"explore_prob": -0.1}, "explore_prob"),
        ({"opponent_p_min": 0.8, "opponent_p_max": 0.2}, "opponent_p_max"), ({"opponent_p_max": 2.0}, "opponent_p_max"),
        ({"kind": "greedy"}, "kind"), ({"reasoning": "long"}, "reasoning"), ({"tree_copies": 2}, "deterministic"),
    ]:
        with pytest.raises(ValueError, match=match):
            teacher.Teacher(**kwargs)


def test_tiny_model_loss_falls(tok):
    from models.lfm2 import PRESETS, Lfm2ForCausalLM

    config = sft.SftConfig(steps=30, batch_size=8, seq_len=256, check_every=10, stop_when_exact=True,
                           optim=OptimConfig(learning_rate=1e-2, warmup_steps=2, schedule="cosine"))
    dataset = sft_data.rows_to_dataset(teacher.Teacher(num_games=NUM_GAMES, explore_prob=0.1, opponent_p_min=0.0,
                                                       opponent_p_max=1.0).rows(jax.random.PRNGKey(3), "compact", 8))
    assert 150 <= len(dataset) <= NUM_GAMES
    tiny = PRESETS["tiny"]  # two of its layers (one conv, one attention) keep the compile short on 2 CPU cores
    module = Lfm2ForCausalLM(dataclasses.replace(tiny, vocab_size=len(tok), num_hidden_layers=2,
                                                 layer_types=tiny.layer_types[:2]))
    params = jax.jit(module.init)(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
    before = jax.tree.map(np.asarray, params)
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # games longer than 256 tokens are truncated
        trained, history = sft.train_sft(module, params, tok, dataset, config, jax.random.PRNGKey(4),
                                         callback=lambda step, m: seen.append(step),
                                         check_rows=[dataset[i] for i in range(16)])
    assert seen == list(range(30)) and len(history) == 30  # never exact: all the steps run
    checked = [i for i, h in enumerate(history) if "check_exact" in h]
    assert checked == [9, 19, 29] and all(0 <= history[i]["check_token_accuracy"] <= 1 for i in checked)
    assert set(history[0]) >= {"loss", "accuracy", "grad_norm", "tokens", "learning_rate", "epoch"}
    losses = np.array([h["loss"] for h in history])
    assert np.isfinite(losses).all()
    assert losses[-5:].mean() < 0.75 * losses[:3].mean()
    assert history[-1]["accuracy"] > history[0]["accuracy"]
    # The caller's params survive (train_sft copies before donating) and the returned ones changed.
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), params, before)
    changed = jax.tree.map(lambda a, b: not np.array_equal(np.asarray(a), b), trained, before)
    assert any(jax.tree.leaves(changed))


# ---------------------------------------------------------------------------------------------------------
# The `best` teacher: value-keeping moves that win most often against the random opponent


def _ref_best_policy():
    """Independent DP on the reference minimax: (move for X to move per board, exact win rate vs random)."""
    import functools as ft

    from reference_tictactoe import EMPTY, O, X, ref_finished, ref_value, ref_winner

    @ft.lru_cache(maxsize=None)
    def win_prob(board, x_to_move):
        if ref_finished(board):
            return (1.0 if ref_winner(board) == X else 0.0), None
        free = [c for c in range(9) if board[c] == EMPTY]
        if not x_to_move:
            return sum(win_prob(board[:c] + (O,) + board[c + 1:], True)[0] for c in free) / len(free), None
        value = ref_value(board, X)
        best = None
        for c in free:
            child = board[:c] + (X,) + board[c + 1:]
            if -ref_value(child, O) != value:
                continue  # the move gives away value
            p = win_prob(child, False)[0]
            if best is None or p > best[0]:
                best = (p, c)
        return best

    rate = 0.5 * win_prob((EMPTY,) * 9, True)[0] + 0.5 * win_prob((EMPTY,) * 9, False)[0]
    return win_prob, rate


def test_best_teacher_table_equals_an_independent_dp_on_every_reachable_position():
    from reference_tictactoe import X, ref_finished, ref_index, reachable_positions

    table = teacher.best_move_table()
    win_prob, rate = _ref_best_policy()
    checked = 0
    for board, to_move in reachable_positions():
        if to_move != X or ref_finished(board):
            continue
        assert table[ref_index(board)] == win_prob(board, True)[1], board
        checked += 1
    assert checked > 2000
    assert abs(teacher.teacher_win_rate_vs_random() - rate) < 1e-12
    assert 0.955 < rate < 0.956  # the spec's "limits of the game": above the uniform teacher's 87.3 %


def test_best_teacher_games_never_lose_and_reply_without_reasoning(tok):
    games = teacher.generate_expert_games(jax.random.PRNGKey(5), NUM_GAMES, teacher_random_move_prob=0.0,
                                           opponent_p_range=(0.0, 1.0), teacher="best")
    assert set(np.unique(games.outcome)) <= {ttt.OUTCOME_WIN, ttt.OUTCOME_DRAW}
    table = teacher.best_move_table()
    for i in range(NUM_GAMES):
        for t in range(int(games.num_moves[i])):
            index = int((games.boards[i, t].astype(np.int64) * 3 ** np.arange(9)).sum())
            assert games.moves[i, t] == table[index]
    rows = teacher.games_to_rows(games, "tiny", reasoning="none")
    assert len(rows) == NUM_GAMES
    for row in rows[:20]:
        for message in row["completion"]:
            if message["role"] == "assistant":
                assert REPLY_RE.match(message["content"]).group(1) == ""
    with pytest.raises(ValueError, match="teacher"):
        teacher.generate_expert_games(jax.random.PRNGKey(0), 4, teacher="greedy")
    with pytest.raises(ValueError, match="reasoning"):
        teacher.games_to_rows(games, "tiny", reasoning="long")


def _game_key(games, i):
    n = int(games.num_moves[i])
    return (tuple(games.first_board[i].tolist()), int(games.first_status[i]), int(games.first_last_opp[i]),
            tuple(games.moves[i, :n].tolist()), tuple(map(tuple, games.after_boards[i, :n].tolist())),
            tuple(games.statuses[i, :n].tolist()), tuple(games.last_opp[i, :n].tolist()), int(games.outcome[i]),
            tuple(games.kinds[i, :n].tolist()))


def test_exhaustive_games_are_the_whole_tree_the_teacher_can_meet():
    tree = teacher.exhaustive_expert_games()
    keys = {_game_key(tree, i) for i in range(len(tree.seed))}
    assert len(keys) == len(tree.seed) == 738  # no game twice
    assert set(np.unique(tree.outcome)) <= {ttt.OUTCOME_WIN, ttt.OUTCOME_DRAW}
    # Every game the device generator plays (env.step, the env's opponent at p = 1 and p = 0) is in the tree.
    for p_range, seed in (((1.0, 1.0), 6), ((0.0, 0.0), 7), ((0.0, 1.0), 8)):
        played = teacher.generate_expert_games(jax.random.PRNGKey(seed), NUM_GAMES, teacher="best",
                                                opponent_p_range=p_range)
        for i in range(NUM_GAMES):
            assert _game_key(played, i) in keys
    # The tree holds every X-to-move position of the teacher's play against any opponent (independent walk).
    from reference_tictactoe import EMPTY, O, X, ref_finished, ref_index

    table = teacher.best_move_table()
    faced, stack = set(), [(EMPTY,) * 9] + [tuple(O if c == k else EMPTY for c in range(9)) for k in range(9)]
    while stack:
        board = stack.pop()
        faced.add(board)
        after = list(board)
        after[int(table[ref_index(board)])] = X
        if ref_finished(tuple(after)):
            continue
        for c in range(9):
            if after[c] == EMPTY:
                child = tuple(after[:c] + [O] + after[c + 1:])
                if not ref_finished(child):
                    stack.append(child)
    in_tree = {tuple(tree.boards[i, t].tolist()) for i in range(len(tree.seed)) for t in range(int(tree.num_moves[i]))}
    assert in_tree == faced


def test_tree_copies_are_added_to_the_dataset_and_need_the_best_teacher():
    ds = teacher.expert_rows(jax.random.PRNGKey(0), 8, teacher_random_move_prob=0.0, teacher="best",
                             opponent_p_range=(0.0, 1.0), preset="tiny", reasoning="none", tree_copies=2)
    assert len(ds) == 8 + 2 * 738
    assert ds[8]["info"]["random_move_prob"] == -1.0
    with pytest.raises(ValueError, match="deterministic teacher"):
        teacher.expert_rows(jax.random.PRNGKey(0), 8, teacher="uniform", tree_copies=1)
    with pytest.raises(ValueError, match="max_turns"):
        teacher.expert_rows(jax.random.PRNGKey(0), 8, teacher="best", teacher_random_move_prob=0.0,
                            tree_copies=1, max_turns=3)


def test_teacher_forced_check_counts_exact_rows(tok):
    """A 'model' whose logits are the next token itself is exact; one wrong target makes its row inexact."""
    rows = teacher.games_to_rows(teacher.exhaustive_expert_games(), "tiny", reasoning="none")[:5]
    data = sft.tokenize_sft(tok, rows, 400)

    class Oracle:
        def __init__(self, shift):
            self.shift = shift

        def apply(self, variables, tokens):
            nxt = jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)
            nxt = nxt.at[0].set((nxt[0] + self.shift) % 600)  # row 0 of each batch off by `shift`
            return jax.nn.one_hot(nxt, 600), None

    assert sft.teacher_forced_check(Oracle(0), {}, data, batch_size=4)["exact"] == 1.0
    result = sft.teacher_forced_check(Oracle(1), {}, data, batch_size=4)  # batches [0..3], [4 + padding]
    assert result["wrong_rows"] == [0, 4] and result["exact"] == 0.6 and 0 < result["token_accuracy"] < 1


def test_baselines_script_plays_every_pair():
    import importlib.util, pathlib
    spec = importlib.util.spec_from_file_location("baselines", pathlib.Path(__file__).parents[1] / "experiments" / "baselines.py")
    baselines = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(baselines)

    results = baselines.baseline_results(games=64)
    assert set(results) == set(baselines.PLAYERS)
    for name, by_opp in results.items():
        for r in by_opp.values():
            assert abs(r["win"] + r["draw"] + r["loss"] - 1) < 1e-9
    assert results["minimax (uniform)"]["optimal"]["draw"] == 1.0
    assert results["minimax (best tie-break)"]["random"]["loss"] == 0.0


def test_drawn_teacher_keeps_the_value_and_its_tree_and_win_rate_follow_its_table():
    """The "drawn" teacher (one fixed uniform draw among the value-keeping moves per board): every move
    keeps the reference minimax value, the draw is reproducible, its tree is every game it can meet (device
    games are in it), and its win rate vs random equals an independent computation over its table."""
    import functools as ft

    from reference_tictactoe import EMPTY, O, X, ref_finished, ref_index, ref_value, ref_winner, reachable_positions

    table = teacher.drawn_move_table()
    assert np.array_equal(table, teacher.drawn_move_table.__wrapped__(teacher.DRAWN_SEED))  # reproducible
    differs = 0
    for board, to_move in reachable_positions():
        if to_move != X or ref_finished(board):
            continue
        c = int(table[ref_index(board)])
        assert board[c] == EMPTY and -ref_value(board[:c] + (X,) + board[c + 1:], O) == ref_value(board, X), board
        differs += c != int(teacher.best_move_table()[ref_index(board)])
    assert differs > 100  # not the best tie-break in disguise

    @ft.lru_cache(maxsize=None)
    def win(board, x_to_move):
        w = ref_winner(board)
        if w or EMPTY not in board:
            return float(w == X)
        if x_to_move:
            c = int(table[ref_index(board)])
            return win(board[:c] + (X,) + board[c + 1:], False)
        free = [c for c in range(9) if board[c] == EMPTY]
        return sum(win(board[:c] + (O,) + board[c + 1:], True) for c in free) / len(free)

    rate = 0.5 * win((EMPTY,) * 9, True) + 0.5 * win((EMPTY,) * 9, False)
    assert abs(teacher.teacher_win_rate_vs_random("drawn") - rate) < 1e-12
    assert rate < teacher.teacher_win_rate_vs_random("best") - 0.05

    tree = teacher.exhaustive_expert_games("drawn")
    keys = {_game_key(tree, i) for i in range(len(tree.seed))}
    assert len(keys) == len(tree.seed) == 841
    assert set(np.unique(tree.outcome)) <= {ttt.OUTCOME_WIN, ttt.OUTCOME_DRAW}
    played = teacher.generate_expert_games(jax.random.PRNGKey(9), NUM_GAMES, teacher="drawn", opponent_p_range=(0.0, 1.0))
    for i in range(NUM_GAMES):
        assert _game_key(played, i) in keys
    config = teacher.Teacher(kind="drawn", explore_prob=0.0, tree_copies=2)
    assert config.deterministic
    with pytest.raises(ValueError, match="no fixed move table"):
        teacher.move_table("uniform")


def test_a_teacher_can_mix_its_tree_with_another_teachers_sampled_games():
    """kind "drawn" + sample_kind "uniform": the drawn tree once, then uniform games (value-keeping moves
    that are not always the drawn table's)."""

    config = teacher.Teacher(num_games=200, kind="drawn", sample_kind="uniform", reasoning="none", explore_prob=0.0,
                             opponent_p_min=0.0, opponent_p_max=1.0, tree_copies=1)
    rows = config.rows(jax.random.PRNGKey(0), "tiny", 8)
    tree = teacher.games_to_rows(teacher.exhaustive_expert_games("drawn"), "tiny", reasoning="none")
    sampled, tail = rows[:-len(tree)], rows[-len(tree):]
    assert tail == tree and 150 < len(sampled) <= 200
    table = teacher.drawn_move_table()
    off_table = 0
    for row in sampled:
        g = row["info"]
        board = [0 if c is None else (1 if c == "X" else 2) for c in g["initial_board"]]
        assert g["outcome"] in ("win", "draw")  # uniform among value-keeping moves: never a loss
        # The first move's board is the initial one: compare that move with the drawn table's.
        off_table += int(table[sum(v * 3 ** i for i, v in enumerate(board))]) != g["moves"][0]
    assert off_table > 20
    with pytest.raises(Exception, match="sample_kind"):
        teacher.Teacher(sample_kind="greedy")


def test_random_legal_mover_data_keep_their_losses():
    """explore_prob = 1 against the random opponent: every game of the random legal mover, lost ones too
    when keep_losses (Experiment B's format-only SFT data); each move is on a free cell of its board."""
    kwargs = dict(num_games=300, reasoning="none", explore_prob=1.0, opponent_p_min=1.0)
    kept = teacher.Teacher(keep_losses=True, **kwargs).rows(jax.random.PRNGKey(3), "tiny", 8)
    filtered = teacher.Teacher(**kwargs).rows(jax.random.PRNGKey(3), "tiny", 8)
    outcomes = [row["info"]["outcome"] for row in kept]
    assert len(kept) == 300 and 40 < outcomes.count("loss") < 140  # random vs random: X loses ~30 %
    assert [r for r in kept if r["info"]["outcome"] != "loss"] == filtered
    for row in kept:
        g = row["info"]
        board = [c is not None for c in g["initial_board"]]
        assert not board[g["moves"][0]] and all(g["explored"])
    with pytest.raises(ValueError, match="keep_losses"):
        teacher.Teacher(keep_losses="yes")


# ---------------------------------------------------------------------------------------------------------
# Decision tokens, their floor and the illegal-choice probability (issue 30)


def _tiny_grammar():
    return ttt.TicTacToe(ttt.Params(prompt="tiny")).reply_grammar(ttt.Params(prompt="tiny"))


def test_decision_mask_on_hand_made_rows(tok):
    """The decision mask marks exactly the move digit of each reply (found here independently: the token whose
    decoded text is the digit right after the last `<move` + `>` before it), and choice_legal carries each
    reply's legal cells on that token only."""
    grammar = _tiny_grammar()
    system = {"role": "system", "content": "Tic-Tac-Toe."}
    rows = [
        {"prompt": [system, {"role": "user", "content": "You start."}],
         "completion": [{"role": "assistant", "content": "<think></think>\n<move>4</move>"},
                        {"role": "user", "content": "O played 0."},
                        {"role": "assistant", "content": "<think>I take 8.</think>\n<move> 8 </move>"}],
         "info": {"legal_choices": [list(range(9)), [1, 2, 3, 5, 6, 7, 8]]}},
        {"prompt": [system, {"role": "user", "content": "O played 3."}],
         "completion": [{"role": "assistant", "content": "I pass, <move></move> 7"}]},  # no content: no decision
        {"prompt": [system, {"role": "user", "content": "You start."}],
         "completion": [{"role": "assistant", "content": "<move>2</move><move>5</move>"}],  # the first pair only
         "info": {"legal_choices": [[2, 5]]}},
    ]
    out = sft.tokenize_sft(tok, rows, 128, grammar=grammar)
    assert set(out) == {"tokens", "loss_mask", "lengths", "decision_mask", "choice_legal"}
    assert out["choice_legal"].shape == (3, 128, 9)
    expected_digits = [["4", "8"], [], ["2"]]
    for i, row in enumerate(rows):
        ids = out["tokens"][i, :out["lengths"][i]].tolist()
        pieces = [tok.decode([t]) for t in ids]
        # Independent: a decision token is a digit in an assistant turn whose preceding non-space tokens are
        # `<move`, `>` and which is the first digit after the first `<move>` of its reply.
        independent = np.zeros(128, np.float32)
        in_reply, seen_move = False, False
        for t, p in enumerate(pieces):
            if out["loss_mask"][i, t] == 0:
                in_reply, seen_move = False, False
                continue
            in_reply = True
            before = "".join(pieces[max(0, t - 3):t]).replace(" ", "")
            if not seen_move and p.strip().isdigit() and before.endswith("<move>"):
                independent[t] = 1.0
                seen_move = True
        np.testing.assert_array_equal(out["decision_mask"][i], independent)
        assert [pieces[t].strip() for t in np.flatnonzero(out["decision_mask"][i])] == expected_digits[i]
        assert (out["decision_mask"][i] <= out["loss_mask"][i]).all()
        legal = (row.get("info") or {}).get("legal_choices", [])
        for j, t in enumerate(np.flatnonzero(out["decision_mask"][i])):
            assert np.flatnonzero(out["choice_legal"][i, t]).tolist() == sorted(legal[j])
        others = np.ones(128, bool)
        others[np.flatnonzero(out["decision_mask"][i])] = False
        assert not out["choice_legal"][i, others].any()
    # Without a grammar the output is today's.
    plain = sft.tokenize_sft(tok, rows, 128)
    assert set(plain) == {"tokens", "loss_mask", "lengths"}
    np.testing.assert_array_equal(plain["loss_mask"], out["loss_mask"])
    np.testing.assert_array_equal(sft.choice_token_ids(tok, grammar),
                                  [tok.convert_tokens_to_ids(str(c)) for c in range(9)])


def test_decision_floor_and_illegal_prob_against_a_hand_computation():
    """decision_loss / format_loss / floor / illegal_prob / choice_entropy of `sft_loss` on hand-made logits,
    against plain NumPy; decision_weight w reweighs the objective and leaves the logged loss unchanged."""
    rng = np.random.default_rng(1)
    vocab, choices = 12, np.array([3, 4, 5, 6], np.int32)  # 4 choices, tokens 3..6
    logits = rng.normal(size=(2, 6, vocab)).astype(np.float32) * 2
    tokens = rng.integers(0, vocab, size=(2, 6)).astype(np.int32)
    tokens[0, 2], tokens[1, 4] = 4, 6  # the decisions
    mask = np.zeros((2, 6), np.float32)
    mask[0, 1:4] = 1
    mask[1, 3:6] = 1
    decision = np.zeros((2, 6), np.float32)
    decision[0, 2] = decision[1, 4] = 1
    legal = np.zeros((2, 6, 4), bool)
    legal[0, 2] = [False, True, True, False]  # 2 legal: floor ln 2
    legal[1, 4] = [True, True, True, True]  # 4 legal: floor ln 4, nothing illegal
    args = [jnp.asarray(a) for a in (logits, tokens, mask, decision, legal)]
    objective, m = jax.jit(sft.sft_loss, static_argnames=("decision_weight",))(*args, jnp.asarray(choices))

    def logp(b, t):  # log-probabilities predicting target t
        lg = logits[b, t - 1].astype(np.float64)
        return lg - np.log(np.exp(lg).sum())

    ce = {(b, t): -logp(b, t)[tokens[b, t]] for b in range(2) for t in range(1, 6) if mask[b, t]}
    dec = [(0, 2), (1, 4)]
    fmt = [k for k in ce if k not in dec]
    assert float(m["decision_loss"]) == pytest.approx(np.mean([ce[k] for k in dec]), rel=1e-5)
    assert float(m["format_loss"]) == pytest.approx(np.mean([ce[k] for k in fmt]), rel=1e-5)
    assert float(m["loss"]) == pytest.approx(np.mean(list(ce.values())), rel=1e-5) == float(objective)
    assert float(m["decision_loss_floor"]) == pytest.approx((np.log(2) + np.log(4)) / 2, rel=1e-6)
    p0 = np.exp(logp(0, 2))
    assert float(m["illegal_prob"]) == pytest.approx((p0[3] + p0[6] + 0.0) / 2, rel=1e-5)
    q = [np.exp(logp(b, t))[choices] for b, t in dec]
    entropy = [-(x / x.sum() * np.log(x / x.sum())).sum() for x in q]
    assert float(m["choice_entropy"]) == pytest.approx(np.mean(entropy), rel=1e-5)
    assert float(m["decision_tokens"]) == 2.0
    weighted, m5 = sft.sft_loss(*args, jnp.asarray(choices), decision_weight=5.0)
    expected = (sum(ce.values()) + 4 * sum(ce[k] for k in dec)) / len(ce)
    assert float(weighted) == pytest.approx(expected, rel=1e-5)
    assert float(m5["loss"]) == pytest.approx(float(m["loss"]), rel=1e-6)
    # legal_targets: the decisions' ce is -mean over the legal choices of log p, the metrics unchanged.
    soft_objective, m_soft = sft.sft_loss(*args, jnp.asarray(choices), legal_targets=True)
    soft = {(0, 2): -np.mean(logp(0, 2)[[4, 5]]), (1, 4): -np.mean(logp(1, 4)[choices])}
    assert float(soft_objective) == pytest.approx((sum(ce[k] for k in fmt) + sum(soft.values())) / len(ce), rel=1e-5)
    assert float(m_soft["decision_loss"]) == pytest.approx(float(m["decision_loss"]), rel=1e-6)
    with pytest.raises(ValueError, match="decision_weight"):
        sft.SftConfig(decision_weight=0.0)
    with pytest.raises(ValueError, match="eval_rows"):
        sft.SftConfig(eval_rows=-1)


def test_position_rows_are_legal_and_uniform_ish():
    """The positions teacher (random mover vs random opponent): one reply a row, on a free cell of the shown
    board, its legal choices the free cells; the replies spread over the free cells about uniformly (each
    cell is played about as often as sum over the rows where it is free of 1 / #free: chi-square over the 9
    cells), and positions come from every turn."""
    rows = teacher.Teacher(num_games=600, layout="positions", reasoning="none", explore_prob=1.0,
                           opponent_p_min=1.0, keep_losses=True).rows(jax.random.PRNGKey(5), "tiny", 8)
    assert len(rows) == 600
    observed, expected, turns = np.zeros(9), np.zeros(9), []
    for row in rows:
        assert [m["role"] for m in row["prompt"] + row["completion"]] == ["system", "user", "assistant"]
        info = row["info"]
        board = info["board"]
        free = [c for c in range(9) if board[c] == 0]
        move = int(REPLY_RE.match(row["completion"][0]["content"]).group(2))
        assert info["legal_choices"] == [free] and move in free and info["moves"] == [move]
        shown = row["prompt"][1]["content"].split("\n")[1:4]  # the tiny board's three rows
        assert "".join(shown) == "".join(str(c) if board[c] == 0 else "XO"[board[c] - 1] for c in range(9))
        observed[move] += 1
        expected[free] += 1 / len(free)
        turns.append(info["turn"])
    assert ((observed - expected) ** 2 / expected).sum() < 26.1  # chi-square, 8 dof, p ~ 0.001
    assert set(turns) == {0, 1, 2, 3, 4}
    with pytest.raises(ValueError, match="layout"):
        teacher.Teacher(layout="boards")
    with pytest.raises(ValueError, match="tree_copies"):
        teacher.Teacher(kind="best", tree_copies=1, layout="positions")


def test_legal_choices_protocol():
    """Env.legal_choices: Tic-Tac-Toe's free cells, Connect Four's open columns (jitted, vmapped), None for
    arithmetic; num_legal_choices counts them."""
    from envs.registry import make

    env = make("tictactoe")
    examples = env.eval_examples(jax.random.PRNGKey(0), 16, env.eval_settings()[0].stage)
    states = jax.jit(jax.vmap(lambda e: env.reset(e, env.params)))(examples)
    legal = jax.jit(jax.vmap(lambda s: env.legal_choices(s, env.params)))(states)
    np.testing.assert_array_equal(np.asarray(legal), np.asarray(states.board) == 0)
    np.testing.assert_array_equal(jax.vmap(lambda s: env.num_legal_choices(s, env.params))(states),
                                  (np.asarray(states.board) == 0).sum(-1))
    c4 = make("connect_four")
    ex = c4.eval_examples(jax.random.PRNGKey(0), 4, c4.eval_settings()[0].stage)
    st = jax.jit(jax.vmap(lambda e: c4.reset(e, c4.params)))(ex)  # jitted: eager, the opponent's search op by op is slow
    assert np.asarray(jax.jit(jax.vmap(lambda s: c4.legal_choices(s, c4.params)))(st)).shape == (4, 7)
    arithmetic = make("arithmetic")
    assert arithmetic.legal_choices(None, arithmetic.params) is None
    assert arithmetic.num_legal_choices(None, arithmetic.params) is None


def test_last_turn_share_takes_the_games_last_turn():
    """last_turn_share = 1: every position is its game's last X turn (the same games as share 0, so the turn is
    the largest a row of that game can show, and the mean number of free cells drops); only for positions."""
    kwargs = dict(num_games=200, layout="positions", reasoning="none", explore_prob=1.0, opponent_p_min=1.0)
    key = jax.random.PRNGKey(6)
    uniform = teacher.Teacher(**kwargs).rows(key, "tiny", 8)
    last = teacher.Teacher(last_turn_share=1.0, **kwargs).rows(key, "tiny", 8)
    games = teacher.generate_expert_games(key, 200, teacher_random_move_prob=1.0, opponent_p_range=(1.0, 1.0))
    assert [r["info"]["turn"] for r in last] == [int(n) - 1 for n in games.num_moves]
    assert all(a["info"]["turn"] <= b["info"]["turn"] for a, b in zip(uniform, last))
    free = [np.mean([len(r["info"]["legal_choices"][0]) for r in rows]) for rows in (uniform, last)]
    assert free[1] < free[0] - 1
    with pytest.raises(ValueError, match="last_turn_share"):
        teacher.Teacher(last_turn_share=0.5)
