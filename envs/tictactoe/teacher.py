"""Tic-Tac-Toe teachers for SFT: the `Teacher` config (the `[sft.teacher]` table), re-exporting its parts.

The parts, one job each: `teachers` (the minimax policies and move kinds), `expert_games` (their games on
device), `tree` (a deterministic teacher's whole game tree), `rows` (games rendered as SFT rows).

Generation (on device). `expert_games_device` plays many games at once (`jit` + `vmap` over games, `lax.scan`
over the model's turns) with the game's own `reset` / `step`: X, the model's side, is a teacher that with
probability `explore` takes a uniformly random free cell and otherwise (kind "uniform") a uniform draw among ALL
of `optimal_moves(board, X)` or (kind "best") the deterministic move of `best_move_table()`: the value-keeping
move that wins most often against the random opponent, or (kind "drawn") that of `drawn_move_table()`, one
uniform draw among the value-keeping moves per board, made once; O is the game's own opponent with a per-game
`random_move_prob` drawn uniformly in the teacher's opponent range. Per model turn it records the board before
the move, the move, whether the teacher explored, the move's kind (`move_kind`, also on device) and the state
that the next environment message renders. Move kinds, first that applies: win (the move completes three X in
a line), block (O would complete a line on that cell), centre (cell 4), corner (0, 2, 6, 8), other.

The tree (host). The "best" teacher is deterministic, so the games it can meet against ANY opponent form a
tree (738 games); `exhaustive_expert_games` walks it depth first with the game's `model_move` and
`opponent_move_applied`, and `best_move_table` runs its dynamic programme over the game's own `winner` and
minimax tables: the rules live only in `envs.tictactoe.game`.

Rendering (host). `games_to_rows` renders every game with a prompt preset of `envs.tictactoe.text`
(`system_prompt` for the system message, `render_message` for every environment message) and writes each reply
as `<think>{reasoning}</think>\n<move>{k}</move>`, the reasoning a short template chosen from the move kind
(two wordings per kind, picked by the game's seed and turn; see `REASONING`), or empty with reasoning "none".
Lost games are filtered out, as the reference did for `anakin87/tictactoe-filtered`, and so are unfinished ones.
A row is one whole game in the conversational prompt/completion layout of `anakin87/tictactoe` (see
`jaxrl_llm.data.sft_data`), with `info` {example_seed, random_move_prob, initial_board, teacher_random_move_prob,
moves, move_kinds, explored, outcome, preset}.
"""

from __future__ import annotations

import dataclasses

import jax

from envs.tictactoe.expert_games import *  # noqa: F401,F403  (the parts' names, re-exported)
from envs.tictactoe.rows import *  # noqa: F401,F403
from envs.tictactoe.rows import REASONING_STYLES, expert_rows, position_rows
from envs.tictactoe.teachers import *  # noqa: F401,F403
from envs.tictactoe.teachers import DETERMINISTIC_TEACHERS, TEACHERS
from envs.tictactoe.tree import *  # noqa: F401,F403
from jaxrl_base.checks import ConfigError, check_choice, check_int, check_probability

LAYOUTS = ("games", "positions")  # a row: a whole game, or one reply to one position


@dataclasses.dataclass(frozen=True)
class Teacher:
    """Tic-Tac-Toe SFT data: `num_games` games of a minimax teacher against the game's opponent.

    kind: "uniform" (a uniform draw among the optimal moves at every move), "best" (the optimal move that
    wins most often against the random opponent, deterministic) or "drawn" (one uniform draw among the
    optimal moves per board, made once and fixed: `drawn_move_table`, deterministic); reasoning: "templates" (a short templated thought in
    <think>) or "none" (an empty <think></think>); explore_prob: how often the teacher plays a uniformly
    random legal move instead (its replies stay well formatted); the opponent plays at p uniform in
    [opponent_p_min, opponent_p_max] (None: = opponent_p_min); tree_copies: copies of every game a
    deterministic teacher can meet (its whole tree: 738 games for "best") added to the sampled ones;
    sample_kind: the teacher of the `num_games` sampled games (None: `kind`). E.g. kind "drawn" with
    sample_kind "uniform": the drawn teacher's tree plus games whose every move is a fresh uniform draw
    among the value-keeping moves, so the model also puts some mass on the other value-keeping moves.
    keep_losses: keep the sampled games X lost (default: dropped, as the reference's filtered data set). With
    explore_prob = 1 and opponent_p_min = 1 the data are then the random legal mover's games against the
    random opponent, unfiltered: they teach the format and the legal moves and no strategy.
    layout: "games" (one row a whole game, as above) or "positions" (one row a single reply: of each of the
    `num_games` games one X turn, uniform among its turns, as system + that message + the teacher's reply;
    `position_rows`; outcome filter and tree do not apply); last_turn_share: the share of those rows that take
    the game's last X turn (fewest free cells) instead. Every row's info lists the legal choices of each
    reply (`legal_choices`), for the SFT decision metrics.
    symmetries: each sampled game also in its 7 other images under the board's rotations and reflections
    (`symmetry`): 8x the rows from the same `num_games` teacher games (layout "games" only; off by default).
    """

    num_games: int = 1000
    kind: str = "uniform"
    reasoning: str = "templates"
    explore_prob: float = 0.0
    opponent_p_min: float = 0.5
    opponent_p_max: float | None = None
    tree_copies: int = 0
    sample_kind: str | None = None
    keep_losses: bool = False
    layout: str = "games"
    last_turn_share: float = 0.0
    symmetries: bool = False

    def __post_init__(self) -> None:
        check_probability(self, "last_turn_share")
        if self.last_turn_share and self.layout != "positions":
            raise ConfigError('applies to layout = "positions" only', ("last_turn_share",), "Teacher")
        check_int(self, "num_games", 1)
        check_choice(self, "layout", LAYOUTS)
        if self.layout == "positions" and self.tree_copies:
            raise ConfigError('a whole-game tree does not apply to layout = "positions"; set tree_copies = 0',
                              ("tree_copies",), "Teacher")
        check_choice(self, "kind", TEACHERS)
        if self.sample_kind is not None:
            check_choice(self, "sample_kind", TEACHERS)
        check_choice(self, "reasoning", REASONING_STYLES)
        check_probability(self, "explore_prob")
        check_probability(self, "opponent_p_min")
        if self.opponent_p_max is not None:
            check_probability(self, "opponent_p_max")
            if self.opponent_p_max < self.opponent_p_min:
                raise ConfigError(f"must be >= opponent_p_min ({self.opponent_p_min}), got {self.opponent_p_max}",
                                  ("opponent_p_max",), "Teacher")
        check_int(self, "tree_copies", 0)
        if not isinstance(self.symmetries, bool):
            raise ConfigError(f"must be true or false, got {self.symmetries!r}", ("symmetries",), "Teacher")
        if self.symmetries and self.layout != "games":
            raise ConfigError('applies to layout = "games" only', ("symmetries",), "Teacher")
        if not isinstance(self.keep_losses, bool):
            raise ConfigError(f"must be true or false, got {self.keep_losses!r}", ("keep_losses",), "Teacher")
        if self.tree_copies and (self.kind not in DETERMINISTIC_TEACHERS or self.explore_prob > 0):
            raise ConfigError('needs a deterministic teacher: kind = "best" or "drawn", and explore_prob = 0',
                              ("tree_copies",), "Teacher")

    @property
    def opponent_p_range(self) -> tuple[float, float]:
        """(p_min, p_max) of the teacher's opponent."""
        return self.opponent_p_min, self.opponent_p_min if self.opponent_p_max is None else self.opponent_p_max

    @property
    def deterministic(self) -> bool:
        """A fixed-table teacher without exploration: its whole game tree is a complete exactness check."""
        return self.kind in DETERMINISTIC_TEACHERS and self.explore_prob == 0

    def rows(self, key: jax.Array, preset: str, max_turns: int) -> list[dict]:
        """The SFT rows of this teacher (see `expert_rows`, or `position_rows` for layout "positions")."""
        if self.layout == "positions":
            return position_rows(key, self.num_games, teacher_random_move_prob=self.explore_prob,
                                 opponent_p_range=self.opponent_p_range, preset=preset, max_turns=max_turns,
                                 teacher=self.sample_kind or self.kind, reasoning=self.reasoning,
                                 last_turn_share=self.last_turn_share)
        return expert_rows(key, self.num_games, teacher_random_move_prob=self.explore_prob,
                           opponent_p_range=self.opponent_p_range, preset=preset, max_turns=max_turns,
                           teacher=self.sample_kind or self.kind, reasoning=self.reasoning,
                           tree_copies=self.tree_copies, tree_teacher=self.kind, keep_losses=self.keep_losses,
                           symmetries=self.symmetries)
