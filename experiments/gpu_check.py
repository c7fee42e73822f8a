"""One script for the first GPU session: checks and times everything at once (issue 16).

    python experiments/gpu_check.py --out gpu_check            # on the accelerator, about 8 minutes on an H200
    python experiments/gpu_check.py --smoke --out /tmp/smoke   # the same sections on the CPU, tiny sizes

Writes <out>/gpu_check.json and <out>/gpu_check.md and prints the JSON as its last line. Sections (each
guarded: a failure is recorded as {"error": ...} and the rest still runs):

    device          the device, its kind, jax / jaxlib versions, the nominal HBM bandwidth used below
    matmul          TFLOP/s of a square bfloat16 matmul (float32 with --smoke)
    decode          greedy decode tokens/s of the LFM2-350M preset (random weights, bfloat16) at batch 1 / 64 /
                    256, and the fraction of the HBM roofline: (weight bytes + KV / conv cache bytes read per
                    step) / step time / nominal bandwidth
    prefill         tokens/s of one full forward over [batch, 512]
    rollout         Tic-Tac-Toe games/s of whole rollouts of the 350M preset at batch 256 and 1 024
    grpo            five GRPO steps of the 350M preset and of 1.2B with LoRA rank 8: games/s (steps 2-5),
                    rollout / update split, peak device memory (device.memory_stats(); None on the CPU)
    correctness     greedy tokens of a fixed prompt on the device equal those computed on the CPU backend
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments" / "benchmarks"))

from machine import best_seconds as best_time  # noqa: E402  (one warm-up call, then the best of `repeats`)

# Nominal HBM bandwidth in bytes/s, by a substring of jax's device_kind (lower case).
BANDWIDTH = {"h200": 4.8e12, "h100": 3.35e12, "a100": 2.0e12, "l40": 0.864e12, "a10": 0.6e12,
             "v100": 0.9e12, "tpu v5e": 0.819e12, "tpu v5": 2.76e12, "tpu v4": 1.2e12, "tpu v6": 1.64e12}


def bandwidth(kind: str) -> float | None:
    kind = kind.lower()
    for name, value in BANDWIDTH.items():
        if name in kind:
            return value
    return None


def sizes(smoke: bool) -> dict:
    if smoke:
        return dict(preset="tiny", lora_preset="tiny", dtype="float32", matmul=256, decode_batches=(1, 4),
                    decode_prompt=16, decode_new=8, prefill=(2, 32), rollout_batches=(4,), grpo_prompts=2,
                    grpo_group=2, grpo_steps=2, layers=2)
    return dict(preset="lfm2-350m", lora_preset="lfm2-1.2b", dtype="bfloat16", matmul=8192,
                decode_batches=(1, 64, 256), decode_prompt=128, decode_new=128, prefill=(16, 512),
                rollout_batches=(256, 1024), grpo_prompts=32, grpo_group=8, grpo_steps=5, layers=None)


def section_device(s):
    import jaxlib

    d = jax.devices()[0]
    return {"backend": jax.default_backend(), "device": str(d), "kind": d.device_kind, "count": jax.device_count(),
            "jax": jax.__version__, "jaxlib": jaxlib.__version__, "hbm_bytes_per_s": bandwidth(d.device_kind)}


def section_matmul(s):
    n = s["matmul"]
    dtype = jnp.dtype(s["dtype"])
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32).astype(dtype)
    f = jax.jit(lambda x: x @ x)
    t = best_time(lambda: f(a), 5)
    return {"size": n, "dtype": str(dtype), "tflops": 2 * n**3 / t / 1e12}


def _model(preset: str, dtype: str, layers: int | None = None):
    from models.lfm2 import PRESETS, Lfm2ForCausalLM, init_params

    cfg = PRESETS[preset].replace(dtype=dtype)
    if layers:  # --smoke: the first conv and the first attention layer only
        cfg = cfg.replace(num_hidden_layers=2, layer_types=("conv", "full_attention"))
    return cfg, Lfm2ForCausalLM(cfg), init_params(cfg, jax.random.PRNGKey(0))


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def section_decode(s, hbm):
    from jaxrl_llm.generate import SamplingConfig, make_sampler
    from models.family import cached_call
    from models.lfm2 import init_cache

    cfg, module, params = _model(s["preset"], s["dtype"], s["layers"])
    weights = _nbytes(params)
    sampler = make_sampler(cached_call(module), SamplingConfig(greedy=True, max_new_tokens=s["decode_new"]))
    rows = []
    for batch in s["decode_batches"]:
        prompt = jax.random.randint(jax.random.PRNGKey(batch), (batch, s["decode_prompt"]), 1, cfg.vocab_size)
        lengths = jnp.full((batch,), s["decode_prompt"], jnp.int32)
        max_len = s["decode_prompt"] + s["decode_new"]
        run = lambda: sampler(params, prompt, lengths, init_cache(cfg, batch, max_len), jax.random.PRNGKey(0)).tokens  # noqa: E731
        t = best_time(run, 2)
        per_step = t / s["decode_new"]
        cache = _nbytes(init_cache(cfg, batch, max_len))
        read = weights + cache  # an upper bound: the whole cache is read each step
        rows.append({"batch": batch, "tokens_per_s": batch * s["decode_new"] / t, "step_ms": 1e3 * per_step,
                     "bytes_read_per_step": read,
                     "hbm_roofline_fraction": None if hbm is None else read / per_step / hbm})
    return {"preset": s["preset"], "weight_bytes": weights, "batches": rows}


def section_prefill(s):
    cfg, module, params = _model(s["preset"], s["dtype"], s["layers"])
    batch, length = s["prefill"]
    tokens = jax.random.randint(jax.random.PRNGKey(0), (batch, length), 1, cfg.vocab_size)
    f = jax.jit(lambda p, t: module.apply({"params": p}, t, last_only=True)[0])
    t = best_time(lambda: f(params, tokens), 3)
    return {"batch": batch, "length": length, "tokens_per_s": batch * length / t}


def _config(preset: str, dtype: str, prompts: int, group: int, extra=(), layers=None):
    from jaxrl_llm.config import loads_config

    text = (ROOT / "experiments" / "presets" / "tiny_test.toml").read_text()
    over = [f'model.preset="{preset}"', f'model.dtype="{dtype}"', f"grpo.0.num_prompts={prompts}",
            f"grpo.0.group_size={group}", "grpo.1.steps=0", "grpo.0.rollout.max_turns=3",
            "grpo.0.sampling.max_new_tokens=16", 'run.output_dir="/tmp/jaxrl_llm_gpu_check"']
    if preset != "tiny":
        over.append("model.vocab_size=65536")
    if layers:
        over += ["model.num_hidden_layers=2", 'model.layer_types=["conv", "full_attention"]']
    return loads_config(text, [*over, *extra])


def section_rollout(s):
    from jaxrl_llm import train
    from jaxrl_llm.train import build

    rows = []
    for batch in s["rollout_batches"]:
        config = _config(s["preset"], s["dtype"], batch // 2, 2, layers=s["layers"])
        comp = build(config)
        params = train.fresh_params(comp, train.init_key(config))
        seconds = train.time_stage_rollout(comp, 0, params, jax.random.PRNGKey(0))
        rows.append({"batch": batch, "games_per_s": batch / seconds, "seconds": seconds})
    return {"preset": s["preset"], "batches": rows}


def _peak_memory():
    stats = jax.devices()[0].memory_stats()
    return None if not stats else stats.get("peak_bytes_in_use")


def _grpo(s, preset: str, lora_rank: int):
    from jaxrl_llm import train

    extra = [f"lora.rank={lora_rank}"] if lora_rank else []
    config = _config(preset, s["dtype"], s["grpo_prompts"], s["grpo_group"], extra, s["layers"])
    comp = train.build(config)
    step_fn, optimizer = train.make_grpo_step(comp, 0)
    params = train.fresh_trainable(comp)
    frozen = train.base_params(comp) if lora_rank else None
    opt_state = optimizer.init(params)
    times = []
    for i in range(s["grpo_steps"]):
        t = time.perf_counter()
        params, opt_state, metrics, traj = step_fn(params, opt_state, None, jax.random.PRNGKey(i), frozen)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t)
    policy = train.policy_view(comp, params)
    rollout = train.time_stage_rollout(comp, 0, policy, jax.random.PRNGKey(99))
    step = float(np.median(times[1:]))
    games = config.grpo[0].batch_size
    return {"preset": preset, "lora_rank": lora_rank, "games": games, "first_step_s": times[0], "step_s": step,
            "games_per_s": games / step, "rollout_s": rollout, "update_s": max(step - rollout, 0.0),
            "peak_bytes": _peak_memory()}


def section_grpo(s):
    return {"full": _grpo(s, s["preset"], 0), "lora": _grpo(s, s["lora_preset"], 8)}


def section_correctness(s):
    from jaxrl_llm.generate import SamplingConfig, make_sampler
    from models.family import cached_call
    from models.lfm2 import init_cache

    cfg, module, params = _model("tiny", "float32", s["layers"])
    sampler = make_sampler(cached_call(module), SamplingConfig(greedy=True, max_new_tokens=16))
    prompt = jnp.asarray(np.arange(1, 13, dtype=np.int32)[None] * 7 % cfg.vocab_size)
    lengths = jnp.array([12], jnp.int32)
    tokens = {}
    for name, device in (("device", jax.devices()[0]), ("cpu", jax.devices("cpu")[0])):
        with jax.default_device(device):
            p = jax.device_put(params, device)
            out = sampler(p, jax.device_put(prompt, device), jax.device_put(lengths, device),
                          init_cache(cfg, 1, 28), jax.random.PRNGKey(0))
            tokens[name] = np.asarray(out.tokens).tolist()
    return {"equal": tokens["device"] == tokens["cpu"], "tokens": tokens["device"]}


def markdown(result: dict) -> str:
    lines = ["| section | figure | value |", "|---|---|---|"]

    def row(section, figure, value):
        lines.append(f"| {section} | {figure} | {value} |")

    for name, part in result["sections"].items():
        if "error" in part:
            row(name, "error", part["error"].splitlines()[-1][:120])
            continue
        if name == "device":
            row(name, part["kind"], f"jax {part['jax']}, jaxlib {part['jaxlib']}, {part['count']} device(s)")
        elif name == "matmul":
            row(name, f"{part['dtype']} {part['size']}^2 TFLOP/s", f"{part['tflops']:.2f}")
        elif name == "decode":
            for r in part["batches"]:
                frac = "n/a" if r["hbm_roofline_fraction"] is None else f"{100 * r['hbm_roofline_fraction']:.1f} % of HBM roofline"
                row(name, f"batch {r['batch']} tokens/s", f"{r['tokens_per_s']:.0f} ({frac})")
        elif name == "prefill":
            row(name, f"[{part['batch']}, {part['length']}] tokens/s", f"{part['tokens_per_s']:.0f}")
        elif name == "rollout":
            for r in part["batches"]:
                row(name, f"batch {r['batch']} games/s", f"{r['games_per_s']:.1f}")
        elif name == "grpo":
            for kind, r in ((k, v) for k, v in part.items() if isinstance(v, dict)):
                peak = "n/a" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.1f} GiB peak"
                row(name, f"{r['preset']} {kind} games/s", f"{r['games_per_s']:.1f} (rollout {r['rollout_s']:.2f} s, "
                    f"update {r['update_s']:.2f} s per step; {peak})")
        elif name == "correctness":
            row(name, "greedy tokens device == CPU", str(part["equal"]))
        row(name, "seconds", f"{part.get('seconds', 0):.1f}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for the CPU (well under a minute)")
    parser.add_argument("--out", default="gpu_check", help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument("--only", nargs="*", default=None, help="run only these sections")
    args = parser.parse_args(argv)
    s = sizes(args.smoke)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    sections = {}
    plan = [("device", lambda: section_device(s)), ("matmul", lambda: section_matmul(s)),
            ("decode", lambda: section_decode(s, sections["device"].get("hbm_bytes_per_s"))),
            ("prefill", lambda: section_prefill(s)), ("rollout", lambda: section_rollout(s)),
            ("grpo", lambda: section_grpo(s)), ("correctness", lambda: section_correctness(s))]
    for name, run in plan:
        if args.only and name not in args.only and name != "device":
            continue
        t = time.perf_counter()
        try:
            sections[name] = run()
        except Exception:  # one failing section must not cost the others
            sections[name] = {"error": traceback.format_exc(limit=3)}
        sections[name]["seconds"] = time.perf_counter() - t
        print(f"{name}: {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    result = {"smoke": args.smoke, "total_s": time.perf_counter() - start, "sections": sections}
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "gpu_check.md").write_text(markdown(result))
    print(markdown(result))
    print(json.dumps(result))
    return 0 if not any("error" in p for p in sections.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
