"""The environment protocol: a text environment as a few pure, jittable functions plus declarative data.

An environment is a subclass of `Env` (a frozen dataclass holding its `params`, so an instance is
hashable and can be a static argument of `jax.jit`). The rollout, the trainer, evaluation, the config,
checkpoints and the CLI use nothing else of it. Modelled on pgx's `Env` (one base class, each game fills
in a few methods, a `make(id)` registry) and on gymnax's explicit `EnvParams` (difficulty and limits are
data, passed in).

What an environment provides (shapes are per game; vmap over a leading batch axis):

  data        `Params`: frozen dataclass of static settings (reward values, prompt style, sizes).
              `Stage`:  frozen dataclass of one curriculum stage (difficulty), e.g. an opponent strength.
              `sample_examples(key, num_prompts, group_size, stage) -> Example [num_prompts * group_size]`
                  (each prompt repeated `group_size` times consecutively: the rows of a GRPO group).
              `eval_examples(key, num_games, stage) -> Example [num_games]` (default: groups of one).
              `eval_settings() -> (EvalSetting(name, stage), ...)`: what `jaxrl-llm eval` measures.
  dynamics    `reset(example, params) -> State` and `transition(state, reply: ParsedReply, params) -> State`
              (the rules of a live game; a scripted opponent lives inside it). `done(state) -> bool[]`:
              the game is over. `Env.step` is `transition` with the protocol's one shared rule, written
              here once as in pgx's `Env.step`: a done state comes back unchanged (`keep_finished`; an
              env that overrides `step` itself must keep it). Turn limits are not the env's business:
              the rollout stops a game after `max_turns` replies (or when its context is full).
  text        `system_prompt(params) -> str` (host) and `message_spec(params) -> MessageSpec` (host):
              the env's messages as slots of finite piece tables; `message_codes(state, params) ->
              int32[num_slots]`: which piece each slot shows for this state (on device). The text bridge
              tokenizes every piece once and checks the concatenation against the chat template.
              `reply_grammar(params) -> ReplyGrammar`: the tag and the content kind the model answers in.
              `final_message`: whether a finished game gets a last message (e.g. "You win!").
  reward      `rubric(params) -> (RubricPart(name, weight), ...)` and `reward_parts(state, episode,
              params) -> {name: f32[]}` (unweighted values; reward = sum of weight * value, a weight-0
              part is a metric only); `metrics(state, episode, params) -> {name: f32[]}` per game (names
              other than the generic "format", "reward", "games", "turns"); `example_metrics(examples)`
              for batch figures of the examples (e.g. a mean difficulty). `reward_params`: the Params
              fields that only weigh the reward (e.g. rubric weights): a model trained with other values
              of them may go on training or be evaluated here (checkpoint checks ignore them).
              `results_columns`: (header, metric) pairs of the results table; `outcome_metrics`: the
              0/1 metrics that name a game's outcome (for readable game records). `metric_kinds`:
              {name: "mean"} for a metric that is a mean (e.g. guesses per game), not a 0/1 rate: tables,
              logs (`<name>_mean`, not `<name>_rate`) and `demo` show it as a number. `envs.check_env`
              checks that every other metric is in [0, 1].
  optional    `Teacher` + `demonstrations(teacher, key, params, max_turns) -> rows`, `has_check_rows` /
              `check_rows(teacher, params)`: SFT data as prompt/completion rows and an exactness check;
              `random_reply(key, state, params) ->
              ParsedReply`: a random reply for baselines and `jaxrl-llm demo` (default: a uniform value of
              the reply grammar; a game overrides it with a uniformly random legal move);
              `tokenizer_corpus(params) -> [str]` (host): text to train a project tokenizer on;
              `legal_choices(state, params) -> bool[C] | None`: for a "cell" grammar (C = num_cells) the
              choices legal now (default None: the env cannot say); `num_legal_choices` counts them.
              Per-turn credit (GRPO's "step" / "mix" advantages): `turn_reward(prev_state, state,
              params) -> f32[]` a turn's own reward (default 0) and `state_key(state, params) ->
              uint32[]` the key of the state a turn is played from (default a hash of every leaf).

`Episode` is what the rollout knows about a game that the env does not (format score, replies, cuts).
Terminal play (`jaxrl-llm play`) is not part of the protocol: its hooks live beside the CLI
(`jaxrl_llm.cli.human`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from jaxrl_base.moved import moved_names

__all__ = [
    "Env",
    "Episode",
    "EvalSetting",
    "MessageFamily",
    "MessageSpec",
    "ParsedReply",
    "ReplyGrammar",
    "RubricPart",
    "Slot",
    "CONTENT_KINDS",
    "make",
    "register",
    "registered",
    "env_class",
    "class_path",
    "entry_point_envs",
    "EnvNotFoundError",
    "ENTRY_POINT_GROUP",
    "weighted_reward",
    "keep_finished",
]


# ----------------------------------------------------------------------------------------------------------
# What the rollout hands to the env, and what it knows that the env does not
# ----------------------------------------------------------------------------------------------------------


class ParsedReply(NamedTuple):
    """One parsed model reply (per game; batched: a leading axis on every field).

    found: bool[]      the reply holds `<tag> ... </tag>` (the first such pair counts)
    valid: bool[]      its content, stripped, is a well-formed value of the grammar's content kind
    value: int32[]     that value (cell index or integer; 0 unless valid)
    format_ok: bool[]  the reply matches the grammar's format pattern
    """

    found: jax.Array
    valid: jax.Array
    value: jax.Array
    format_ok: jax.Array

    @staticmethod
    def of(value: Any, format_ok: Any = True) -> "ParsedReply":
        """A well-formed reply carrying `value` (int32, any shape): for driving an env without a model."""
        value = jnp.asarray(value, jnp.int32)
        ones = jnp.ones(value.shape, bool)
        return ParsedReply(ones, ones, value, jnp.broadcast_to(jnp.asarray(format_ok, bool), value.shape))


class Episode(NamedTuple):
    """What the rollout knows of a game at its end (per game).

    format_score: f32[]  mean of the replies' format flags (0 when the model never replied)
    turns: int32[]       replies the model made
    truncated: bool[]    the rollout stopped the game before the env ended it (turn limit or context)
    context_cut: bool[]  it stopped because the next message and reply would not fit the context
    """

    format_score: jax.Array
    turns: jax.Array
    truncated: jax.Array
    context_cut: jax.Array


# ----------------------------------------------------------------------------------------------------------
# Declarative data: messages, reply grammar, rubric, evaluation
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Slot:
    """One slot of a message: piece `code` of `pieces` is the text the slot shows (code 0..len-1)."""

    name: str
    pieces: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "pieces", tuple(self.pieces))
        if not self.pieces:
            raise ValueError(f"slot {self.name!r} has no pieces")


@dataclasses.dataclass(frozen=True)
class MessageFamily:
    """Codes that occur together in real messages, for the exactness check of the text bridge.

    codes[s]: the codes slot s takes in this family (None: all of them). final: these messages end a
    game (they close the user turn without a generation prompt). The bridge checks every adjacent pair of
    slots with every pair of their codes, the other slots at a default, in both opening contexts.
    """

    codes: tuple[tuple[int, ...] | None, ...]
    final: bool = False


@dataclasses.dataclass(frozen=True)
class MessageSpec:
    """An env's messages: the slots in order and the families of codes that occur together.

    A message is the concatenation of its slots' pieces. Cut pieces where the tokenizer's pre-tokenizer
    splits (after a newline, before a non-space character), so that piecewise tokens equal the whole's.
    families: () means one non-final family with every code of every slot.
    """

    slots: tuple[Slot, ...]
    families: tuple[MessageFamily, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "slots", tuple(self.slots))
        names = [s.name for s in self.slots]
        if len(set(names)) != len(names):
            raise ValueError(f"slot names must be unique, got {names}")
        families = tuple(self.families) or (MessageFamily((None,) * len(self.slots)),)
        for f in families:
            if len(f.codes) != len(self.slots):
                raise ValueError(f"a message family has {len(f.codes)} code sets for {len(self.slots)} slots")
            for slot, codes in zip(self.slots, f.codes):
                if codes is not None and any(not 0 <= c < len(slot.pieces) for c in codes):
                    raise ValueError(f"slot {slot.name!r}: family codes outside 0..{len(slot.pieces) - 1}")
        object.__setattr__(self, "families", families)

    def render(self, codes: Sequence[int]) -> str:
        """The message text for `codes` (host)."""
        if len(codes) != len(self.slots):
            raise ValueError(f"need {len(self.slots)} codes, got {len(codes)}")
        return "".join(slot.pieces[int(c)] for slot, c in zip(self.slots, codes))


CONTENT_KINDS = ("cell", "integer", "text")
METRIC_KINDS = ("rate", "mean")  # `Env.metric_kinds`: a 0/1 rate shown in %, or a mean shown as a number


@dataclasses.dataclass(frozen=True)
class ReplyGrammar:
    """How a reply is read, with Python-`re` semantics on the decoded text (see `jaxrl_llm.text.grammar`).

    tag: the answer is the first `re.search(rf"<{tag}>\\s*(.*?)\\s*</{tag}>", text, re.DOTALL)`, its group
        stripped (`str.strip()`).
    content: "cell"    valid iff the content is exactly str(i) for some 0 <= i < num_cells;
             "integer" valid iff it fully matches `[+-]?[0-9]+` (ASCII digits only; leading zeros and a
                       plus sign allowed) with at most max_digits digits; value int(content);
             "text"    any content is valid (value 0).
    format_tags: the reply follows the format iff `re.search` finds `<t1>.*?</t1>.*?<t2>.*?</t2>...`
        (DOTALL) for these tags in order; default (tag,).
    value_range: for "integer", the (low, high) values an answer can sensibly take, both included: a random
        player (`random_reply`, `jaxrl-llm demo`) draws there (None: any value of max_digits digits).
    example_replies: replies in the asked-for format, used to check that the generation prompt ends at a
        tokenization boundary (default: built from the tags).
    """

    tag: str
    content: str = "cell"
    num_cells: int = 9
    max_digits: int = 9
    format_tags: tuple[str, ...] | None = None
    example_replies: tuple[str, ...] | None = None
    value_range: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        for t in (self.tag, *(self.format_tags or ())):
            if not t or not all(ch.isascii() and (ch.isalnum() or ch in "_-") for ch in t):
                raise ValueError(f"ReplyGrammar tag {t!r} must be ASCII letters, digits, '_' or '-'")
        if self.content not in CONTENT_KINDS:
            raise ValueError(f"ReplyGrammar.content must be one of {CONTENT_KINDS}, got {self.content!r}")
        if self.content == "cell" and not 1 <= self.num_cells <= 10**6:
            raise ValueError(f"ReplyGrammar.num_cells must be in 1..10**6, got {self.num_cells}")
        if self.value_range is not None:
            low, high = self.value_range
            bound = 10 ** self.max_digits - 1
            if self.content != "integer" or not -bound <= low <= high <= bound:
                raise ValueError(f"ReplyGrammar.value_range {self.value_range} needs content 'integer' and "
                                 f"-{bound} <= low <= high <= {bound} (max_digits {self.max_digits})")
            object.__setattr__(self, "value_range", (int(low), int(high)))
        if self.content == "integer" and not 1 <= self.max_digits <= 9:
            raise ValueError(f"ReplyGrammar.max_digits must be in 1..9 (int32 values), got {self.max_digits}")
        object.__setattr__(self, "format_tags", tuple(self.format_tags) if self.format_tags else (self.tag,))
        if self.example_replies is None:
            sample = {"cell": "2", "integer": "-17", "text": "yes"}[self.content]
            think = "".join(f"<{t}>I think.</{t}>\n" for t in self.format_tags if t != self.tag)
            examples = (f"{think}<{self.tag}>{sample}</{self.tag}>", f"<{self.tag}>{sample}</{self.tag}>", "I pass.")
            object.__setattr__(self, "example_replies", examples)
        else:
            object.__setattr__(self, "example_replies", tuple(self.example_replies))


@dataclasses.dataclass(frozen=True)
class RubricPart:
    """A named reward part and its weight (weight 0: logged as a metric, not rewarded)."""

    name: str
    weight: float


@dataclasses.dataclass(frozen=True)
class EvalSetting:
    """A named evaluation condition: the curriculum stage its examples are drawn from."""

    name: str
    stage: Any


def weighted_reward(rubric: Sequence[RubricPart], parts: dict[str, jax.Array]) -> jax.Array:
    """sum_i weight_i * parts[name_i], a left fold in rubric order (f32; same shape as the parts)."""
    total = None
    for part in rubric:
        term = part.weight * parts[part.name]
        total = term if total is None else total + term
    return jnp.asarray(total, jnp.float32)


def keep_finished(done: jax.Array, old: Any, new: Any) -> Any:
    """The protocol's rule for finished games, written once: leaf by leaf, `old` where `done`, else `new`.

    done: bool[...] per game (any leading batch shape); old, new: states of one structure whose leaves lead
    with done's shape (a leaf may have more axes: done is broadcast over them). Jittable, vmappable.
    """
    done = jnp.asarray(done, bool)

    def choose(a: jax.Array, b: jax.Array) -> jax.Array:
        flag = jnp.reshape(done, jnp.shape(done) + (1,) * (jnp.ndim(b) - jnp.ndim(done)))
        return jnp.where(flag, a, b)

    return jax.tree.map(choose, old, new)


def _mix32(x: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finalizer (a bijection of uint32 that mixes every bit into every other)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def hash_leaves(tree: Any) -> jax.Array:
    """uint32[]: a hash of a pytree's array leaves (their values, in order; jittable, vmappable).

    Every leaf becomes 32-bit words (floats through float32 bits, ints and bools through int32), each word
    is mixed with its position, and the mixed words are summed (mod 2**32) and mixed once more.
    """
    words = []
    for leaf in jax.tree_util.tree_leaves(tree):
        leaf = jnp.asarray(leaf).reshape(-1)
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            leaf = jax.lax.bitcast_convert_type(leaf.astype(jnp.float32), jnp.uint32)
        elif leaf.dtype != jnp.uint32:
            leaf = jax.lax.bitcast_convert_type(leaf.astype(jnp.int32), jnp.uint32)
        words.append(leaf)
    if not words:
        return jnp.uint32(0)
    words = jnp.concatenate(words)
    position = jnp.arange(words.shape[0], dtype=jnp.uint32) * jnp.uint32(0x9E3779B9)
    return _mix32(jnp.sum(_mix32(_mix32(words) ^ position), dtype=jnp.uint32))


# ----------------------------------------------------------------------------------------------------------
# The base class
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Env:
    """Base of every environment. Subclasses set the class attributes and implement the methods.

    `Env(params)` or `make(name, **params)`; `env.params` are the params it was made with (methods take
    params explicitly, as gymnax's do, so a caller can vary them).
    """

    params: Any = None

    name: ClassVar[str] = ""
    Params: ClassVar[type] = type(None)
    Stage: ClassVar[type] = type(None)
    Teacher: ClassVar[type | None] = None
    final_message: ClassVar[bool] = True
    results_columns: ClassVar[tuple[tuple[str, str], ...]] = ()
    outcome_metrics: ClassVar[tuple[str, ...]] = ()
    metric_kinds: ClassVar[dict[str, str]] = {}  # metric name -> "rate" (the default: 0/1, shown in %) or "mean"
    reward_params: ClassVar[tuple[str, ...]] = ()  # Params fields that weigh the reward only (not text or rules)

    def __post_init__(self) -> None:
        if self.params is None:
            object.__setattr__(self, "params", self.Params())
        elif not isinstance(self.params, self.Params):
            raise TypeError(f"{type(self).__name__} needs params of type {self.Params.__name__}, "
                            f"got {type(self.params).__name__}")

    # ---- data ----
    def sample_examples(self, key: jax.Array, num_prompts: int, group_size: int, stage: Any) -> Any:
        raise NotImplementedError

    def eval_examples(self, key: jax.Array, num_games: int, stage: Any) -> Any:
        """`num_games` evaluation examples of `stage` (default: `sample_examples` in groups of one)."""
        return self.sample_examples(key, num_games, 1, stage)

    def eval_settings(self) -> tuple[EvalSetting, ...]:
        raise NotImplementedError

    def example_metrics(self, examples: Any) -> dict[str, jax.Array]:
        """Batch figures of the examples themselves (e.g. the mean difficulty), logged with each step."""
        return {}

    # ---- dynamics ----
    def reset(self, example: Any, params: Any) -> Any:
        raise NotImplementedError

    def step(self, state: Any, reply: ParsedReply, params: Any) -> Any:
        """State after the model's reply (and any scripted answer). The protocol's shared rule lives here,
        once for every env (as in pgx's `Env.step`): a done state comes back unchanged; the env's own rules
        are `transition`. Jittable, vmappable."""
        return keep_finished(self.done(state), state, self.transition(state, reply, params))

    def transition(self, state: Any, reply: ParsedReply, params: Any) -> Any:
        """The rules of a live game: the state after the reply (`step` keeps finished games unchanged)."""
        raise NotImplementedError(f"{type(self).__name__} implements neither `transition` (the rules of a live "
                                  "game) nor `step`")

    def done(self, state: Any) -> jax.Array:
        raise NotImplementedError

    # ---- text ----
    def system_prompt(self, params: Any) -> str:
        raise NotImplementedError

    def message_spec(self, params: Any) -> MessageSpec:
        raise NotImplementedError

    def message_codes(self, state: Any, params: Any) -> jax.Array:
        raise NotImplementedError

    def reply_grammar(self, params: Any) -> ReplyGrammar:
        raise NotImplementedError

    # ---- reward and metrics ----
    def rubric(self, params: Any) -> tuple[RubricPart, ...]:
        raise NotImplementedError

    def reward_parts(self, state: Any, episode: Episode, params: Any) -> dict[str, jax.Array]:
        raise NotImplementedError

    def reward(self, state: Any, episode: Episode, params: Any) -> jax.Array:
        """The weighted sum of `reward_parts` (f32[])."""
        return weighted_reward(self.rubric(params), self.reward_parts(state, episode, params))

    def metrics(self, state: Any, episode: Episode, params: Any) -> dict[str, jax.Array]:
        raise NotImplementedError

    # ---- host helpers ----
    def render_message(self, state: Any, params: Any) -> str:
        """The text of the message `state` shows (host; through `message_spec` and `message_codes`)."""
        import numpy as np

        codes = np.asarray(jax.device_get(self.message_codes(state, params))).reshape(-1)
        return self.message_spec(params).render(codes.tolist())

    def example_info(self, example: Any) -> dict[str, Any]:
        """One (unbatched, host) example as JSON-ready scalars for game records."""
        import numpy as np

        if hasattr(example, "_asdict"):
            fields = example._asdict()
        else:
            leaves = jax.tree_util.tree_leaves(example)
            fields = {"example": leaves[0]} if len(leaves) == 1 else {f"example_{i}": v for i, v in enumerate(leaves)}
        return {k: np.asarray(v).item() for k, v in fields.items()}

    # ---- optional: the legal choices ----
    def legal_choices(self, state: Any, params: Any) -> jax.Array | None:
        """bool[C]: for a "cell" reply grammar (C = num_cells), entry c says whether choice c is legal now
        (all False once the game is over). None: the env cannot say (the default). Jittable, vmappable."""
        return None

    def num_legal_choices(self, state: Any, params: Any) -> jax.Array | None:
        """int32[]: how many choices are legal now (from `legal_choices`); None where the env cannot say."""
        legal = self.legal_choices(state, params)
        return None if legal is None else jnp.sum(legal, axis=-1, dtype=jnp.int32)

    # ---- optional: per-turn credit (`jaxrl_llm.algos.advantages`, GRPO's "step" and "mix" advantages) ----
    def turn_reward(self, prev_state: Any, state: Any, params: Any) -> jax.Array:
        """f32[]: the reward of the turn that led from `prev_state` to `state` (default 0), on top of the
        episode's rubric reward (e.g. a board game's invalid-move penalty on the turn that made it).
        Jittable, vmappable."""
        return jnp.float32(0.0)

    def state_key(self, state: Any, params: Any) -> jax.Array:
        """uint32[]: a hash of the state a turn is played from; turns of a GRPO group with equal keys form a
        step group. Default: a hash of all the state's leaves (`hash_leaves`); an env whose state holds
        more than what matters for the move (seeds, counters) keys on what does. Jittable, vmappable."""
        return hash_leaves(state)

    # ---- optional: a random player ----
    def random_reply(self, key: jax.Array, state: Any, params: Any) -> ParsedReply:
        """A random well-formed reply for one game (for `envs.random_play`): a uniform value of the reply
        grammar (a cell in [0, num_cells), an integer in the grammar's value_range (default: of at most
        max_digits digits either sign), or 0 for
        text). Games override it with a uniformly random legal move."""
        grammar = self.reply_grammar(params)
        if grammar.content == "cell":
            value = jax.random.randint(key, (), 0, grammar.num_cells)
        elif grammar.content == "integer":
            bound = 10 ** grammar.max_digits
            low, high = grammar.value_range or (-bound + 1, bound - 1)
            value = jax.random.randint(key, (), low, high + 1)
        else:
            value = jnp.int32(0)
        return ParsedReply.of(value)

    # ---- optional: text for training a tokenizer ----
    def tokenizer_corpus(self, params: Any) -> list[str]:
        """Host: text to train a project tokenizer on (`jaxrl_llm.text.build_tokenizer`). Default: the system
        prompt, every piece of every message slot and the grammar's example replies."""
        spec = self.message_spec(params)
        pieces = [piece for slot in spec.slots for piece in slot.pieces if piece]
        return [self.system_prompt(params), *pieces, *self.reply_grammar(params).example_replies]

    # ---- optional: SFT demonstrations ----
    def demonstrations(self, teacher: Any, key: jax.Array, params: Any, max_turns: int) -> list[dict]:
        """Prompt/completion rows of a teacher (`Teacher` config) for SFT (see `jaxrl_llm.data`)."""
        raise NotImplementedError(f"env {self.name!r} has no SFT teacher; give sft.dataset instead")

    def has_check_rows(self, teacher: Any) -> bool:
        """Whether `check_rows(teacher, ...)` gives rows (cheap: config validation asks it)."""
        return False

    def check_rows(self, teacher: Any, params: Any) -> list[dict] | None:
        """Rows on which a teacher-forced greedy check is exact iff the model plays like the teacher."""
        return None


# The registry (`make`, `register`, ...) lives in `envs.registry`, above this module (it checks classes against
# `Env`); its names stay importable from here, resolved on first use.
__getattr__ = moved_names(__name__, dict.fromkeys(
    ("_REGISTRY", "ENTRY_POINT_GROUP", "EnvNotFoundError", "class_path", "entry_point_envs", "env_class", "make",
     "register", "registered"), "envs.registry"))
