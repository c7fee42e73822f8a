"""Matmul FLOPs of an LFM2 model, counted from its config (the benchmarks' "useful work" figures).

Counted: the dense weights (each multiply-add 2 FLOPs), the tied or untied LM head where logits are
computed, and attention's two score products (q.k and p.v). Not counted: the embedding gather, norms,
activations, the depthwise conv's K taps, softmax: a few percent on the CPU presets. A training step is
3x its forward (the backward's two products per weight), the usual convention.
"""

from __future__ import annotations

import jax


def body_matmul_params(config, params) -> int:
    """Weights a token multiplies by, outside the embedding and the LM head."""
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    head = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    return n_params - config.vocab_size * config.hidden_size - head


def _attention_width(config) -> int:
    """sum over attention layers of heads x head_dim (the q.k / p.v products' width)."""
    return len(config.attention_layers) * config.num_attention_heads * config.head_dim


def decode_flops_per_token(config, params, context: int) -> float:
    """FLOPs to decode one token: the body and the head once, attention over `context` cached positions."""
    weights = body_matmul_params(config, params) + config.vocab_size * config.hidden_size
    return 2 * weights + 2 * 2 * _attention_width(config) * context


def forward_flops(config, params, lengths, head_positions: int) -> float:
    """FLOPs of one causal forward of rows of `lengths` tokens (an iterable of ints: the useful work, no
    padding), with the LM head at `head_positions` positions in all (the loss positions)."""
    body = body_matmul_params(config, params)
    width = _attention_width(config)
    total = 0.0
    for n in lengths:
        n = int(n)
        total += 2 * body * n + 2 * width * n * (n + 1)  # causal: position t attends to t + 1 keys, twice
    return total + 2 * config.vocab_size * config.hidden_size * head_positions
