"""Tic-Tac-Toe as an environment of the protocol (`envs.core.Env`): examples, text, grammar, rubric, metrics.

The game is `envs.tictactoe.game` (rules, minimax opponent, seeds); its text is `envs.tictactoe.text`
(prompt presets, slots); its SFT teachers are `envs.tictactoe.teacher`. This module binds them:

    example   (seed uint32, random_move_prob f32): the first mover, the opening and every opponent reply
              are pure functions of them; stratified over a stage's [p_min, p_max] (`game.stratified_examples`)
    reply     `<move>k</move>` with k a cell 0..8 (`ReplyGrammar("move", "cell", 9)`), format
              `<think>.*?</think>.*?<move>.*?</move>`
    rubric    win (1 win / 0.5 draw / 0 loss or unfinished) x 1, format (mean over replies) x 0.2,
              invalid (-0.1 once if any reply was an invalid move) x 1: the spec's, total in [-0.1, 1.2]
    metrics   win, draw, loss, unfinished (the rollout stopped it), invalid, missing (0/1 per game)
    eval      "random" (p = 1) and "optimal" (p = 0)
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from envs import board_game
from envs.board_game import BoardGameEnv
from envs.core import EvalSetting, HumanPlay, ParsedReply, ReplyGrammar
from envs.tictactoe import game, text
from envs.tictactoe.teacher import Teacher
from jaxrl_llm.checks import ConfigError, check_choice, check_probability


class Example(NamedTuple):
    """One game's example: its seed and the opponent's random-move probability."""

    seed: jax.Array  # uint32[]
    random_move_prob: jax.Array  # float32[]


@dataclasses.dataclass(frozen=True)
class Stage:
    """A curriculum stage: the opponent's random-move probability p is stratified over [p_min, p_max]
    (p = 1 a uniformly random opponent, p = 0 the optimal one)."""

    p_min: float = 0.2
    p_max: float = 0.7

    def __post_init__(self) -> None:
        check_probability(self, "p_min")
        check_probability(self, "p_max")
        if self.p_min > self.p_max:
            raise ConfigError(f"must be <= p_max (got p_min {self.p_min} > p_max {self.p_max})", ("p_min",),
                              "Stage")


@dataclasses.dataclass(frozen=True)
class Params:
    """Static settings: the prompt preset ("reference", "compact", "tiny"; see `text.PRESETS`) and the
    rubric: the win part's values (win / draw / loss or unfinished), the invalid penalty (<= 0, once per
    game with an invalid move) and the three weights."""

    prompt: str = "reference"
    win_value: float = 1.0
    draw_value: float = 0.5
    loss_value: float = 0.0
    invalid_penalty: float = -0.1
    win_weight: float = 1.0
    format_weight: float = 0.2
    invalid_weight: float = 1.0

    def __post_init__(self) -> None:
        check_choice(self, "prompt", tuple(text.PRESETS))
        board_game.check_rubric(self)

    @property
    def preset(self) -> text.PromptPreset:
        return text.PRESETS[self.prompt]


_GRAMMAR = ReplyGrammar(tag="move", content="cell", num_cells=game.NUM_CELLS, format_tags=("think", "move"),
                        example_replies=("<think>I can win at 2.</think>\n<move>2</move>", "<move>4</move>",
                                         "I must block at 6."))


def move_of(reply: ParsedReply) -> jax.Array:
    """The game's move code of a parsed reply: -1 no tag (NO_MOVE), the cell, or 9 (INVALID_MOVE)."""
    return board_game.move_code(reply, game.NO_MOVE, game.INVALID_MOVE)


def _new_game() -> game.State:
    state = jax.device_get(game.reset(np.uint32(0), np.float32(0.0)))
    return state._replace(board=np.zeros(game.NUM_CELLS, np.int8), last_opponent_move=np.int8(-1),
                          status=np.int8(game.STATUS_START_MODEL_FIRST))


def _view(state) -> str:
    return text.render_board(text.PRESETS["reference"], np.asarray(state.board).tolist())


def _choices(state) -> list[str]:
    return [str(i) for i in range(game.NUM_CELLS) if int(np.asarray(state.board)[i]) == game.EMPTY]


def _apply_model(state, reply: ParsedReply):
    return jax.device_get(jax.jit(game.model_move)(state, move_of(reply)))


def _human_to_move(state) -> bool:
    return not bool(state.done) and int(state.status) == game.STATUS_OPP_MOVED


def _apply_human(state, choice: str):
    return jax.device_get(jax.jit(game.opponent_move_applied)(state, int(choice)))


def _opening(state, choice: str):
    return _apply_human(state, choice)._replace(status=np.int8(game.STATUS_START_OPP_FIRST))


class TicTacToe(BoardGameEnv):
    """Tic-Tac-Toe against the controlled minimax opponent (`shared/TICTACTOE_SPEC.md`)."""

    name = "tictactoe"
    Params = Params
    Stage = Stage
    Teacher = Teacher
    game = game
    text = text
    grammar = _GRAMMAR
    human = HumanPlay(new_game=_new_game, view=_view, choices=_choices, apply_model=_apply_model,
                      human_to_move=_human_to_move, apply_human=_apply_human, opening=_opening)

    # ---- data ----
    def sample_examples(self, key, num_prompts, group_size, stage: Stage) -> Example:
        """Stratified opponent strengths over the stage's range, each prompt repeated group_size times."""
        seeds, probs = game.stratified_examples(key, num_prompts, group_size, stage.p_min, stage.p_max)
        return Example(seeds, probs)

    def eval_examples(self, key, num_games, stage: Stage) -> Example:
        """Seeds drawn directly from `key`; p uniform in the stage's range (constant for a point range)."""
        seeds = jax.random.bits(key, (num_games,), jnp.uint32)
        if stage.p_min == stage.p_max:
            probs = jnp.full((num_games,), stage.p_min, jnp.float32)
        else:
            probs = jax.random.uniform(jax.random.fold_in(key, 1), (num_games,), jnp.float32, stage.p_min,
                                       stage.p_max)
        return Example(seeds, probs)

    def eval_settings(self) -> tuple[EvalSetting, ...]:
        return (EvalSetting("random", Stage(1.0, 1.0)), EvalSetting("optimal", Stage(0.0, 0.0)))

    def example_metrics(self, examples: Example) -> dict[str, jax.Array]:
        """Batch figures of the examples themselves: the mean opponent p."""
        return {"p_mean": jnp.mean(examples.random_move_prob)}

    # ---- dynamics ----
    def reset(self, example: Example, params: Params) -> game.State:
        return game.reset(example.seed, example.random_move_prob)

    def step(self, state: game.State, reply: ParsedReply, params: Params) -> game.State:
        return game.step(state, move_of(reply))

    def legal_moves(self, state: game.State) -> jax.Array:
        return game.legal_moves(state.board) & ~state.done

    def position(self, state: game.State) -> tuple[jax.Array, jax.Array]:
        return state.board, state.to_play

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

    def example_info(self, example: Any) -> dict[str, Any]:
        return {"seed": int(np.asarray(example.seed)), "random_move_prob": float(np.asarray(example.random_move_prob))}



def outcome_rates(outcome: jax.Array, done: jax.Array) -> dict[str, float]:
    """Win / draw / loss / unfinished rates of a batch of games from their outcome codes and done flags
    (host): the means of `board_game.outcome_metrics`, the one W/D/L summary (the baselines use it)."""
    metrics = board_game.outcome_metrics(jnp.asarray(outcome), jnp.asarray(done), game)
    return {k: float(np.mean(jax.device_get(v))) for k, v in metrics.items()}
