"""Counter-based draws for environments: JAX's Threefry-2x32 block written out as plain uint32 ops.

An env that draws from an example's seed (Tic-Tac-Toe's opponent moves, arithmetic's operands) calls
`fold_in_words(seed, data)`: bit for bit the two uint32 words of

    jax.random.key_data(jax.random.fold_in(jax.random.PRNGKey(seed), data))

with JAX's default threefry PRNG (`PRNGKey(seed)` is the key (0, seed); `fold_in` hashes the block
(0, data) under it). Written out so XLA fuses the draw with the env's logic: JAX lowers its own
threefry as a rolled loop on CPU, which costs more than a whole game step. One block per draw.

A draw among a set: `pick_set_bit(bits, word, n)` turns a random word into a uniform choice among the set
bits of an n-bit mask (a board game's free cells or playable columns) through `set_bit_table(n)`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["threefry2x32", "fold_in_words", "unit_float", "set_bit_table", "pick_set_bit"]

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


def unit_float(word: jax.Array) -> jax.Array:
    """uint32[...] random word -> f32[...] in [0, 1): its top 24 bits as a fraction (exact in float32)."""
    return (jnp.asarray(word, jnp.uint32) >> jnp.uint32(8)).astype(jnp.float32) * (1.0 / (1 << 24))


@functools.lru_cache(maxsize=None)
def set_bit_table(num_bits: int) -> np.ndarray:
    """-> int32[2**num_bits * num_bits] (host, cached: do not modify): entry mask * num_bits + r is the r-th
    (0-based) set bit of `mask`, -1 if it has fewer."""
    if not isinstance(num_bits, int) or not 1 <= num_bits <= 16:
        raise ValueError(f"num_bits must be an int in 1..16, got {num_bits!r}")
    table = np.full((1 << num_bits, num_bits), -1, np.int32)
    for mask in range(1 << num_bits):
        bits = [b for b in range(num_bits) if mask >> b & 1]
        table[mask, : len(bits)] = bits
    return table.reshape(-1)


def pick_set_bit(bits: jax.Array, word: jax.Array, num_bits: int) -> jax.Array:
    """int32[] mask of `num_bits` bits, uint32[] random word, static num_bits -> int32[]: a uniform set bit,
    -1 if none.

    r = floor(u * #set) for u the word's top 24 bits as a fraction in [0, 1) (a multiply and a shift instead
    of an integer division), then the r-th set bit is one read of `set_bit_table(num_bits)`."""
    bits = jnp.asarray(bits, jnp.int32)
    count = jax.lax.population_count(bits).astype(jnp.uint32)
    r = (((jnp.asarray(word, jnp.uint32) >> jnp.uint32(8)) * count) >> jnp.uint32(24)).astype(jnp.int32)
    return jnp.asarray(set_bit_table(num_bits))[bits * num_bits + r]
