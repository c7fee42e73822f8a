"""Device memory of a preset's GRPO training, planned before any run (`jaxrl-llm train <preset> --plan`).

`plan(config)` counts, per device (one device, no sharding):

    params        the policy's weights (param_dtype)
    grads         float32 gradients of what is trained (the model, or with LoRA the adapters)
    optimizer     AdamW's two float32 moments of what is trained
    reference     a second copy of the weights for the KL term: beta > 0 without LoRA; 0 otherwise
                  (beta = 0 needs none; LoRA's reference is the frozen base itself)
    kv_cache      the rollout's cache (`models.family.init_cache`, its real shapes): per attention layer keys
                  + values [B, kv_heads, context, head_dim], per LFM2 conv layer its state
                  [B, conv_L_cache - 1, hidden], in cache_dtype; B = the stage's games
    activations   an estimate for one micro-batch of the update (rows = B / micro-batches, T = context):
                  float32 logits and log-softmax [rows, K, V] x 2, K = the loss positions a row can hold
                  (max_completion_tokens rounded up to 8) with `logits_at_loss_only`, else T; the table
                  also shows both (`activations_all_positions`, `activations_loss_positions`); plus with
                  remat one hidden state
                  [rows, T, hidden] per layer and one layer's working set ([rows, T, 4 hidden + 3 inter],
                  inter = the config's intermediate_size),
                  without remat that working set for every layer (compute dtype)
    total         their sum, for the stage that needs most

The model comes from the preset (or `model.init_from`'s config.json; when that folder is not on this
machine, the built-in preset its name matches, e.g. LFM2-350M -> "lfm2-350m", Qwen3-0.6B -> "qwen3-0.6b"),
of any family: it is reached through the seam (`models.family`). `compiled_peak` lowers and compiles the
real GRPO update on the CPU for a scaled-down shape and reads XLA's `memory_analysis()`.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

GIB = 2**30


def model_config(config) -> Any:
    """The preset's model config (any family); an `init_from` folder missing here falls back to the preset
    of its name."""
    from models.family import PRESETS

    init_from = config.model.init_from
    if init_from is not None and not (Path(init_from) / "config.json").is_file():
        name = Path(init_from).name.lower()
        if name not in PRESETS:
            raise FileNotFoundError(f"model.init_from = {init_from!r} is not on this machine and its name matches no "
                                    f"built-in preset ({', '.join(PRESETS)}): download it, or plan with "
                                    "--set model.preset=... and without init_from")
        return dataclasses.replace(PRESETS[name], **config.model.overrides())
    return config.model.model_config()


def _bytes(tree) -> int:
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))


def param_shapes(model_config):
    from models.family import param_shapes

    return param_shapes(model_config)


def plan(config) -> dict[str, Any]:
    """{"model", "params_count", and per stage {name: bytes}} plus "total" of the largest stage (bytes)."""
    from models import lora as lora_lib

    cfg = model_config(config)
    shapes = param_shapes(cfg)
    params = _bytes(shapes)
    count = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(shapes))
    if config.lora.enabled:
        trained = _bytes(jax.eval_shape(lambda: lora_lib.init_adapters(config.lora, shapes, jax.random.PRNGKey(0))))
    else:
        trained = count * 4
    from models.family import init_cache

    compute = jnp.dtype(cfg.jnp_dtype).itemsize
    stages = []
    for i, s in enumerate(config.grpo):
        B, T = s.batch_size, s.rollout.context_length
        cache_shapes = jax.eval_shape(lambda: init_cache(cfg, B, T))
        kv = _bytes(cache_shapes) - _bytes(cache_shapes.lengths)
        rows = max(1, B // s.grpo_config().micro_batches)
        gcfg = s.grpo_config()
        loss_positions = min(T, -(-(gcfg.max_completion_tokens or T) // 8) * 8)
        layer = rows * T * (4 * cfg.hidden_size + 3 * cfg.intermediate_size) * compute
        hidden = rows * T * cfg.hidden_size * compute
        body = cfg.num_hidden_layers * hidden + layer if cfg.remat else cfg.num_hidden_layers * layer
        all_positions = 2 * rows * T * cfg.vocab_size * 4 + body
        at_loss = 2 * rows * loss_positions * cfg.vocab_size * 4 + body
        acts = at_loss if gcfg.logits_at_loss_only else all_positions
        reference = params if (s.loss.beta > 0 and not config.lora.enabled) else 0
        parts = {"params": params, "grads": trained, "optimizer": 2 * trained, "reference": reference,
                 "kv_cache": kv, "activations": acts}
        stages.append({"stage": i, "games": B, "context": T, "micro_rows": rows, **parts,
                       "total": sum(parts.values()), "loss_positions": loss_positions,
                       "activations_all_positions": all_positions, "activations_loss_positions": at_loss})
    return {"model": cfg, "params_count": count, "stages": stages,
            "total": max((s["total"] for s in stages), default=params)}


def compiled_peak(config, layers: int = 2, rows: int = 2, length: int = 64) -> dict[str, Any]:
    """XLA's memory analysis of the real GRPO update (`algos.grpo.grpo_update_step`) compiled on this
    backend for the preset's model cut to `layers` layers, a batch of `rows` x `length` tokens, one
    micro-batch. With [lora] rank >= 1 it is the LoRA update (adapters trained, gradients and optimizer state
    for them alone, the base frozen). `model.attention = "cudnn"` compiles with XLA's attention off a GPU (the
    fused kernel needs one). -> {"shape", "argument_bytes", "output_bytes", "temp_bytes", "peak_bytes"}."""
    from jaxrl_llm.algos.grpo import grpo_update_step
    from jaxrl_llm.algos.optim import make_optimizer
    from models.family import module_of

    cfg = model_config(config).first_layers(layers)
    if cfg.attention == "cudnn" and jax.default_backend() not in ("gpu", "cuda"):
        cfg = cfg.replace(attention="xla")  # cuDNN's fused kernel needs a GPU: the same shapes through XLA's here
    stage = config.grpo[0]
    gcfg = dataclasses.replace(stage.grpo_config(), num_minibatches=1, grad_accum_steps=1, passes=1, beta=0.0)
    optimizer = make_optimizer(stage.optim_config())
    module = module_of(cfg)
    params = param_shapes(cfg)
    frozen = None
    if config.lora.enabled:  # the update GRPO runs: adapters on the frozen base
        from models import lora as lora_lib

        module = lora_lib.LoraModel(module, config.lora)
        frozen = params
        params = jax.eval_shape(lambda: lora_lib.init_adapters(config.lora, frozen, jax.random.PRNGKey(0)))
    opt_state = jax.eval_shape(optimizer.init, params)
    tok = jax.ShapeDtypeStruct((rows, length), jnp.int32)
    f32 = jax.ShapeDtypeStruct((rows, length), jnp.float32)
    fn = jax.jit(lambda p, o, t, m, lp, r, k, f: grpo_update_step(module, optimizer, gcfg, p, o, None, t, m, lp, r, k,
                                                                  frozen=f, group_size=rows,
                                                                  temperature=stage.sampling.temperature))
    compiled = fn.lower(params, opt_state, tok, f32, f32, jax.ShapeDtypeStruct((rows,), jnp.float32),
                        jax.eval_shape(lambda: jax.random.PRNGKey(0)), frozen).compile()
    stats = compiled.memory_analysis()
    get = lambda name: int(getattr(stats, name, 0) or 0)  # noqa: E731
    lora_text = f", LoRA rank {config.lora.rank} ({len(jax.tree_util.tree_leaves(params))} adapter arrays)" \
        if frozen is not None else ""
    out = {"shape": f"{layers} layers of {cfg.hidden_size} wide, vocab {cfg.vocab_size}, batch {rows} x {length}"
                    f"{lora_text}",
           "argument_bytes": get("argument_size_in_bytes"), "output_bytes": get("output_size_in_bytes"),
           "temp_bytes": get("temp_size_in_bytes")}
    peak = get("peak_memory_in_bytes")
    out["peak_bytes"] = peak or out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"]
    return out


def format_plan(result: dict[str, Any], devices: tuple[tuple[str, float], ...] = (("80 GB", 80e9),
                                                                              ("141 GB", 141e9))) -> str:
    """A readable table of `plan`'s stages (GiB) with the headroom on each device size."""
    cfg = result["model"]
    lines = [f"model: {result['params_count']:,} parameters, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
             f"dtype {cfg.dtype} (params {cfg.param_dtype}, cache {cfg.cache_dtype or cfg.dtype}), "
             f"remat {cfg.remat}"]
    keys = ("params", "grads", "optimizer", "reference", "kv_cache", "activations", "total")
    lines.append("| stage | games x context | micro rows | " + " | ".join(keys) + " (GiB) |")
    lines.append("|---" * (len(keys) + 3) + "|")
    for s in result["stages"]:
        lines.append(f"| {s['stage']} | {s['games']} x {s['context']} | {s['micro_rows']} | "
                     + " | ".join(f"{s[k] / GIB:.2f}" for k in keys) + " |")
    for s in result["stages"]:
        lines.append(f"stage {s['stage']} update activations: {s['activations_all_positions'] / GIB:.2f} GiB with "
                     f"logits at all {s['context']} positions, {s['activations_loss_positions'] / GIB:.2f} GiB at the "
                     f"{s['loss_positions']} loss positions only (grpo.loss.logits_at_loss_only)")
    for name, size in devices:
        room = size - result["total"]
        lines.append(f"on a {name} device: {result['total'] / GIB:.1f} GiB planned, "
                     f"{room / GIB:.1f} GiB to spare ({'fits' if room > 0 else 'DOES NOT FIT'})")
    return "\n".join(lines)
