"""The named random streams of a run: every draw of an experiment comes from one of them, derived from run.seed.

    init         the model's initial parameters (when not loaded from a checkpoint)
    sft_data     the teacher's games for SFT
    sft_batches  the order of SFT batches
    grpo         GRPO step s draws its examples, rollouts and shuffles from fold_in(stream, s)
    eval         evaluation: setting i draws from fold_in(stream, i)
    lora         the initial LoRA adapters (A; B starts at zero), with [lora] rank >= 1

The stream ids are fixed numbers (init 10**9, sft_data 1, sft_batches 2, grpo 3, lora 4) so that a run is the same
function of its seed in every version; eval is PRNGKey(seed + 7) (the key the committed results used).
"""

from __future__ import annotations

import jax

STREAMS = {"init": 10**9, "sft_data": 1, "sft_batches": 2, "grpo": 3, "lora": 4}


def stream(seed: int, name: str, index: int | None = None) -> jax.Array:
    """The key of stream `name` of the run with `seed` (and its `index`-th subkey, e.g. a GRPO step)."""
    if name == "eval":
        key = jax.random.PRNGKey(seed + 7)
    elif name in STREAMS:
        key = jax.random.fold_in(jax.random.PRNGKey(seed), STREAMS[name])
    else:
        raise KeyError(f"unknown key stream {name!r}; the streams are {sorted([*STREAMS, 'eval'])}")
    return key if index is None else jax.random.fold_in(key, index)
