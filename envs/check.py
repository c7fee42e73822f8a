"""`check_env(env)`: the protocol checks for env authors, after gymnasium's `utils.env_checker.check_env`.

Plays a few games of the env's random player (`Env.random_reply`, with some replies missing their tag) on
the env alone, no model, and checks what the rollout, the text bridge and the trainer rely on:

  - the declarative parts: `system_prompt` a str, `message_spec` a MessageSpec, `reply_grammar` a
    ReplyGrammar, `rubric` RubricParts, `eval_settings` EvalSettings, `metric_kinds` of `METRIC_KINDS`,
    `reward_params` fields of the env's Params;
  - `sample_examples` has a leading axis of num_prompts * group_size;
  - `reset` and `step` are jittable and vmappable, and `step` keeps the state's structure, shapes and
    dtypes; `done` is a bool per game;
  - `message_codes` has one code per slot, each within its slot's pieces (else a wrong count fails deep in
    the text bridge, and an out-of-range code renders as empty text);
  - finished games stay unchanged under `step`;
  - every rubric part is in `reward_parts`, and parts and metrics are one f32 per game;
  - every metric is a rate in [0, 1] (NaN: not this game's metric) unless `metric_kinds` says "mean";
    `results_columns` and `outcome_metrics` name metrics the env has;
  - every reward part and `turn_reward` is finite (a NaN reward makes the first training step's loss NaN);
    no metric is infinite; a metric of the results table or the outcomes that is NaN in every game checked
    is reported as a warning (a line of the result starting "warning:").

Each failure names the method and what it returned; an env function that raises is named with the
exception and the shapes of what it was given; a state whose shapes change names the field with the shapes
expected and got. All failures are collected into one `EnvCheckError` (an `EnvError`, also an
AssertionError).

    import envs
    envs.check_env(envs.make("my_pkg.my_env:MyEnv"))     # or: jaxrl-llm check-env my_pkg.my_env:MyEnv
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from envs.core import (METRIC_KINDS, Env, Episode, EvalSetting, MessageSpec, ParsedReply, ReplyGrammar,
                       RubricPart)
from jaxrl_base.errors import EnvError

RESERVED_METRICS = ("format", "reward", "games", "turns")


class EnvCheckError(EnvError, AssertionError):
    """The env breaks the protocol; `failures` lists each broken check ("method: what it returned")."""

    def __init__(self, env_name: str, failures: list[str]):
        self.failures = list(failures)
        super().__init__(f"env {env_name!r} fails {len(failures)} check(s):\n" + "\n".join(f"  - {f}" for f in failures))


def _describe(tree: Any) -> str:
    """A short text of a pytree's leaves: shapes and dtypes, each named by its field when it has one, e.g.
    "State(secret=int32[8], done=bool[8])"."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]

    def name(path) -> str:
        text = jax.tree_util.keystr(path)
        return text[1:] + "=" if text.startswith(".") and "[" not in text else ""

    shown = ", ".join(f"{name(path)}{np.dtype(getattr(x, 'dtype', type(x)))}{list(np.shape(x))}"
                      for path, x in flat[:6])
    return f"{type(tree).__name__}({shown}{', ...' if len(flat) > 6 else ''})"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def _fields(tree: Any) -> dict[str, str]:
    """{field path (e.g. "state.guesses"): "int32[8, 3]"} of a pytree's leaves."""
    return {"state" + jax.tree_util.keystr(path): f"{np.dtype(getattr(x, 'dtype', type(x)))}{list(np.shape(x))}"
            for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _field_changes(before: Any, after: Any) -> str:
    """The fields whose shape or dtype differ between two states: "state.guesses: int32[8] expected, got
    int32[8, 3]" (or the structures when the fields differ)."""
    old, new = _fields(before), _fields(after)
    if list(old) != list(new):
        gone, added = [k for k in old if k not in new], [k for k in new if k not in old]
        return f"the fields differ (missing {gone or 'none'}, new {added or 'none'})"
    changed = [f"{k}: {old[k]} expected, got {new[k]}" for k in old if old[k] != new[k]]
    return "; ".join(changed[:3]) + (f" (and {len(changed) - 3} more)" if len(changed) > 3 else "")


def _signature(tree: Any):
    return (jax.tree_util.tree_structure(tree),
            [(tuple(np.shape(x)), np.dtype(getattr(x, "dtype", type(x)))) for x in jax.tree_util.tree_leaves(tree)])


class _Checker:
    """One run of `check_env`: the env, its params, the batch's size and the failures and passed checks so
    far; each `_check_*` function below is one group of the protocol's rules, run in order."""

    def __init__(self, env: Env, num_prompts: int, group_size: int):
        self.env = env
        self.name = getattr(env, "name", "") or type(env).__name__
        self.params = env.params
        self.num_prompts, self.group_size = num_prompts, group_size
        self.batch = num_prompts * group_size
        self.failures: list[str] = []
        self.passed: list[str] = []
        self.warnings: list[str] = []

    def fail(self, text: str) -> None:
        self.failures.append(text)

    def warn(self, text: str) -> None:
        """A finding that does not fail the check: a line "warning: ..." among the checks passed."""
        self.warnings.append(f"warning: {text}")

    def done_with(self, what: str) -> None:
        if self.failures:
            raise EnvCheckError(self.name, self.failures)
        self.passed.append(what)

    def error(self, text: str) -> EnvCheckError:
        """The error that stops the check at once (a method that raised, with nothing further to check)."""
        return EnvCheckError(self.name, [*self.failures, text])

    def call(self, what: str, fn, *args):
        """fn(*args), or the `EnvCheckError` that names `what` (the env function and the moment), the exception
        and the shapes of the arguments it was given."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - the checker reports any error of the env's code
            given = ", ".join(_describe(a) for a in args)
            raise self.error(f"{what} raised {_first_line(e)} (given {given})") from e


def _non_finite_text(values: np.ndarray) -> str:
    """E.g. "nan in 8 of 8 games" or "inf in 1 of 8 games" for a float array with one value per game."""
    nan, inf = int(np.isnan(values).sum()), int(np.isinf(values).sum())
    shown = " and ".join(t for t in (f"NaN in {nan}" if nan else "", f"infinite in {inf}" if inf else "") if t)
    return f"{shown} of {values.size} games"


def _check_declarative(c: _Checker):
    """system_prompt, message_spec, reply_grammar, rubric, eval_settings, metric_kinds -> (spec, rubric,
    settings, kinds)."""
    env, params = c.env, c.params
    spec = rubric = settings = None
    try:
        what = "system_prompt"
        prompt = env.system_prompt(params)
        if not isinstance(prompt, str):
            c.fail(f"system_prompt returned {type(prompt).__name__}, not a str")
        what = "message_spec"
        spec = env.message_spec(params)
        if not isinstance(spec, MessageSpec):
            c.fail(f"message_spec returned {type(spec).__name__}, not an envs.MessageSpec")
        what = "reply_grammar"
        grammar = env.reply_grammar(params)
        if not isinstance(grammar, ReplyGrammar):
            c.fail(f"reply_grammar returned {type(grammar).__name__}, not an envs.ReplyGrammar")
        what = "rubric"
        rubric = tuple(env.rubric(params))
        if not rubric or not all(isinstance(p, RubricPart) for p in rubric):
            c.fail(f"rubric returned {rubric!r}; expected a non-empty tuple of envs.RubricPart")
        what = "eval_settings"
        settings = tuple(env.eval_settings())
        if not settings or not all(isinstance(s, EvalSetting) for s in settings):
            c.fail(f"eval_settings returned {settings!r}; expected a non-empty tuple of envs.EvalSetting")
    except Exception as e:  # noqa: BLE001 - the checker reports any error of the env's code
        c.fail(f"{what} raised {_first_line(e)}")
    kinds = dict(type(env).metric_kinds)
    bad_kinds = {k: v for k, v in kinds.items() if v not in METRIC_KINDS}
    if bad_kinds:
        c.fail(f"metric_kinds {bad_kinds}: each kind must be one of {METRIC_KINDS}")
    reward_params = tuple(getattr(type(env), "reward_params", ()))
    unknown = [name for name in reward_params if not hasattr(params, name)]
    if unknown:
        c.fail(f"reward_params names {unknown}, which are not fields of the env's Params ({type(params).__name__}); "
               "list only the Params fields that weigh the reward")
    c.done_with("system_prompt, message_spec, reply_grammar, rubric, eval_settings, metric_kinds and reward_params "
                "are well formed")
    return spec, rubric, settings, kinds


def _check_examples(c: _Checker, key: jax.Array, stage: Any):
    """sample_examples' leading axis is num_prompts * group_size -> the examples."""
    examples = c.call(f"sample_examples(key, {c.num_prompts}, {c.group_size}, {stage!r})", c.env.sample_examples,
                      key, c.num_prompts, c.group_size, stage)
    lead = {np.shape(x)[0] if np.ndim(x) else None for x in jax.tree_util.tree_leaves(examples)}
    if lead != {c.batch}:
        c.fail(f"sample_examples(key, {c.num_prompts}, {c.group_size}, stage) returned {_describe(examples)}; "
               f"every leaf needs the leading axis num_prompts * group_size = {c.batch}")
    else:
        figures = c.call("example_metrics", c.env.example_metrics, examples)
        for name, value in dict(figures).items():
            if np.size(value) != 1 or not np.isfinite(np.asarray(value, np.float64)).all():
                c.fail(f"example_metrics returned {name!r} = {np.asarray(value).tolist()!r}; expected one finite "
                       "number for the batch")
    c.done_with("sample_examples gives num_prompts * group_size examples")
    return examples


def _check_reset(c: _Checker, reset, examples):
    """reset is jittable and vmappable, and gives one example's state the same shapes -> the batch's state."""
    try:
        state = reset(examples)
    except Exception as e:  # noqa: BLE001
        raise c.error(f"reset is not jittable and vmappable: jit(vmap(reset)) raised "
                      f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    try:
        one = c.env.reset(jax.tree_util.tree_map(lambda x: x[0], examples), c.params)
        first = jax.tree_util.tree_map(lambda x: x[0], state)
        if _signature(first) != _signature(one):
            c.fail(f"reset returned {_describe(one)} for one example but {_describe(state)} under vmap: "
                   f"{_field_changes(first, one)}")
    except Exception as e:  # noqa: BLE001
        c.fail(f"reset of one example raised {_first_line(e)} (given {_describe(examples)} sliced to one example)")
    c.done_with("reset is jittable and vmappable")
    return state


def _check_state(c: _Checker, spec: MessageSpec, done_fn, codes_fn, state, after: str) -> None:
    """done is one bool per game; message_codes one in-range code per slot (failures recorded, not raised)."""
    slots = [len(s.pieces) for s in spec.slots]
    d = c.call(f"done{after}", done_fn, state)
    if np.shape(d) != (c.batch,) or np.asarray(d).dtype != np.bool_:
        c.fail(f"done{after} returned {np.asarray(d).dtype}{list(np.shape(d))}; expected one bool per game")
    codes = np.asarray(c.call(f"message_codes{after}", codes_fn, state))
    if codes.shape != (c.batch, len(slots)) or not np.issubdtype(codes.dtype, np.integer):
        c.fail(f"message_codes{after} returned {codes.dtype}{list(codes.shape[1:])} per game; expected "
               f"int32[{len(slots)}], one code per slot ({', '.join(s.name for s in spec.slots)})")
        return
    for i, (slot, n) in enumerate(zip(spec.slots, slots)):
        out = codes[:, i][(codes[:, i] < 0) | (codes[:, i] >= n)]
        if out.size:
            c.fail(f"message_codes{after} returned code {int(out[0])} for slot {slot.name!r}, which has "
                   f"{n} pieces (codes 0..{n - 1})")


def _finished_unchanged(c: _Checker, state, new, before_done) -> None:
    """A game done before the step comes back unchanged (the first changed leaf recorded)."""
    for leaf_old, leaf_new, path in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(new),
                                        [jax.tree_util.keystr(p) for p, _ in
                                         jax.tree_util.tree_flatten_with_path(state)[0]]):
        old, upd = np.asarray(leaf_old)[before_done], np.asarray(leaf_new)[before_done]
        if not np.array_equal(old, upd, equal_nan=True):
            c.fail(f"step changed a finished game: state{path} went from {old.reshape(len(old), -1)[0].tolist()} "
                   f"to {upd.reshape(len(upd), -1)[0].tolist()}; a done state must come back unchanged")
            return


def _check_play(c: _Checker, spec: MessageSpec, done_fn, codes_fn, state, key: jax.Array, max_turns: int):
    """Random replies (some without a tag) for up to max_turns: step is jittable and vmappable, keeps the
    state's signature, leaves finished games unchanged, and each state passes `_check_state` -> (state,
    turns int32[batch])."""
    env, params, batch = c.env, c.params, c.batch
    step = jax.jit(jax.vmap(lambda s, r: env.step(s, r, params)))
    random_reply = jax.jit(jax.vmap(lambda k, s: env.random_reply(k, s, params)))
    turn_reward = jax.jit(jax.vmap(lambda s, n: env.turn_reward(s, n, params)))
    signature = _signature(state)
    turns = np.zeros(batch, np.int32)
    for t in range(max_turns):
        before_done = np.asarray(done_fn(state))
        if before_done.all():
            break
        k_turn = jax.random.fold_in(key, t)
        reply = c.call(f"random_reply at turn {t + 1}", random_reply, jax.random.split(k_turn, batch), state)
        no_tag = jax.random.bernoulli(jax.random.fold_in(k_turn, 1), 0.2, (batch,))
        reply = ParsedReply(reply.found & ~no_tag, reply.valid & ~no_tag, jnp.where(no_tag, 0, reply.value),
                            reply.format_ok & ~no_tag)
        try:
            new = step(state, reply)
        except Exception as e:  # noqa: BLE001
            c.fail(f"step is not jittable and vmappable: jit(vmap(step)) raised {type(e).__name__}: "
                   f"{str(e).splitlines()[0] if str(e) else ''}")
            break
        if _signature(new) != signature:
            c.fail(f"step returned {_describe(new)} for a state {_describe(state)}: it must keep the state's "
                   f"structure, shapes and dtypes ({_field_changes(state, new)})")
            break
        _finished_unchanged(c, state, new, before_done)
        reward = np.asarray(c.call(f"turn_reward at turn {t + 1}", turn_reward, state, new), np.float64)
        if reward.shape != (batch,):
            c.fail(f"turn_reward at turn {t + 1} returned {list(reward.shape[1:])} per game; expected one float")
        elif not np.isfinite(reward).all():
            c.fail(f"turn_reward at turn {t + 1} returned {_non_finite_text(reward)}: a reward must be finite")
        turns += ~before_done
        state = new
        _check_state(c, spec, done_fn, codes_fn, state, f" after step {t + 1}")
        if c.failures:
            break
    c.done_with(f"step is jittable and vmappable, keeps shapes and dtypes, and leaves finished games unchanged "
                f"({int(np.asarray(done_fn(state)).sum())} of {batch} games finished in {max_turns} replies)")
    return state, turns


def _check_metric_values(c: _Checker, metrics: dict, kinds: dict) -> None:
    """Rates in [0, 1] (NaN allowed) unless declared otherwise; no reserved name; metric_kinds,
    results_columns and outcome_metrics name metrics the env returns."""
    clash = sorted(set(metrics) & set(RESERVED_METRICS))
    if clash:
        c.fail(f"metrics returned {clash}: these names are reserved ({', '.join(RESERVED_METRICS)}); rename them")
    for key_, value in metrics.items():
        if kinds.get(key_, "rate") != "rate":
            continue
        v = np.asarray(value, np.float64)
        v = v[~np.isnan(v)]
        if v.size and (v.min() < 0 or v.max() > 1):
            c.fail(f"metrics returned {key_!r} = {v.min():g}..{v.max():g}, outside [0, 1]: a metric is a 0/1 rate "
                   f"unless declared otherwise, e.g. metric_kinds = {{{key_!r}: 'mean'}}")
    headline = {k for _, k in type(c.env).results_columns} | set(type(c.env).outcome_metrics)
    for key_, value in metrics.items():
        v = np.asarray(value, np.float64)
        if np.isinf(v).any():
            c.fail(f"metrics returned {key_!r} = {_non_finite_text(v)}: a metric may be NaN (not this game's "
                   "metric) but never infinite")
        elif key_ in headline and v.size and np.isnan(v).all():  # a per-level metric may miss a batch
            c.warn(f"metrics returned {key_!r} = NaN in every one of the {v.size} games checked: it is never "
                   "measured (NaN means \"not this game's metric\"); check that it is computed")
    unknown = [k for k in kinds if k not in metrics]
    if unknown:
        c.fail(f"metric_kinds names {unknown}, which metrics does not return ({sorted(metrics)})")
    for what, names in (("results_columns", [k for _, k in type(c.env).results_columns]),
                        ("outcome_metrics", list(type(c.env).outcome_metrics))):
        absent = [k for k in names if k not in metrics and k not in RESERVED_METRICS]
        if absent:
            c.fail(f"{what} names {absent}, which metrics does not return ({sorted(metrics)})")


def _check_rubric(c: _Checker, rubric, kinds: dict, done_fn, state, turns) -> None:
    """Every rubric part is in reward_parts; parts and metrics are one float per game; `_check_metric_values`."""
    env, params, batch = c.env, c.params, c.batch
    d = jnp.asarray(done_fn(state))
    episode = Episode(format_score=jnp.ones(batch, jnp.float32), turns=jnp.asarray(turns), truncated=~d,
                      context_cut=jnp.zeros(batch, bool))
    parts = c.call("reward_parts", jax.jit(jax.vmap(lambda s, e: env.reward_parts(s, e, params))), state, episode)
    metrics = c.call("metrics", jax.jit(jax.vmap(lambda s, e: env.metrics(s, e, params))), state, episode)
    missing = [p.name for p in rubric if p.name not in parts]
    if missing:
        c.fail(f"reward_parts returned parts {sorted(parts)} but the rubric names {missing} too")
    for part in rubric:
        if part.name in parts and np.shape(parts[part.name]) == (batch,):
            v = np.asarray(parts[part.name], np.float64)
            if not np.isfinite(v).all():
                c.fail(f"reward_parts returned rubric part {part.name!r} = {_non_finite_text(v)}: a reward part must "
                       "be finite (a NaN or infinite reward makes the first training step's loss NaN)")
    for what, table in (("reward_parts", parts), ("metrics", metrics)):
        for key_, value in table.items():
            if np.shape(value) != (batch,) or not np.issubdtype(np.asarray(value).dtype, np.floating):
                c.fail(f"{what} returned {key_!r} as {np.asarray(value).dtype}{list(np.shape(value)[1:])} per game; "
                       "expected one float32 per game")
    _check_metric_values(c, metrics, kinds)
    c.done_with("the rubric's parts are in reward_parts; metrics are rates in [0, 1] or declared means")


def check_env(env: Env, stage: Any = None, key: jax.Array | None = None, num_prompts: int = 4, group_size: int = 2,
              max_turns: int = 16) -> list[str]:
    """Checks `env` against the protocol (see the module docstring) on num_prompts x group_size games of at
    most `max_turns` replies from `stage` (default: the first evaluation setting's). Returns the names of the
    checks passed, then a line "warning: ..." for each finding that does not fail (a metric never measured);
    raises EnvCheckError listing every failure (each group of checks stops the run when it
    leaves failures)."""
    c = _Checker(env, num_prompts, group_size)
    params = c.params
    key = jax.random.PRNGKey(0) if key is None else key
    spec, rubric, settings, kinds = _check_declarative(c)
    stage = settings[0].stage if stage is None else stage
    k_examples, k_play = jax.random.split(key)
    examples = _check_examples(c, k_examples, stage)
    reset = jax.jit(jax.vmap(lambda e: env.reset(e, params)))
    done_fn = jax.jit(jax.vmap(env.done))
    codes_fn = jax.jit(jax.vmap(lambda s: env.message_codes(s, params)))
    state = _check_reset(c, reset, examples)
    _check_state(c, spec, done_fn, codes_fn, state, " after reset")
    c.done_with("message_codes gives one in-range code per slot")
    state, turns = _check_play(c, spec, done_fn, codes_fn, state, k_play, max_turns)
    _check_rubric(c, rubric, kinds, done_fn, state, turns)
    return c.passed + c.warnings
