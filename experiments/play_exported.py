"""An exported model (`jaxrl-llm export`) played in `transformers` against one of its env's evaluation
opponents, with free decoding and with the exported reply grammar enforced (`reply_grammar.json` through
`jaxrl_llm.regex_decoding.RegexLogitsProcessor`), the same games for both.

    python experiments/play_exported.py EXPORTED_FOLDER [--games 100] [--setting optimal] [--sample]

The env is the export's `jaxrl_llm_env.json` (name and params); its pure functions play the games (reset,
step, the opponent inside step), its host text renders the messages, and its on-device parser reads the
replies, so a reply counts exactly as it would in training. Prints one row per decoding (games with an
invalid move, with a reply without a move, outcomes) and one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import envs
from jaxrl_llm.export_grammar import read_reply_grammar
from jaxrl_llm.regex_decoding import RegexLogitsProcessor
from jaxrl_llm.text.grammar import parse_bytes

REPLY_BYTES = 256  # a reply's bytes for the parser (16 tokens of a byte-level BPE fit)


def _load(folder: Path):
    import torch
    import transformers

    record = json.loads((folder / "jaxrl_llm_env.json").read_text())
    env = envs.make(record["name"], **record["params"])
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return env, tok, model


def _generate(model, tok, prompts: list[str], max_new_tokens: int, sample: bool, regex: str | None,
              seed: int) -> list[str]:
    """Each prompt's reply (text up to the end of turn), batched with left padding."""
    import torch
    import transformers

    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    width = max(map(len, ids))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    batch = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    processors = transformers.LogitsProcessorList([RegexLogitsProcessor(regex, tok)] if regex else [])
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(batch, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=sample,
                             temperature=1.0 if sample else None, top_k=None, top_p=None,
                             logits_processor=processors, eos_token_id=tok.eos_token_id, pad_token_id=pad)
    replies = []
    for row in out[:, width:].tolist():
        if tok.eos_token_id in row:
            row = row[: row.index(tok.eos_token_id)]
        replies.append(tok.decode(row, skip_special_tokens=False))
    return replies


def play(env, tok, model, games: int, setting: str, max_turns: int, max_new_tokens: int, sample: bool,
         regex: str | None, seed: int = 0) -> dict[str, float]:
    """`games` games against the env's evaluation setting `setting`; the env's metrics averaged."""
    params = env.params
    stage = {s.name: s.stage for s in env.eval_settings()}[setting]
    examples = env.eval_examples(jax.random.PRNGKey(seed), games, stage)
    state = jax.vmap(env.reset, (0, None))(examples, params)
    step = jax.jit(jax.vmap(lambda s, r: env.step(s, r, params)))
    codes = jax.jit(jax.vmap(lambda s: env.message_codes(s, params)))
    parse = jax.jit(jax.vmap(functools.partial(parse_bytes, env.reply_grammar(params))))
    spec = env.message_spec(params)
    chats = [[{"role": "system", "content": env.system_prompt(params)}] for _ in range(games)]
    turns, fmt = np.zeros(games, np.int32), np.zeros(games, np.float32)
    for turn in range(max_turns):
        live = np.flatnonzero(~np.asarray(state.done))
        if live.size == 0:
            break
        shown = np.asarray(codes(state))
        for g in live:
            chats[g].append({"role": "user", "content": spec.render(shown[g].tolist())})
        prompts = [tok.apply_chat_template(chats[g], add_generation_prompt=True, tokenize=False) for g in live]
        replies = _generate(model, tok, prompts, max_new_tokens, sample, regex, seed + turn)
        data, valid = np.zeros((games, REPLY_BYTES), np.uint8), np.zeros((games, REPLY_BYTES), bool)
        for g, reply in zip(live, replies):
            chats[g].append({"role": "assistant", "content": reply})
            b = reply.encode()[:REPLY_BYTES]
            data[g, : len(b)], valid[g, : len(b)] = np.frombuffer(b, np.uint8), True
        parsed = parse(data, valid)  # finished games get an empty reply; `step` keeps them unchanged
        was_live = np.zeros(games, bool)
        was_live[live] = True
        fmt += np.where(was_live, np.asarray(parsed.format_ok, np.float32), 0)
        turns += was_live
        state = step(state, parsed)
    episode = envs.Episode(jnp.asarray(fmt / np.maximum(turns, 1)), jnp.asarray(turns), ~state.done,
                           jnp.zeros(games, bool))
    metrics = jax.vmap(env.metrics, (0, 0, None))(state, episode, params)
    out = {k: float(np.mean(v)) for k, v in metrics.items()}
    out["format"] = float(np.mean(fmt / np.maximum(turns, 1)))
    if "invalid" in out and "missing" in out:
        out["invalid_or_missing"] = float(np.mean((np.asarray(metrics["invalid"]) > 0)
                                                  | (np.asarray(metrics["missing"]) > 0)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--games", type=int, default=100)
    ap.add_argument("--setting", default="optimal")
    ap.add_argument("--max-turns", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--sample", action="store_true", help="sample at temperature 1 (default: greedy)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    env, tok, model = _load(args.folder)
    regex = read_reply_grammar(args.folder)["regex"]
    results = {}
    for name, r in (("free", None), ("grammar", regex)):
        start = time.perf_counter()
        results[name] = play(env, tok, model, args.games, args.setting, args.max_turns, args.max_new_tokens,
                             args.sample, r, args.seed)
        results[name]["seconds"] = round(time.perf_counter() - start, 1)
    keys = [k for k in results["free"] if k != "seconds"]
    print(f"{args.folder} vs {args.setting}, {args.games} games, {'sampled' if args.sample else 'greedy'}")
    print("decoding  " + "  ".join(f"{k:>10}" for k in keys))
    for name, row in results.items():
        print(f"{name:<9} " + "  ".join(f"{100 * row[k]:9.1f}%" for k in keys))
    print(json.dumps({"folder": str(args.folder), "setting": args.setting, "games": args.games,
                      "sample": args.sample, **{n: r for n, r in results.items()}}))


if __name__ == "__main__":
    main()
