"""Connect Four as an environment of the protocol (`envs.core.Env`): examples, text, grammar, rubric, metrics.

The game is `envs.connect_four.game` (bitboard rules, the search opponent); its text `envs.connect_four.text`;
its SFT teacher `envs.connect_four.teacher` (search games). This module binds them:

    example   (seed uint32, random_move_prob f32, depth int32): the first mover, the opening and every
              opponent reply are pure functions of them; p stratified over a stage's [p_min, p_max]
    reply     `<move>c</move>`, c a column 0..6 (`ReplyGrammar("move", "cell", 7)`), format
              `<think>.*?</think>.*?<move>.*?</move>`
    rubric    win (1 win / 0.5 draw / 0 loss or unfinished) x 1, format (mean over replies) x 0.2, invalid
              (-0.1 once if any reply was an invalid move: a full column or not 0..6) x 1
    metrics   win, draw, loss, unfinished, invalid, missing (0/1 per game)
    eval      "random" (p = 1), "depth1", "depth2", "depth4" (p = 0, that search depth; each <= max_depth)
    params    prompt, rows / columns (must be the standard 6 x 7: a named error otherwise), max_depth (the
              deepest search compiled, 1..5: every opponent move costs a search tree of this depth, whatever
              the example's depth), the rubric's values and weights
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from envs.connect_four import game, text
from envs.connect_four.teacher import Teacher
from envs import board_game
from envs.board_game import BoardGameEnv
from envs.core import EvalSetting, ParsedReply, ReplyGrammar
from jaxrl_base.checks import ConfigError, check_choice, check_int


class Example(NamedTuple):
    """One game's example: its seed, the opponent's random-move probability and search depth."""

    seed: jax.Array  # uint32[]
    random_move_prob: jax.Array  # float32[]
    depth: jax.Array  # int32[]


@dataclasses.dataclass(frozen=True)
class Stage(board_game.OpponentStage):
    """A curriculum stage: p stratified over [p_min, p_max] (p = 1 random, p = 0 the pure search) and the
    search depth in 1..MAX_DEPTH (it must also be <= the env's max_depth; checked when examples are drawn)."""

    p_min: float = 0.0
    p_max: float = 1.0
    depth: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self, "depth", 1, game.MAX_DEPTH)


@dataclasses.dataclass(frozen=True)
class Params(board_game.RubricParams):
    """Static settings (see the module docstring; the rubric's fields are `board_game.RubricParams`)."""

    prompt: str = "tiny"
    rows: int = game.ROWS
    columns: int = game.COLUMNS
    max_depth: int = 4

    def __post_init__(self) -> None:
        check_choice(self, "prompt", tuple(text.PRESETS))
        check_int(self, "rows", 1)
        check_int(self, "columns", 1)
        if (self.rows, self.columns) != (game.ROWS, game.COLUMNS):
            raise ConfigError(f"board size {self.rows} x {self.columns} does not match the game's "
                              f"{game.ROWS} x {game.COLUMNS} (only the standard board is implemented); set rows = "
                              f"{game.ROWS}, columns = {game.COLUMNS}", ("rows",), "Params")
        check_int(self, "max_depth", 1, game.MAX_DEPTH)
        super().__post_init__()

    @property
    def preset(self) -> text.PromptPreset:
        return text.PRESETS[self.prompt]


_GRAMMAR = ReplyGrammar(tag="move", content="cell", num_cells=game.COLUMNS, format_tags=("think", "move"),
                        example_replies=("<think></think><move>3</move>", "<think>I block 2.</think>\n<move>2</move>",
                                         "<move>4</move>", "I play 6."))


def move_of(reply: ParsedReply) -> jax.Array:
    """The game's move code of a parsed reply: -1 no tag (NO_MOVE), the column, or 7 (INVALID_MOVE)."""
    return board_game.move_code(reply, game.NO_MOVE, game.INVALID_MOVE)


class ConnectFour(BoardGameEnv):
    """Connect Four (6 x 7) against the opponent mixture: random moves with probability p, else the search."""

    name = "connect_four"
    Params = Params
    Stage = Stage
    Teacher = Teacher
    game = game
    text = text
    grammar = _GRAMMAR

    Example = Example

    # ---- data ----
    def check_stage(self, stage: Stage) -> None:
        """The stage's search depth must be compiled: <= this env's max_depth."""
        if stage.depth > self.params.max_depth:
            raise ConfigError(f"search depth {stage.depth} is above the env's max_depth {self.params.max_depth}; "
                              "raise env.params.max_depth or lower the stage's depth", ("depth",), "Stage")

    def stratified_strengths(self, key, num_prompts, group_size, stage: Stage) -> tuple[jax.Array, jax.Array]:
        """One p per stratum of the stage's range (shuffled over the prompts), each prompt repeated group_size
        times."""
        k_seed, k_p = jax.random.split(key)
        seeds = jax.random.bits(k_seed, (num_prompts,), jnp.uint32)
        u = (jnp.arange(num_prompts) + jax.random.uniform(k_p, (num_prompts,))) / num_prompts
        probs = jax.random.permutation(jax.random.fold_in(k_p, 1), stage.p_min + (stage.p_max - stage.p_min) * u)
        return jnp.repeat(seeds, group_size), jnp.repeat(probs.astype(jnp.float32), group_size)

    def example(self, seeds: jax.Array, probs: jax.Array, stage: Stage) -> Example:
        """The Example with the stage's search depth."""
        return Example(seeds, probs, jnp.full(seeds.shape, stage.depth, jnp.int32))

    def eval_settings(self) -> tuple[EvalSetting, ...]:
        out = [EvalSetting("random", Stage(1.0, 1.0, 1))]
        out += [EvalSetting(f"depth{d}", Stage(0.0, 0.0, d)) for d in (1, 2, 4) if d <= self.params.max_depth]
        return tuple(out)

    # ---- dynamics ----
    def reset(self, example: Example, params: Params) -> game.State:
        return game.reset(example.seed, example.random_move_prob, example.depth, params.max_depth)

    def transition(self, state: game.State, reply: ParsedReply, params: Params) -> game.State:
        return game.transition(state, move_of(reply), params.max_depth)

    def legal_moves(self, state: game.State) -> jax.Array:
        return game.legal_columns(state.x, state.o) & ~state.done

    def position(self, state: game.State) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The model's and the opponent's pieces, and whether the game is over (the model moves otherwise)."""
        return state.x, state.o, state.done

    # ---- SFT ----
    def demonstrations(self, teacher: Teacher, key, params: Params, max_turns: int) -> list[dict]:
        return teacher.rows(key, params.prompt, params.max_depth)

