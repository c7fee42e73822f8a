"""What the turn-based board games of the protocol share (Tic-Tac-Toe, Connect Four).

A board game here is one reply a turn, `<move>k</move>` with k a move index, against a scripted opponent,
scored by the spec's rubric:

    win      win_value (1) for a win, draw_value (0.5) for a draw, loss_value (0) for a loss or an
             unfinished game, x win_weight (1)
    format   the mean of the replies' format flags, x format_weight (0.2)
    invalid  invalid_penalty (-0.1) once if any reply was an invalid move, x invalid_weight (1)

Both games play against the same kind of opponent: with probability p a uniformly random legal move, else
the game's own strong move. So they share

    Stage        `OpponentStage(p_min, p_max)`: p stratified over [p_min, p_max] (a game's Stage extends it)
    Params       `RubricParams`: the rubric's values and weights above (a game's Params extends it)
    examples     `Example(seed, random_move_prob, ...)`: `sample_examples` draws one seed and one p per prompt
                 (`stratified_strengths`, the game's), each repeated group_size times; `eval_examples` draws p
                 uniformly in the stage's range; `example_metrics` the mean p

`BoardGameEnv` implements the protocol's data, text, rubric and metric methods from four class attributes:
`game` (a module with reset/step, OUTCOME_WIN / DRAW / LOSS, NO_MOVE and INVALID_MOVE, a `State` with
`done`, `outcome`, `invalid_moves` and `missing_moves`), `text` (a module with system_prompt(preset),
message_spec(preset) and message_codes(state)), `grammar` (the `ReplyGrammar`) and `Example`. A game adds its
stratification, eval settings, dynamics (`reset`, `transition`) and `legal_moves(state) -> bool[num_moves]`,
which also gives `random_reply` (a uniformly random legal move; the demo and the random baselines use it).
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from envs.core import Env, Episode, ParsedReply, ReplyGrammar, RubricPart, hash_leaves
from jaxrl_base.checks import ConfigError, check_float, check_probability

RUBRIC_VALUES = ("win_value", "draw_value", "loss_value")
RUBRIC_WEIGHTS = ("win_weight", "format_weight", "invalid_weight")


def check_rubric(params: Any) -> None:
    """Validates the rubric fields of a board game's Params (any finite values; penalty <= 0; weights >= 0)."""
    for name in RUBRIC_VALUES:
        check_float(params, name)
    check_float(params, "invalid_penalty", high=0.0)
    for name in RUBRIC_WEIGHTS:
        check_float(params, name, low=0.0)


@dataclasses.dataclass(frozen=True)
class OpponentStage:
    """A curriculum stage of a board game: the opponent's random-move probability p is stratified over
    [p_min, p_max] (p = 1 a uniformly random opponent, p = 0 the game's strongest)."""

    p_min: float = 0.0
    p_max: float = 1.0

    def __post_init__(self) -> None:
        check_probability(self, "p_min")
        check_probability(self, "p_max")
        if self.p_min > self.p_max:
            raise ConfigError(f"must be <= p_max (got p_min {self.p_min} > p_max {self.p_max})", ("p_min",),
                              type(self).__name__)


@dataclasses.dataclass(frozen=True)
class RubricParams:
    """The rubric's fields of a board game's Params: the win part's values (win / draw / loss or
    unfinished), the invalid penalty (<= 0, once per game with an invalid move) and the three weights."""

    win_value: float = 1.0
    draw_value: float = 0.5
    loss_value: float = 0.0
    invalid_penalty: float = -0.1
    win_weight: float = 1.0
    format_weight: float = 0.2
    invalid_weight: float = 1.0

    def __post_init__(self) -> None:
        check_rubric(self)


def move_code(reply: ParsedReply, no_move: int, invalid_move: int) -> jax.Array:
    """The game's move code of a parsed reply: `no_move` (no tag), the move, or `invalid_move` -> int32[]."""
    return jnp.where(~reply.found, no_move, jnp.where(reply.valid, reply.value, invalid_move)).astype(jnp.int32)


def outcome_metrics(outcome: jax.Array, done: jax.Array, game: ModuleType) -> dict[str, jax.Array]:
    """0/1 per game (any shape): won, drawn, lost (the game ended so) or unfinished (it did not end)."""
    return {
        "win": (done & (outcome == game.OUTCOME_WIN)).astype(jnp.float32),
        "draw": (done & (outcome == game.OUTCOME_DRAW)).astype(jnp.float32),
        "loss": (done & (outcome == game.OUTCOME_LOSS)).astype(jnp.float32),
        "unfinished": (~done).astype(jnp.float32),
    }


class BoardGameEnv(Env):
    """The shared half of a board game env (see the module docstring); subclasses set `game`, `text`,
    `grammar`, `Example` and implement `stratified_strengths`, the eval settings, the dynamics and
    `legal_moves`."""

    game: ClassVar[ModuleType]
    text: ClassVar[ModuleType]
    grammar: ClassVar[ReplyGrammar]
    Example: ClassVar[type]  # a NamedTuple whose first fields are seed (uint32) and random_move_prob (f32)
    final_message = True
    results_columns = (("W", "win"), ("D", "draw"), ("L", "loss"), ("format", "format"), ("invalid", "invalid"))
    outcome_metrics = ("win", "draw", "loss", "unfinished")
    reward_params = (*RUBRIC_VALUES, "invalid_penalty", *RUBRIC_WEIGHTS)

    # ---- data ----
    def stratified_strengths(self, key: jax.Array, num_prompts: int, group_size: int,
                             stage: OpponentStage) -> tuple[jax.Array, jax.Array]:
        """(seeds uint32[num_prompts * group_size], p f32[same]): one seed and one p per prompt, p stratified
        over the stage's range, each prompt repeated group_size times consecutively (the game's own draw)."""
        raise NotImplementedError

    def check_stage(self, stage: OpponentStage) -> None:
        """Raises ConfigError for a stage these params cannot play (default: every stage is playable)."""

    def example(self, seeds: jax.Array, probs: jax.Array, stage: OpponentStage) -> Any:
        """The `Example` of seeds and opponent p's (uint32[N], f32[N]) in `stage` (a game adds its fields)."""
        return self.Example(seeds, probs)

    def sample_examples(self, key: jax.Array, num_prompts: int, group_size: int, stage: OpponentStage) -> Any:
        """Stratified opponent strengths over the stage's range, each prompt repeated group_size times."""
        self.check_stage(stage)
        seeds, probs = self.stratified_strengths(key, num_prompts, group_size, stage)
        return self.example(seeds, probs, stage)

    def eval_examples(self, key: jax.Array, num_games: int, stage: OpponentStage) -> Any:
        """Seeds drawn directly from `key`; p uniform in the stage's range (constant for a point range)."""
        self.check_stage(stage)
        seeds = jax.random.bits(key, (num_games,), jnp.uint32)
        if stage.p_min == stage.p_max:
            probs = jnp.full((num_games,), stage.p_min, jnp.float32)
        else:
            probs = jax.random.uniform(jax.random.fold_in(key, 1), (num_games,), jnp.float32, stage.p_min,
                                       stage.p_max)
        return self.example(seeds, probs, stage)

    def example_metrics(self, examples: Any) -> dict[str, jax.Array]:
        """Batch figures of the examples themselves: the mean opponent p."""
        return {"p_mean": jnp.mean(examples.random_move_prob)}

    # ---- dynamics ----

    def done(self, state: Any) -> jax.Array:
        return state.done

    def legal_moves(self, state: Any) -> jax.Array:
        """bool[num_moves]: the moves the model may play now (all False once the game is over)."""
        raise NotImplementedError

    def legal_choices(self, state: Any, params: Any) -> jax.Array:
        """bool[num_moves]: the protocol's legal choices of the "cell" grammar: `legal_moves`."""
        return self.legal_moves(state)

    def random_reply(self, key: jax.Array, state: Any, params: Any) -> ParsedReply:
        """A uniformly random legal move, well formatted (an invalid move when none is legal)."""
        legal = self.legal_moves(state)
        move = jax.random.categorical(key, jnp.where(legal, 0.0, -jnp.inf)).astype(jnp.int32)
        return ParsedReply(value=jnp.where(legal.any(), move, 0), found=jnp.bool_(True), valid=legal.any(),
                           format_ok=jnp.bool_(True))

    # ---- per-turn credit ----
    def position(self, state: Any) -> Any:
        """The pytree that identifies the position the model moves from: the board and whose turn."""
        raise NotImplementedError

    def state_key(self, state: Any, params: Any) -> jax.Array:
        """uint32[]: a hash of `position(state)` (the board and whose turn; not the seed or the counters)."""
        return hash_leaves(self.position(state))

    def turn_reward(self, prev_state: Any, state: Any, params: Any) -> jax.Array:
        """f32[]: invalid_weight * invalid_penalty on a turn that made an invalid move, else 0 (the rubric's
        invalid part, weighted, charged to each turn that earned it)."""
        invalid = state.invalid_moves > prev_state.invalid_moves
        return jnp.where(invalid, jnp.float32(params.invalid_weight * params.invalid_penalty), jnp.float32(0.0))

    # ---- text ----
    def system_prompt(self, params: Any) -> str:
        return self.text.system_prompt(params.preset)

    def message_spec(self, params: Any):
        return self.text.message_spec(params.preset)

    def message_codes(self, state: Any, params: Any) -> jax.Array:
        return self.text.message_codes(state)

    def reply_grammar(self, params: Any) -> ReplyGrammar:
        return self.grammar

    # ---- reward and metrics ----
    def rubric(self, params: Any) -> tuple[RubricPart, ...]:
        return (RubricPart("win", params.win_weight), RubricPart("format", params.format_weight),
                RubricPart("invalid", params.invalid_weight))

    def reward_parts(self, state: Any, episode: Episode, params: Any) -> dict[str, jax.Array]:
        game = self.game
        win = jnp.select([state.done & (state.outcome == game.OUTCOME_WIN),
                          state.done & (state.outcome == game.OUTCOME_DRAW)],
                         [jnp.float32(params.win_value), jnp.float32(params.draw_value)], jnp.float32(params.loss_value))
        invalid = jnp.where(state.invalid_moves > 0, jnp.float32(params.invalid_penalty), jnp.float32(0.0))
        return {"win": win, "format": jnp.asarray(episode.format_score, jnp.float32), "invalid": invalid}

    def metrics(self, state: Any, episode: Episode, params: Any) -> dict[str, jax.Array]:
        return {**outcome_metrics(state.outcome, state.done, self.game),
                "invalid": (state.invalid_moves > 0).astype(jnp.float32),
                "missing": (state.missing_moves > 0).astype(jnp.float32)}
