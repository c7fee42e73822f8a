"""Decode throughput: our jitted sampler vs `transformers`' `generate`, same LFM2 weights, same run.

Generated tokens per second for the `cpu-5m` LFM2 config at batch 1, 64 and 256, 128 new tokens after a
64-token prompt, greedy (both sides), no stop token. Also the fraction of this machine's measured float32
matmul peak (through JAX) that our decode reaches at the largest batch, and two ceilings measured in the
same run that bound what any JAX decode of these float32 weights can reach here:

* batch 1: every generated token multiplies one activation row by every weight matrix of the model. The
  same matrix-vector products alone, all of them in one jitted call (no norms, attention, sampling or
  loop), take `weight_floor_ms`; the decode cannot beat 1 / weight_floor tokens/s.
* largest batch: prefill plus decode need `flops_per_generated_token` matmul FLOPs per generated token;
  at the measured matmul peak that is the most tokens/s the batch can reach.

    python experiments/benchmarks/decode_throughput.py            # full run
    python experiments/benchmarks/decode_throughput.py --quick    # smoke run

The last line printed is one JSON object with all figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.generate import SamplingConfig, make_sampler
from models.family import cached_call, flops_per_token
from models.hf import load_hf, save_hf
from models.lfm2 import PRESETS, Lfm2ForCausalLM, init_cache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe, machine_facts, matmul_peak_flops  # noqa: E402


def dense_kernels(params) -> list[jax.Array]:
    """The 2-D weight matrices a decode step multiplies by ([in, out]; the tied embedding as the head)."""
    kernels = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = [getattr(k, "key", str(k)) for k in path]
        if names[-1] == "kernel" and leaf.ndim == 2 and names[-2] != "conv":  # conv/conv/kernel is depthwise
            kernels.append(leaf)
        elif names[-1] == "embedding" and "lm_head" not in params:
            kernels.append(leaf.T)
    return kernels


def weight_floor_seconds(params, repeats: int = 20) -> float:
    """Best time of one jitted call doing every weight matrix's product with one activation row.

    The products are independent (XLA may run them in parallel), so this is an optimistic floor for the
    matmul part of a batch-1 decode step with this JAX build on this CPU.
    """
    kernels = [jnp.asarray(k) for k in dense_kernels(params)]
    widths = sorted({int(k.shape[0]) for k in kernels})
    rows = {w: jnp.ones((1, w), jnp.float32) for w in widths}

    @jax.jit
    def products(rows, kernels):
        return sum((rows[int(k.shape[0])] @ k)[0, 0] for k in kernels)

    products(rows, kernels).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        products(rows, kernels).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return best


def time_ours(model, batch: int, prompt_len: int, new_tokens: int, repeats: int):
    sampler = make_sampler(cached_call(model.module), SamplingConfig(greedy=True, max_new_tokens=new_tokens))
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(1, model.config.vocab_size, size=(batch, prompt_len)), jnp.int32)
    lengths = jnp.full((batch,), prompt_len, jnp.int32)
    max_len = prompt_len + new_tokens
    out = sampler(model.params, prompt, lengths, init_cache(model.config, batch, max_len), jax.random.PRNGKey(0))
    out.tokens.block_until_ready()  # compile + warm up
    best = float("inf")
    for _ in range(repeats):
        cache = init_cache(model.config, batch, max_len)
        jax.block_until_ready(cache)
        t = time.perf_counter()
        out = sampler(model.params, prompt, lengths, cache, jax.random.PRNGKey(0))
        out.tokens.block_until_ready()
        best = min(best, time.perf_counter() - t)
    assert int(out.lengths.min()) == new_tokens
    return batch * new_tokens / best, np.asarray(prompt), np.asarray(out.tokens)


def time_transformers(hf_model, prompt: np.ndarray, new_tokens: int, repeats: int):
    import torch

    ids = torch.as_tensor(prompt, dtype=torch.long)
    mask = torch.ones_like(ids)
    kwargs = dict(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=mask, **kwargs)  # warm up
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            out = hf_model.generate(ids, attention_mask=mask, **kwargs)
            best = min(best, time.perf_counter() - t)
    return prompt.shape[0] * new_tokens / best, out[:, prompt.shape[1] :].numpy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small batches and few tokens (smoke run)")
    parser.add_argument("--preset", default="cpu-5m")
    args = parser.parse_args()
    import torch
    from transformers import Lfm2ForCausalLM as HfLfm2

    batches = [1, 8] if args.quick else [1, 64, 256]
    prompt_len, new_tokens = (16, 16) if args.quick else (64, 128)
    # Best of several runs per side (this shared 2-core machine is noisy; small batches are cheap to repeat).
    repeats = {b: 1 if args.quick else (10 if b == 1 else 5 if b <= 64 else 3) for b in batches}

    config = PRESETS[args.preset]
    module = Lfm2ForCausalLM(config)
    params = module.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
    with tempfile.TemporaryDirectory() as folder:
        save_hf(config, params, folder)
        model = load_hf(folder)
        hf_model = HfLfm2.from_pretrained(folder, torch_dtype=torch.float32).eval()
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(model.params))
    facts = machine_facts()
    print(describe(facts))
    peak = matmul_peak_flops()
    print(f"LFM2 {args.preset}: {n_params / 1e6:.2f}M parameters; JAX float32 matmul peak {peak / 1e9:.0f} GFLOP/s")
    print(f"{'batch':>6} | {'ours tok/s':>12} | {'generate tok/s':>14} | {'ratio':>6} | greedy tokens agree")
    rows = []
    for batch in batches:
        ours, prompt, our_tokens = time_ours(model, batch, prompt_len, new_tokens, repeats[batch])
        theirs, their_tokens = time_transformers(hf_model, prompt, new_tokens, repeats[batch])
        # Greedy decodes of identical weights agree until float noise flips a near-tie; report the prefix.
        agree = float((our_tokens[:, :16] == their_tokens[:, :16]).mean())
        rows.append({"batch": batch, "ours_tokens_per_s": ours, "transformers_tokens_per_s": theirs, "ratio": ours / theirs, "first16_agree": agree})
        print(f"{batch:>6} | {ours:12.0f} | {theirs:14.0f} | {ours / theirs:6.1f} | {agree:.3f}")
    big, one = rows[-1], rows[0]
    decode_flops = flops_per_token(config, prompt_len + new_tokens // 2)
    flops = decode_flops * big["ours_tokens_per_s"]
    print(f"decode at batch {big['batch']}: {flops / 1e9:.1f} GFLOP/s = {flops / peak:.1%} of the matmul peak")
    # Ceilings measured in this run (see the module docstring).
    floor = weight_floor_seconds(model.params)
    prefill_flops = flops_per_token(config, prompt_len // 2) * prompt_len / new_tokens
    ceiling_big = peak / (decode_flops + prefill_flops)
    ceilings = {
        "weight_floor_ms": floor * 1e3,
        "batch1_ceiling_tokens_per_s": 1 / floor,
        "batch1_ceiling_ratio": 1 / floor / one["transformers_tokens_per_s"],
        "flops_per_generated_token": decode_flops + prefill_flops,
        "max_batch_ceiling_tokens_per_s": ceiling_big,
        "max_batch_ceiling_ratio": ceiling_big / big["transformers_tokens_per_s"],
    }
    print(f"batch {one['batch']} ceiling: the weight products alone take {floor * 1e3:.3f} ms -> at most "
          f"{1 / floor:.0f} tokens/s = {ceilings['batch1_ceiling_ratio']:.1f}x generate (we reach {one['ratio']:.1f}x)")
    print(f"batch {big['batch']} ceiling: {(decode_flops + prefill_flops) / 1e6:.1f} MFLOP per generated token at the "
          f"matmul peak -> at most {ceiling_big:.0f} tokens/s = {ceilings['max_batch_ceiling_ratio']:.1f}x generate "
          f"(we reach {big['ratio']:.1f}x)")
    print(
        json.dumps(
            {
                "benchmark": "decode_throughput",
                "preset": args.preset,
                "params": n_params,
                "prompt_tokens": prompt_len,
                "new_tokens": new_tokens,
                "rows": rows,
                "matmul_peak_gflops": peak / 1e9,
                "decode_gflops_at_max_batch": flops / 1e9,
                "fraction_of_peak_at_max_batch": flops / peak,
                **ceilings,
                **facts,
            }
        )
    )


if __name__ == "__main__":
    main()
