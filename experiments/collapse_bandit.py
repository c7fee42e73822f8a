"""Format collapse on a one-move bandit, and the remedies (issue 30, part 4), measured in a few minutes.

The setup, small on purpose: a 2-layer LFM2 (PRESETS["tiny"], vocabulary 16) answers 8 fixed prompts with
a reply of four tokens, `OPEN cell CLOSE END` (cell one of 9 digit tokens). Format: the three fixed tokens
in place. Reward: 0.2 for the format plus 1 for cell 0 in format (the issue's "X on cell 0" bandit).
Warm-up: SFT on replies with a uniform cell (the format learned, no preference among the cells). Then
GRPO (8 prompts x 8 samples, Adam, constant rate, grad clip 1) for `--steps` steps at each learning rate,
with each remedy:

  adam         the baseline: loss on every reply token, beta 0
  kl           beta = 0.1 (k3 KL to the SFT policy)
  decision     loss only on the cell token (`loss_on = "decision"`)
  adam_eps     Adam eps = 1e-4 (near-zero gradients stay near-zero steps)
  adam_b2      Adam b2 = 0.9

Per run: the format rate and the cell-0 rate of the sampled replies, over the last 5 steps and at worst.
Prints one table and one JSON object last.

    python experiments/collapse_bandit.py                # lr 1e-3 and 3e-3, 30 steps
    python experiments/collapse_bandit.py --steps 20 --lrs 3e-3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl_llm.algos.grpo import GrpoConfig, make_grpo_update
from jaxrl_llm.algos.optim import OptimConfig, make_optimizer
from jaxrl_llm.generate import SamplingConfig, make_sampler
from models.family import cached_call
from models.lfm2 import ATTENTION, CONV, PRESETS, Lfm2ForCausalLM, init_cache, init_params

VOCAB = 16
CELLS = np.arange(3, 12)  # the 9 cell tokens
OPEN, CLOSE, END = 12, 13, 14
PROMPTS, GROUP, PROMPT_LEN, REPLY = 8, 8, 4, 4
REMEDIES = {
    "adam": ({}, {}),
    "kl": ({"beta": 0.1}, {}),
    "decision": ({"loss_on": "decision"}, {}),
    "adam_eps": ({}, {"eps": 1e-4}),
    "adam_b2": ({}, {"b2": 0.9}),
}


def warm_up(module, params, prompts, key, steps=300):
    """SFT on `OPEN cell CLOSE END` with a uniform cell: the format, and no preference among the cells."""
    opt = optax.adam(3e-3)

    @jax.jit
    def step(p, o, k):
        cells = jax.random.choice(k, jnp.asarray(CELLS), (prompts.shape[0],))
        reply = jnp.stack([jnp.full_like(cells, OPEN), cells, jnp.full_like(cells, CLOSE), jnp.full_like(cells, END)], 1)
        tokens = jnp.concatenate([prompts, reply], 1)

        def loss(p):
            logits = module.apply({"params": p}, tokens)[0][:, PROMPT_LEN - 1:-1]
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), reply[..., None], -1))

        value, g = jax.value_and_grad(loss)(p)
        u, o = opt.update(g, o, p)
        return optax.apply_updates(p, u), o, value

    o = opt.init(params)
    for i in range(steps):
        params, o, value = step(params, o, jax.random.fold_in(key, i))
    return params, float(value)


def rates(reply):
    fmt = (reply[:, 0] == OPEN) & np.isin(reply[:, 1], CELLS) & (reply[:, 2] == CLOSE) & (reply[:, 3] == END)
    return fmt, fmt & (reply[:, 1] == CELLS[0])


def run(module, config, sft, prompts, lr, remedy, steps, seed):
    loss_kw, optim_kw = REMEDIES[remedy]
    gcfg = GrpoConfig(length_buckets=1, **loss_kw)
    opt = make_optimizer(OptimConfig(learning_rate=lr, total_steps=steps, schedule="constant", **optim_kw))
    sconf = SamplingConfig(temperature=1.0, max_new_tokens=REPLY)
    update = make_grpo_update(module, opt, gcfg, ref_params=sft if gcfg.beta > 0 else None, group_size=GROUP,
                              temperature=sconf.temperature)
    sampler = jax.jit(make_sampler(cached_call(module), sconf))
    params = jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), sft)
    o = opt.init(params)
    batch = prompts.shape[0]
    mask = jnp.zeros((batch, PROMPT_LEN + REPLY), jnp.float32).at[:, PROMPT_LEN:].set(1.0)
    decision = jnp.zeros_like(mask).at[:, PROMPT_LEN + 1].set(1.0)
    key = jax.random.PRNGKey(seed)
    fmt_hist, hit_hist, change = [], [], []
    for i in range(steps):
        k_sample, k_update = jax.random.split(jax.random.fold_in(key, i))
        out = sampler(params, prompts, jnp.full((batch,), PROMPT_LEN), init_cache(config, batch, PROMPT_LEN + REPLY),
                      k_sample)
        reply = np.asarray(out.tokens)
        fmt, hit = rates(reply)
        reward = jnp.asarray(0.2 * fmt + 1.0 * hit, jnp.float32)
        tokens = jnp.concatenate([prompts, out.tokens], 1)
        logprobs = jnp.zeros(tokens.shape, jnp.float32).at[:, PROMPT_LEN:].set(out.logprobs)
        params, o, m = update(params, o, tokens, mask, logprobs, reward, k_update, decision_mask=decision)
        fmt_hist.append(float(fmt.mean()))
        hit_hist.append(float(hit.mean()))
        change.append(float(m["decision_policy_change"]))
    return {"lr": lr, "remedy": remedy, "format_last5": float(np.mean(fmt_hist[-5:])), "format_min": min(fmt_hist),
            "hit_last5": float(np.mean(hit_hist[-5:])), "hit_first": hit_hist[0],
            "first_step_format_below_0.9": next((i for i, f in enumerate(fmt_hist) if f < 0.9), None),
            "decision_policy_change_mean": float(np.mean(change))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3])
    parser.add_argument("--remedies", nargs="+", default=list(REMEDIES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = dataclasses.replace(PRESETS["tiny"], vocab_size=VOCAB, num_hidden_layers=2, layer_types=(CONV, ATTENTION))
    module = Lfm2ForCausalLM(config)
    key = jax.random.PRNGKey(args.seed)
    prompts = jnp.repeat(jax.random.randint(key, (PROMPTS, PROMPT_LEN), 3, VOCAB), GROUP, axis=0)
    start = time.perf_counter()
    sft, sft_loss = warm_up(module, init_params(config, key), prompts, key)
    print(f"warm-up: SFT loss {sft_loss:.3f} a token (floor ln 9 / 4 = {np.log(9) / 4:.3f}), "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    results = []
    for lr in args.lrs:
        for remedy in args.remedies:
            r = run(module, config, sft, prompts, lr, remedy, args.steps, args.seed + 1)
            results.append(r)
            print(f"lr {lr:g} {remedy:9s} format last-5 {r['format_last5']:.3f} (min {r['format_min']:.3f}, first "
                  f"< 0.9 at step {r['first_step_format_below_0.9']}), cell 0 {r['hit_first']:.2f} -> "
                  f"{r['hit_last5']:.2f}, decision change {r['decision_policy_change_mean']:.3f} nats/step", flush=True)
    print(json.dumps({"benchmark": "collapse_bandit", "steps": args.steps, "seconds": time.perf_counter() - start,
                      "results": results}))


if __name__ == "__main__":
    main()
