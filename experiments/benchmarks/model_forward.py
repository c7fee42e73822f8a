"""Forward throughput of our Flax models (jitted) vs transformers (torch, no_grad), both families, same CPU.

Each config runs the same random weights on both sides (transformers' init, copied into our layout through
the seam's `models.hf.params_from_hf`), float32, full causal forward returning logits: LFM2's `cpu-5m` (batch 8)
and LFM2-350M (batch 1), Qwen3's `qwen3-cpu` (batch 8) and Qwen3-0.6B (batch 1), at sequence 512. Prints a
table, each family's ratios, then as the last line one JSON object with tokens/s and ratios.

    python experiments/benchmarks/model_forward.py                   # full
    python experiments/benchmarks/model_forward.py --quick           # sequence 128, fewer repeats
    python experiments/benchmarks/model_forward.py --only qwen3-cpu  # one config
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from models.family import PRESETS, family_of
from models.hf import Model, params_from_hf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe, machine_facts  # noqa: E402


def _time_interleaved(fns, repeats: int) -> list[float]:
    """Median seconds of each fn over repeats, alternating the fns each repeat so that a change in machine load
    (the CPU may be shared) hits all of them alike. Call each once before (warm-up, compilation)."""
    times = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return [float(np.median(t)) for t in times]


def bench(name: str, batch: int, seq: int, repeats: int) -> dict:
    cfg = PRESETS[name]
    torch.manual_seed(0)
    hf_config = transformers.AutoConfig.for_model(**cfg.to_hf_dict())
    ref = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    state = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    ours = Model(cfg, params_from_hf(cfg, state))
    del state
    tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (batch, seq)).astype(np.int32)
    tokens_t = torch.tensor(tokens, dtype=torch.long)
    tokens_j = jnp.asarray(tokens)

    def run_torch():
        with torch.no_grad():
            return ref(tokens_t).logits

    def run_ours():
        return jax.block_until_ready(ours(tokens_j))

    t0 = time.perf_counter()
    ours_logits = np.asarray(run_ours())
    compile_s = time.perf_counter() - t0
    torch_logits = run_torch().numpy()
    err = float(np.abs(ours_logits - torch_logits).max() / np.abs(torch_logits).max())
    del ours_logits, torch_logits
    t_ours, t_torch = _time_interleaved([run_ours, run_torch], repeats)
    n = batch * seq
    return {"config": name, "family": family_of(cfg).model_type, "batch": batch, "seq": seq, "ours_tok_s": n / t_ours, "torch_tok_s": n / t_torch,
            "ratio": t_torch / t_ours, "rel_err": err, "compile_s": compile_s}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="sequence 128 and 2 repeats (a smoke run)")
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    runs = [("cpu-5m", 8), ("lfm2-350m", 1), ("qwen3-cpu", 8), ("qwen3-0.6b", 1)]
    parser.add_argument("--only", choices=[name for name, _ in runs], action="append", default=None,
                        help="run only this config (repeatable)")
    args = parser.parse_args()
    seq = args.seq or (128 if args.quick else 512)
    repeats = args.repeats or (2 if args.quick else 5)
    if args.only:
        runs = [r for r in runs if r[0] in args.only]
    facts = machine_facts()
    print(describe(facts))
    print(f"# torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"transformers {transformers.__version__}; float32, seq {seq}, median of {repeats}")
    rows = [bench(name, batch, seq, repeats) for name, batch in runs]
    print(f"{'family':<6} {'config':<11} {'batch':>5} {'seq':>5} {'ours tok/s':>11} {'torch tok/s':>12} {'ratio':>6} "
          f"{'rel err':>9} {'compile s':>9}")
    for r in rows:
        print(f"{r['family']:<6} {r['config']:<11} {r['batch']:>5} {r['seq']:>5} {r['ours_tok_s']:>11.0f} "
              f"{r['torch_tok_s']:>12.0f} {r['ratio']:>6.2f} {r['rel_err']:>9.1e} {r['compile_s']:>9.1f}")
    for fam_name in dict.fromkeys(r["family"] for r in rows):
        ratios = ", ".join(f"{r['config']} {r['ratio']:.2f}x" for r in rows if r["family"] == fam_name)
        print(f"{fam_name} vs transformers: {ratios}")
    ok = all(r["rel_err"] < 1e-4 for r in rows)
    summary = {"benchmark": "model_forward", "seq": seq, "logits_agree": ok, **facts}
    for r in rows:
        key = r["config"].replace("-", "_").replace(".", "_")
        summary[f"{key}_ours_tok_s"] = round(r["ours_tok_s"], 1)
        summary[f"{key}_torch_tok_s"] = round(r["torch_tok_s"], 1)
        summary[f"{key}_ratio"] = round(r["ratio"], 3)
        summary[f"{key}_rel_err"] = r["rel_err"]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
