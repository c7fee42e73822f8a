"""`jaxrl-llm play`: a person takes the scripted opponent's place and plays the model in the terminal.

Works for any env with play hooks (`jaxrl_llm.cli.human`: the `HumanPlay` protocol, found by `human_play(env)`):
the conversation is the one the model was
trained on (the env's system prompt and messages, rendered from its slot codes), the model's replies are
decoded greedily with the sampler and read by the on-device parser, and the person's inputs go through
the env's own moves. Input that ends (a closed pipe, Ctrl-D) ends the game with a message.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from envs.core import Episode
from jaxrl_llm import text
from jaxrl_llm.cli.human import human_play, opening_of
from jaxrl_llm.generate import SamplingConfig, make_sampler
from jaxrl_llm.rollout import outcome_label


class _InputEnded(Exception):
    pass


def _ask(input_fn: Callable[[str], str], prompt: str) -> str:
    try:
        return input_fn(prompt)
    except EOFError:
        raise _InputEnded from None


def _ask_choice(human, state, input_fn, print_fn) -> str:
    choices = human.choices(state)
    while True:
        answer = _ask(input_fn, f"your move, one of {choices}: ").strip()
        if answer in choices:
            return answer
        print_fn(f"  {answer!r} is not one of {choices}")


def _outcome(env, state, turns: int) -> str:
    episode = Episode(format_score=jnp.float32(1.0), turns=jnp.int32(turns), truncated=jnp.bool_(False),
                      context_cut=jnp.bool_(False))
    metrics = {k: float(v) for k, v in jax.device_get(env.metrics(state, episode, env.params)).items()}
    return outcome_label(env, metrics) or "over"


def play_terminal(config, checkpoint: str | None = None, input_fn: Callable[[str], str] = input,
                  print_fn: Callable[[str], None] = print) -> int:
    """Plays one game; returns 0. `input_fn` / `print_fn` let tests drive it."""
    from jaxrl_llm.train import build, policy_params

    comp = build(config)
    env = comp.env
    human = human_play(env)
    if human is None:
        from jaxrl_llm.checks import ConfigError

        raise ConfigError(f"env {env.name!r} has no human player (no play hooks: jaxrl_llm.cli.human.human_play "
                          "finds none for its class), so `jaxrl-llm play` cannot run it; evaluate it with "
                          "`jaxrl-llm eval` instead, or give the env hooks with jaxrl_llm.cli.human.register_human "
                          "(envs/tictactoe/play.py and envs/connect_four/play.py show how)", ("env", "name"))
    params = policy_params(config, comp, checkpoint)
    tok, tables = comp.tokenizer, comp.tables
    scfg = comp.sampling_config(SamplingConfig(greedy=True, max_new_tokens=config.eval.sampling.max_new_tokens))
    sampler = make_sampler(comp.model_fn, scfg)
    width = config.eval.rollout.context_length - scfg.max_new_tokens
    grammar = env.reply_grammar(env.params)
    parse = jax.jit(lambda t, n: text.parse_reply(tables, grammar, t, n))
    try:
        return _play(config, env, human, params, tok, tables, scfg, sampler, comp.init_cache, width, parse, input_fn,
                     print_fn)
    except _InputEnded:
        print_fn("\n(input ended: game over)")
        return 0


def _play(config, env, human, params, tok, tables, scfg, sampler, init_cache, width, parse, input_fn, print_fn) -> int:
    state: Any = human.new_game()
    opening = opening_of(human)
    if opening is not None and _ask(input_fn, "do you want to move first? [y/N] ").strip().lower().startswith("y"):
        print_fn(human.view(state))
        state = opening(state, _ask_choice(human, state, input_fn, print_fn))
    conversation = [{"role": "system", "content": env.system_prompt(env.params)}]
    for turn in range(config.eval.rollout.max_turns):
        conversation.append({"role": "user", "content": env.render_message(state, env.params)})
        ids = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=False)
        if len(ids) > width:
            print_fn("the conversation no longer fits the context: game over")
            return 0
        prompt = np.full((1, width), tables.pad_id, np.int32)
        prompt[0, : len(ids)] = ids
        cache = init_cache(1, width + scfg.max_new_tokens)
        out = sampler(params, jnp.asarray(prompt), jnp.asarray([len(ids)]), cache, jax.random.PRNGKey(0))
        n = int(out.lengths[0]) - int(out.done[0])
        reply = tok.decode(np.asarray(out.tokens[0, :n]).tolist())
        print_fn(f"model: {reply}")
        conversation.append({"role": "assistant", "content": reply})
        state = human.apply_model(state, parse(out.tokens[0], jnp.int32(n)))
        if bool(env.done(state)):
            print_fn(env.render_message(state, env.params) + f"\n({_outcome(env, state, turn + 1)})")
            return 0
        if human.human_to_move(state):
            print_fn(human.view(state))
            state = human.apply_human(state, _ask_choice(human, state, input_fn, print_fn))
            if bool(env.done(state)):
                print_fn(env.render_message(state, env.params) + f"\n({_outcome(env, state, turn + 1)})")
                return 0
        else:
            print_fn(f"({env.render_message(state, env.params).splitlines()[0]})")
    print_fn("turn limit reached: unfinished")
    return 0
