"""Decode throughput: our jitted sampler vs `transformers`' `generate`, same LFM2 weights, same run.

Generated tokens per second for the `cpu-5m` LFM2 config at batch 1, 64 and 256, 128 new tokens after a
64-token prompt, greedy (both sides), no stop token. Also the fraction of this machine's measured float32
matmul peak (through JAX) that our decode reaches at the largest batch.

    python experiments/benchmarks/decode_throughput.py            # full run
    python experiments/benchmarks/decode_throughput.py --quick    # smoke run

The last line printed is one JSON object with all figures.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.sampling import SamplingConfig, lfm2_model_fn, make_sampler
from models.hf import load_hf, save_hf
from models.lfm2 import PRESETS, Lfm2ForCausalLM, init_cache


def matmul_peak_flops(size: int = 2048, repeats: int = 5) -> float:
    """Best float32 matmul FLOP/s through JAX on this machine."""
    a = jax.random.normal(jax.random.PRNGKey(0), (size, size), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * size**3 / best


def decode_flops_per_token(config, params, context: int) -> float:
    """Matmul FLOPs to decode one token: 2 x (weights touched) + attention over `context` cached positions."""
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    embed = config.vocab_size * config.hidden_size
    # The embedding lookup is a gather; the tied head is a matmul over it.
    matmul_params = n_params - embed + (embed if config.tie_word_embeddings else 0)
    n_attn = sum(t == "full_attention" for t in config.layer_types)
    head_dim = config.hidden_size // config.num_attention_heads
    attention = n_attn * 2 * 2 * config.num_attention_heads * head_dim * context
    return 2 * matmul_params + attention


def time_ours(model, batch: int, prompt_len: int, new_tokens: int, repeats: int):
    sampler = make_sampler(lfm2_model_fn(model.module), SamplingConfig(greedy=True, max_new_tokens=new_tokens))
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
    repeats = 1 if args.quick else 3

    config = PRESETS[args.preset]
    module = Lfm2ForCausalLM(config)
    params = module.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
    with tempfile.TemporaryDirectory() as folder:
        save_hf(config, params, folder)
        model = load_hf(folder)
        hf_model = HfLfm2.from_pretrained(folder, torch_dtype=torch.float32).eval()
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(model.params))
    peak = matmul_peak_flops()
    print(f"LFM2 {args.preset}: {n_params / 1e6:.2f}M parameters; JAX float32 matmul peak {peak / 1e9:.0f} GFLOP/s")
    print(f"{'batch':>6} | {'ours tok/s':>12} | {'generate tok/s':>14} | {'ratio':>6} | greedy tokens agree")
    rows = []
    for batch in batches:
        ours, prompt, our_tokens = time_ours(model, batch, prompt_len, new_tokens, repeats)
        theirs, their_tokens = time_transformers(hf_model, prompt, new_tokens, repeats)
        # Greedy decodes of identical weights agree until float noise flips a near-tie; report the prefix.
        agree = float((our_tokens[:, :16] == their_tokens[:, :16]).mean())
        rows.append({"batch": batch, "ours_tokens_per_s": ours, "transformers_tokens_per_s": theirs, "ratio": ours / theirs, "first16_agree": agree})
        print(f"{batch:>6} | {ours:12.0f} | {theirs:14.0f} | {ours / theirs:6.1f} | {agree:.3f}")
    big = rows[-1]
    flops = decode_flops_per_token(config, model.params, prompt_len + new_tokens // 2) * big["ours_tokens_per_s"]
    print(f"decode at batch {big['batch']}: {flops / 1e9:.1f} GFLOP/s = {flops / peak:.1%} of the matmul peak")
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
            }
        )
    )


if __name__ == "__main__":
    main()
