"""Tic-Tac-Toe as an environment of the protocol (`envs.core.Env`): examples, text, grammar, rubric, metrics.

The game is `envs.tictactoe.game` (rules, minimax opponent, seeds); its text is `envs.tictactoe.text`
(prompt presets, slots); its SFT teachers are `envs.tictactoe.teacher`. This module binds them:

    example   (seed uint32, random_move_prob f32): the first mover, the opening and every opponent reply
              are pure functions of them; stratified over a stage's [p_min, p_max] (`game.stratified_examples`)
              (+ start_moves int32 with exploring starts, `Stage.start_moves` > 0: a random mid-game start,
              `envs.tictactoe.starts`; None, the default, is the normal start)
    reply     `<move>k</move>` with k a cell 0..8 (`ReplyGrammar("move", "cell", 9)`), format
              `<think>.*?</think>.*?<move>.*?</move>`
    rubric    win (1 win / 0.5 draw / 0 loss or unfinished) x 1, format (mean over replies) x 0.2,
              invalid (-0.1 once if any reply was an invalid move) x 1: the spec's, total in [-0.1, 1.2]
    metrics   win, draw, loss, unfinished (the rollout stopped it), invalid, missing (0/1 per game)
    eval      "random" (p = 1) and "optimal" (p = 0)
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from envs import board_game
from envs.board_game import BoardGameEnv
from envs.core import EvalSetting, ParsedReply, ReplyGrammar
from envs.tictactoe import game, starts, text
from envs.tictactoe.teacher import Teacher
from jaxrl_base.checks import check_choice, check_int


class Example(NamedTuple):
    """One game's example: its seed and the opponent's random-move probability."""

    seed: jax.Array  # uint32[]
    random_move_prob: jax.Array  # float32[]
    start_moves: jax.Array | None = None  # int32[]: exploring starts' m (`starts`); None: the normal start


@dataclasses.dataclass(frozen=True)
class Stage(board_game.OpponentStage):
    """A curriculum stage: the opponent's random-move probability p is stratified over [p_min, p_max]
    (p = 1 a uniformly random opponent, p = 0 the optimal one). start_moves: exploring starts (off at 0):
    each game first plays n (uniform in 0..start_moves, at most 3, drawn from its seed) rounds of a random X
    move and a random O reply, so the model starts from a random live mid-game position (`starts`)."""

    p_min: float = 0.2
    p_max: float = 0.7
    start_moves: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self, "start_moves", 0, starts.MAX_START_MOVES)


@dataclasses.dataclass(frozen=True)
class Params(board_game.RubricParams):
    """Static settings: the prompt preset ("reference", "compact", "tiny", "tiny_lines"; see `text.PRESETS`)
    and the rubric (`board_game.RubricParams`)."""

    prompt: str = "reference"

    def __post_init__(self) -> None:
        check_choice(self, "prompt", tuple(text.PRESETS))
        super().__post_init__()

    @property
    def preset(self) -> text.PromptPreset:
        return text.PRESETS[self.prompt]


_GRAMMAR = ReplyGrammar(tag="move", content="cell", num_cells=game.NUM_CELLS, format_tags=("think", "move"),
                        example_replies=("<think>I can win at 2.</think>\n<move>2</move>", "<move>4</move>",
                                         "I must block at 6."))


def move_of(reply: ParsedReply) -> jax.Array:
    """The game's move code of a parsed reply: -1 no tag (NO_MOVE), the cell, or 9 (INVALID_MOVE)."""
    return board_game.move_code(reply, game.NO_MOVE, game.INVALID_MOVE)


class TicTacToe(BoardGameEnv):
    """Tic-Tac-Toe against the controlled minimax opponent (`shared/TICTACTOE_SPEC.md`)."""

    name = "tictactoe"
    Params = Params
    Stage = Stage
    Teacher = Teacher
    game = game
    text = text
    grammar = _GRAMMAR
    Example = Example

    # ---- data ----
    def stratified_strengths(self, key, num_prompts, group_size, stage: Stage) -> tuple[jax.Array, jax.Array]:
        """`game.stratified_examples`: one p per equal-width bucket of the stage's range."""
        return game.stratified_examples(key, num_prompts, group_size, stage.p_min, stage.p_max)

    def example(self, seeds, probs, stage: Stage) -> Example:
        """(seed, p) and, for a stage with exploring starts, its start_moves per game."""
        if not stage.start_moves:
            return Example(seeds, probs)
        return Example(seeds, probs, jnp.full(jnp.shape(seeds), stage.start_moves, jnp.int32))

    def eval_settings(self) -> tuple[EvalSetting, ...]:
        return (EvalSetting("random", Stage(1.0, 1.0)), EvalSetting("optimal", Stage(0.0, 0.0)))

    # ---- dynamics ----
    def reset(self, example: Example, params: Params) -> game.State:
        state = game.reset(example.seed, example.random_move_prob)
        if example.start_moves is None:
            return state
        return starts.exploring_start(state, example.start_moves)

    def transition(self, state: game.State, reply: ParsedReply, params: Params) -> game.State:
        return game.transition(state, move_of(reply))

    def legal_moves(self, state: game.State) -> jax.Array:
        return game.legal_moves(state.board) & ~state.done

    def position(self, state: game.State) -> tuple[jax.Array, jax.Array]:
        return state.board, state.to_play

    # ---- text ----
    def message_codes(self, state: game.State, params: Params) -> jax.Array:
        """The slots' codes of the message `state` shows, in the preset's slot layout (`text.message_codes`)."""
        return text.message_codes(state, params.preset)

    # ---- text for the project tokenizer ----
    def tokenizer_corpus(self, params: Params) -> list[str]:
        """Every message form on every reachable board of both long prompt presets, and reasoning phrases:
        the text the shipped project tokenizer was trained on (`envs.tictactoe.corpus`)."""
        from envs.tictactoe.corpus import corpus

        return corpus()

    # ---- SFT ----
    def demonstrations(self, teacher: Teacher, key, params: Params, max_turns: int) -> list[dict]:
        return teacher.rows(key, params.prompt, max_turns)

    def has_check_rows(self, teacher: Teacher) -> bool:
        return teacher.deterministic

    def check_rows(self, teacher: Teacher, params: Params) -> list[dict] | None:
        """A deterministic teacher's whole game tree (738 games for "best"): exact on all = plays like it."""
        if not teacher.deterministic:
            return None
        from envs.tictactoe.teacher import exhaustive_expert_games, games_to_rows

        return games_to_rows(exhaustive_expert_games(teacher.kind), params.prompt, reasoning=teacher.reasoning)


def outcome_rates(outcome: jax.Array, done: jax.Array) -> dict[str, float]:
    """Win / draw / loss / unfinished rates of a batch of games from their outcome codes and done flags
    (host): the means of `board_game.outcome_metrics`, the one W/D/L summary (the baselines use it)."""
    metrics = board_game.outcome_metrics(jnp.asarray(outcome), jnp.asarray(done), game)
    return {k: float(np.mean(jax.device_get(v))) for k, v in metrics.items()}
