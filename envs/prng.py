"""Counter-based draws for environments: JAX's Threefry-2x32 block written out as plain uint32 ops.

An env that draws from an example's seed (Tic-Tac-Toe's opponent moves, arithmetic's operands) calls
`fold_in_words(seed, data)`: bit for bit the two uint32 words of

    jax.random.key_data(jax.random.fold_in(jax.random.PRNGKey(seed), data))

with JAX's default threefry PRNG (`PRNGKey(seed)` is the key (0, seed); `fold_in` hashes the block
(0, data) under it). Written out so XLA fuses the draw with the env's logic: JAX lowers its own
threefry as a rolled loop on CPU, which costs more than a whole game step. One block per draw.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["threefry2x32", "fold_in_words"]

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA


def threefry2x32(k0: jax.Array, k1: jax.Array, x0: jax.Array, x1: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Threefry-2x32 (20 rounds) of the block (x0, x1) under the key (k0, k1); uint32 in, uint32 out (any
    broadcastable shapes)."""
    ks = (k0, k1, k0 ^ k1 ^ jnp.uint32(_PARITY))
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = ((x1 << jnp.uint32(r)) | (x1 >> jnp.uint32(32 - r))) ^ x0
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + jnp.uint32(i + 1)
    return x0, x1


def fold_in_words(seed: jax.Array, data: jax.Array) -> tuple[jax.Array, jax.Array]:
    """seed, data (integers, cast to uint32; any broadcastable shapes) -> the two uint32 words of
    fold_in(PRNGKey(seed), data) (see the module docstring)."""
    seed = jnp.asarray(seed).astype(jnp.uint32)
    data = jnp.asarray(data).astype(jnp.uint32)
    return threefry2x32(jnp.uint32(0), seed, jnp.uint32(0), data)
