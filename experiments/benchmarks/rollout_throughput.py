"""Rollout throughput: whole games as text in one jit, against a host-loop peer, same model, same run.

Ours: `jaxrl_llm.rollout.make_rollout` -- rendering, sampling, parsing, the game and the opponent all in
one compiled program. The peer is built the way host-loop RL environments work: the same jitted model
and the same jitted sampler generate each turn's replies for the whole batch, but between turns Python
renders every message as text, tokenizes it with the tokenizer, decodes the replies back to text,
parses them with `re`, and plays the game and the minimax opponent in plain Python. Two peer variants:

* `host-cached`: the peer keeps the model cache between turns and prefills only the new message
  (generous to the peer: an inference server without prefix caching re-reads the conversation);
* `host-reprefill`: each turn the whole conversation is tokenized (chat template) and prefilled again,
  as a request to an inference server carries the whole message list.

Both sides play full games (compact preset, max 8 turns, at most 24 new tokens a turn) of the ~5M LFM2
config (random weights, the project tokenizer) from the same seeds; the figure is complete games per
second. Ours runs twice: with `cache_stages=4` (the cache grows with the conversation; the ratios use
this one) and with one full-size cache like the peers (`ours_one_cache_games_per_s`). For the peers the
time outside the model calls (their Python work) is reported too (`host_cached_python_s`, `_share`): it
bounds what any one-program rollout can gain over a host loop with the same model. The last line
printed is one JSON object.

    python experiments/benchmarks/rollout_throughput.py            # batches 64, 256, 1024
    python experiments/benchmarks/rollout_throughput.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from envs import tictactoe as ttt
from envs.tictactoe import game
from envs.tictactoe import text as ttt_text
from jaxrl_llm import rollout as ro
from jaxrl_llm import text
from jaxrl_llm.generate import sampler as sampling
from jaxrl_llm.text import load_tokenizer
from models.family import cached_call
from models.lfm2 import PRESETS, Lfm2ForCausalLM, init_cache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from env_throughput import _py_opponent, _py_winner  # noqa: E402  (the plain-Python game of the env benchmark)

MAX_TURNS = 8
MAX_NEW = 24
CONTEXT = 1024
CACHE_STAGES = 4
MOVE_RE = re.compile(r"<move>\s*(.*?)\s*</move>", re.DOTALL)
FORMAT_RE = re.compile(r"<think>.*?</think>.*?<move>.*?</move>", re.DOTALL)


class HostGame:
    """One game in plain Python with the spec's statuses (the peer's environment)."""

    def __init__(self, seed: int, p: float):
        self.rng = random.Random(seed)
        self.p = p
        self.board = [0] * 9
        self.k = -1
        self.turns = 0
        self.done = False
        if self.rng.random() < 0.5:
            self.k = _py_opponent(self.board, self.rng, p)
            self.board[self.k] = 2
            self.status = game.STATUS_START_OPP_FIRST
        else:
            self.status = game.STATUS_START_MODEL_FIRST

    def reply(self, reply_text: str) -> None:
        self.turns += 1
        m = MOVE_RE.search(reply_text)
        content = m.group(1).strip() if m else None
        if m is None:
            self.status = game.STATUS_NO_MOVE
        elif content not in [str(i) for i in range(9)] or self.board[int(content)] != 0:
            self.status = game.STATUS_INVALID
        else:
            self.board[int(content)] = 1
            if _py_winner(self.board):
                self.status, self.done = game.STATUS_WIN, True
            elif 0 not in self.board:
                self.status, self.done = game.STATUS_DRAW, True
            else:
                self.k = _py_opponent(self.board, self.rng, self.p)
                self.board[self.k] = 2
                if _py_winner(self.board):
                    self.status, self.done = game.STATUS_LOSS, True
                elif 0 not in self.board:
                    self.status, self.done = game.STATUS_OPP_DRAW, True
                else:
                    self.status = game.STATUS_OPP_MOVED
        if self.turns >= MAX_TURNS:
            self.done = True


def host_loop(tok, preset, module, config, params, seeds, probs, key, reprefill: bool) -> float:
    """Plays the batch with Python between turns; returns the seconds spent in the model (the sampler
    calls, up to the replies on the host); the rest of the wall time is the host's Python work."""
    batch = len(seeds)
    games = [HostGame(int(s), float(p)) for s, p in zip(seeds, probs)]
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    scfg = sampling.SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW, stop_token_ids=(eos,), pad_id=tok.pad_token_id)
    sampler = host_loop.samplers.setdefault((id(module), reprefill), sampling.make_sampler(cached_call(module), scfg))
    system = ttt_text.system_prompt(preset)
    conversations = [[{"role": "system", "content": system}] for _ in games]
    cache = init_cache(config, batch, CONTEXT)
    model_s = 0.0
    for turn in range(MAX_TURNS):
        active = np.array([not g.done for g in games])
        if not active.any():
            break
        chunks = []
        for g, conv in zip(games, conversations):
            conv.append({"role": "user", "content": ttt_text.render_message(preset, g.board, g.status, g.k)})
            if reprefill:
                chunks.append(tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=False))
            else:
                piece = ("" if turn == 0 else "\n") + f"<|im_start|>user\n{conv[-1]['content']}<|im_end|>\n<|im_start|>assistant\n"
                prefix = tok.apply_chat_template(conv[:1], tokenize=False) if turn == 0 else ""
                chunks.append(tok.encode(prefix + piece, add_special_tokens=False))
        # Pad to a multiple of 64 tokens: a few compiled shapes, and no work on far-off padding.
        width = min(-(-max(len(c) for c in chunks) // 64) * 64, CONTEXT - MAX_NEW)
        prompt = np.full((batch, width), tok.pad_token_id, np.int32)
        lengths = np.zeros((batch,), np.int32)
        for b, ids in enumerate(chunks):
            ids = ids[-width:]
            prompt[b, : len(ids)] = ids
            lengths[b] = len(ids)
        if reprefill:
            cache = init_cache(config, batch, CONTEXT)
        key, sub = jax.random.split(key)
        t0 = time.perf_counter()
        out = sampler(params, jnp.asarray(prompt), jnp.asarray(lengths), cache, sub, jnp.asarray(active))
        cache = out.cache
        tokens, n = np.asarray(out.tokens), np.asarray(out.lengths)
        model_s += time.perf_counter() - t0
        replies = tok.batch_decode([tokens[b, : n[b]].tolist() for b in range(batch)], skip_special_tokens=True)
        for b, (g, conv) in enumerate(zip(games, conversations)):
            if active[b]:
                conv.append({"role": "assistant", "content": replies[b]})
                g.reply(replies[b])
                FORMAT_RE.search(replies[b])
    return model_s


host_loop.samplers = {}


def timed(fn, repeats: int) -> tuple[float, object]:
    """(best wall time of `repeats` calls after a warm-up call, what the best call returned)."""
    fn()  # compile and warm up
    best, result = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        elapsed = time.perf_counter() - t
        if elapsed < best:
            best, result = elapsed, out
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small batches (smoke run)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="default 64 256 1024 (quick: 8 32)")
    parser.add_argument("--reprefill-max-batch", type=int, default=256,
                        help="skip the re-prefill peer above this batch (it needs minutes per game batch on a CPU)")
    args = parser.parse_args()
    batches = args.batches or ([8, 32] if args.quick else [64, 256, 1024])

    tok = load_tokenizer()
    env = ttt.TicTacToe(ttt.Params(prompt="compact"))
    preset = env.params.preset
    tables = text.tables_for_env(tok, env)
    config = dataclasses.replace(PRESETS["cpu-5m"], vocab_size=len(tok))
    module = Lfm2ForCausalLM(config)
    params = module.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    def make_run(cache_stages: int):
        rc = ro.RolloutConfig(context_length=CONTEXT, max_turns=MAX_TURNS, cache_stages=cache_stages)
        return ro.make_rollout(env, cached_call(module), lambda b, n: init_cache(config, b, n), tables, rc,
                               sampling.SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW))

    run, run_one_cache = make_run(CACHE_STAGES), make_run(1)
    print(f"LFM2 cpu-5m with the project tokenizer: {n_params / 1e6:.2f}M parameters; compact preset, "
          f"{MAX_TURNS} turns, {MAX_NEW} new tokens a turn, context {CONTEXT}")
    print(f"{'batch':>6} | {'ours games/s':>12} | {'one cache':>9} | {'host-cached':>11} | {'host-reprefill':>14} | "
          f"{'x cached':>8} | {'x reprefill':>11}", flush=True)
    rows = []
    for batch in batches:
        rng = np.random.default_rng(batch)
        seeds = rng.integers(0, 2**32, size=batch, dtype=np.uint64).astype(np.uint32)
        probs = rng.uniform(0.0, 1.0, size=batch).astype(np.float32)
        key = jax.random.PRNGKey(1)
        examples = ttt.Example(jnp.asarray(seeds), jnp.asarray(probs))
        ours, _ = timed(lambda: jax.block_until_ready(run(params, examples, key)), args.repeats)
        ours_one_cache, _ = timed(lambda: jax.block_until_ready(run_one_cache(params, examples, key)), args.repeats)
        traj = jax.device_get(run(params, examples, key))
        cached, cached_model = timed(lambda: host_loop(tok, preset, module, config, params, seeds, probs, key, False), 1)
        reprefill, reprefill_model = float("nan"), float("nan")
        if batch <= args.reprefill_max_batch:
            reprefill, reprefill_model = timed(
                lambda: host_loop(tok, preset, module, config, params, seeds, probs, key, True), 1)
        row = {
            "batch": batch,
            "ours_games_per_s": batch / ours,
            "ours_one_cache_games_per_s": batch / ours_one_cache,
            "host_cached_games_per_s": batch / cached,
            "host_reprefill_games_per_s": batch / reprefill,
            "ratio_vs_cached": cached / ours,
            "ratio_vs_reprefill": reprefill / ours,
            # The peers' wall time outside the model calls: rendering, tokenizing, decoding, parsing, the game.
            "host_cached_python_s": cached - cached_model,
            "host_cached_python_share": (cached - cached_model) / cached,
            "host_reprefill_python_s": reprefill - reprefill_model,
            "ours_mean_turns": float(np.mean(traj.turns)),
            "ours_mean_reply_tokens": float(np.asarray(traj.reply_lengths).sum() / max(np.asarray(traj.turns).sum(), 1)),
        }
        rows.append(row)
        print(
            f"{batch:>6} | {row['ours_games_per_s']:12.1f} | {row['ours_one_cache_games_per_s']:9.1f} | "
            f"{row['host_cached_games_per_s']:11.1f} | "
            f"{row['host_reprefill_games_per_s']:14.1f} | {row['ratio_vs_cached']:8.1f} | {row['ratio_vs_reprefill']:11.1f}",
            flush=True,
        )
        print(f"{'':>6}   host-cached: {row['host_cached_python_s']:.2f} s of {cached:.2f} s in Python "
              f"({100 * row['host_cached_python_share']:.0f} %), the rest in the model; ours: {ours:.2f} s in all",
              flush=True)
        if reprefill != reprefill:  # NaN is not JSON
            row["host_reprefill_games_per_s"] = row["ratio_vs_reprefill"] = row["host_reprefill_python_s"] = None
    print(json.dumps({"benchmark": "rollout_throughput", "params": n_params, "max_turns": MAX_TURNS,
                      "max_new_tokens": MAX_NEW, "context": CONTEXT, "cache_stages": CACHE_STAGES, "rows": rows}))


if __name__ == "__main__":
    main()
