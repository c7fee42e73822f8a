"""The generic update: passes x minibatches x gradient accumulation, length buckets, skipping rows without signal.

An algorithm supplies a per-micro-batch loss, a pure function

    loss_fn(params, micro, bucket, norms, key) -> (loss f32[], aux {name: f32[]})

and a batch `data`: a dict of arrays with a leading axis of B rows (whatever its loss reads), holding two
keys the machinery reads itself:
    need   int32[B]  the positions a row's loss needs (`real_lengths`): the micro-batch runs at the
                     shortest bucket length >= the longest `need` of its rows (`bucket`, static);
    signal bool[B]   the row's gradient can be non-zero (e.g. GRPO with beta = 0: an advantage != 0 on a
                     loss token). A minibatch without any takes no optimizer step (params and optimizer
                     state stay as they are); with `skip_zero_signal` a micro-batch without any skips its
                     forward and backward (`lax.cond` through `lax.switch`) and gives exact zeros.
`norms = normalisers(minibatch)` is computed once per minibatch, before it is cut into micro-batches, so
every micro-batch divides by its minibatch's totals (e.g. the token count): summing the micro-batches'
losses, aux sums and gradients is then the minibatch taken in one piece. `key` is one key per micro-batch
(e.g. LoRA dropout), drawn from the pass key without changing the shuffle.

Everything is traceable: call `minibatch_update` inside the algorithm's one `jit`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from jaxrl_llm.algos.optim import applied_learning_rate, global_norm
from jaxrl_llm.checks import check_int

MicroLoss = Callable[[Any, dict, int, Any, jax.Array], tuple[jax.Array, dict]]


@dataclasses.dataclass(frozen=True)
class UpdateSchedule:
    """How one update walks its batch (static under jit).

    num_minibatches: optimizer steps per pass (must divide B); passes: passes over the batch (each sees
    every row once); grad_accum_steps: micro-batches per minibatch (must divide B / num_minibatches);
    shuffle: rows permuted with the pass key at each pass (else in order); buckets: the static lengths a
    micro-batch may run at, ascending (`bucket_lengths`; the last is the full length L, >= every `need`);
    skip_zero_signal: micro-batches without signal skip their forward and backward.
    """

    buckets: tuple[int, ...]
    num_minibatches: int = 1
    passes: int = 1
    grad_accum_steps: int = 1
    shuffle: bool = True
    skip_zero_signal: bool = True

    def __post_init__(self):
        for name in ("num_minibatches", "passes", "grad_accum_steps"):
            check_int(self, name, 1)
        if not self.buckets or list(self.buckets) != sorted(set(self.buckets)):
            raise ValueError(f"buckets must be ascending distinct lengths, got {self.buckets}")


def bucket_lengths(length: int, count: int) -> tuple[int, ...]:
    """The static lengths of `GrpoConfig.length_buckets`, ascending, the last `length`.

    Bucket i (1 .. count) is ceil(i * length / count) rounded up to a multiple of 8, at most `length`
    (duplicates dropped): e.g. 400, 8 -> (56, 104, 152, 200, 256, 304, 352, 400).
    """
    out = {int(length)}
    for i in range(1, count):
        b = -(-i * length // count)
        out.add(min(int(length), -(-b // 8) * 8))
    return tuple(sorted(out))


def real_lengths(loss_mask: jax.Array) -> jax.Array:
    """The positions a row's loss needs: float32[B, L] -> int32[B], its last loss position + 1 (0: none).

    A causal model's log-probs of those positions are the same over the first `real_lengths` tokens as
    over the whole row."""
    length = loss_mask.shape[1]
    return jnp.max(jnp.where(loss_mask > 0, jnp.arange(1, length + 1, dtype=jnp.int32), 0), axis=1)


def bucket_index(buckets: tuple[int, ...], need: jax.Array) -> jax.Array:
    """The index of the shortest bucket holding every row: int32[R] -> int32[] (for `lax.switch`)."""
    return jnp.searchsorted(jnp.asarray(buckets, jnp.int32), jnp.max(need))


def bucketed_map(fn: Callable[[int, dict], tuple], data: dict, need: jax.Array, buckets: tuple[int, ...],
                 chunk_rows: int) -> tuple:
    """A no-gradient map over the whole batch in length buckets: fn(bucket, chunk) -> tuple of [R, ...].

    data: {name: [B, ...]}; need int32[B]. The rows are ordered by `need`, cut into chunks of chunk_rows
    rows (must divide B), each chunk run by `fn` at its bucket (`fn` must give the same shapes for every
    bucket), then put back: returns the tuple of [B, ...] in the batch's order, without gradient.
    """
    batch = need.shape[0]
    order = jnp.argsort(need)
    inverse = jnp.argsort(order)
    chunks = {k: v[order].reshape((-1, chunk_rows) + v.shape[1:]) for k, v in data.items()}
    branches = [functools.partial(fn, lb) for lb in buckets]

    def one(xs):
        chunk, chunk_need = xs
        return jax.lax.switch(bucket_index(buckets, chunk_need), branches, chunk)

    outs = jax.lax.map(one, (chunks, need[order].reshape(-1, chunk_rows)))
    return tuple(jax.lax.stop_gradient(o.reshape((batch,) + o.shape[2:])[inverse]) for o in outs)


def _zeros_of(loss_fn: MicroLoss, bucket: int, p, micro: dict, norms, key) -> tuple:
    """((loss, aux), grads) of exact zeros, shaped as loss_fn's at `bucket` (nothing is computed)."""
    out = jax.eval_shape(lambda p, m, n, k: loss_fn(p, m, bucket, n, k), p, micro, norms, key)
    zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), out)
    return zeros, jax.tree_util.tree_map(jnp.zeros_like, p)


def micro_grads(loss_fn: MicroLoss, schedule: UpdateSchedule, p, micro: dict, norms, key):
    """((loss, aux), grads) of one micro-batch at its bucket; exact zeros, uncomputed, when no row has
    signal and `schedule.skip_zero_signal`."""
    buckets = schedule.buckets

    def branch(lb, p, micro, norms, key):
        return jax.value_and_grad(lambda q: loss_fn(q, micro, lb, norms, key), has_aux=True)(p)

    branches = [functools.partial(branch, lb) for lb in buckets]
    index = bucket_index(buckets, micro["need"])
    if schedule.skip_zero_signal:
        branches = [lambda p, m, n, k: _zeros_of(loss_fn, buckets[0], p, m, n, k)] + branches
        index = jnp.where(jnp.any(micro["signal"]), index + 1, 0)
    if len(branches) == 1:
        return branches[0](p, micro, norms, key)
    return jax.lax.switch(index, branches, p, micro, norms, key)


def _order_for_micro_batches(schedule: UpdateSchedule, mb: dict) -> dict:
    """A minibatch's rows with signal first (whole micro-batches can skip), each part by length (short
    buckets); as it is when nothing would gain from it."""
    skip, by_length = schedule.skip_zero_signal, len(schedule.buckets) > 1
    if schedule.grad_accum_steps == 1 or not (skip or by_length):
        return mb
    rank = jnp.where(mb["signal"], 0, schedule.buckets[-1] + 1) if skip else jnp.zeros_like(mb["need"])
    order = jnp.argsort(rank + (mb["need"] if by_length else 0), stable=True)
    return jax.tree_util.tree_map(lambda x: x[order], mb)


def minibatch_grads(loss_fn: MicroLoss, schedule: UpdateSchedule, p, mb: dict, norms, key):
    """((loss, aux), grads) of one minibatch: its micro-batches' sums (`lax.scan` over grad_accum_steps)."""
    n_acc = schedule.grad_accum_steps
    mb = _order_for_micro_batches(schedule, mb)
    if n_acc == 1:
        return micro_grads(loss_fn, schedule, p, mb, norms, key)
    rows = mb["need"].shape[0] // n_acc
    micros = jax.tree_util.tree_map(lambda x: x.reshape((n_acc, rows) + x.shape[1:]), mb)

    def accumulate(acc, xs):
        micro, micro_key = xs
        out = micro_grads(loss_fn, schedule, p, micro, norms, micro_key)
        # Every micro-batch is normalised by the minibatch's totals: summing is the exact mean.
        return jax.tree_util.tree_map(jnp.add, acc, out), None

    first = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), micros)
    zeros = _zeros_of(loss_fn, schedule.buckets[0], p, first, norms, key)
    out, _ = jax.lax.scan(accumulate, zeros, (micros, jax.random.split(key, n_acc)))
    return out


def optimizer_step(optimizer: optax.GradientTransformation, p, o, grads, stepped: jax.Array):
    """One optax step, or none (params and state exactly as they were) where `stepped` is False.

    Returns (params, opt_state, learning rate applied or None when the optimizer does not inject it; 0
    when no step was taken)."""
    updates, new_o = optimizer.update(grads, o, p)
    new_p = optax.apply_updates(p, updates)
    p, o = jax.tree_util.tree_map(lambda new, old: jnp.where(stepped, new, old), (new_p, new_o), (p, o))
    rate = applied_learning_rate(new_o)
    if rate is not None:
        rate = jnp.where(stepped, jnp.asarray(rate, jnp.float32), 0.0)
    return p, o, rate


def minibatch_update(loss_fn: MicroLoss, optimizer: optax.GradientTransformation, schedule: UpdateSchedule,
                     params, opt_state, data: dict, key: jax.Array,
                     normalisers: Callable[[dict], Any] | None = None):
    """passes x num_minibatches optimizer steps of `loss_fn` over `data` (see the module docstring).

    Returns (params, opt_state, steps): steps holds arrays [passes, num_minibatches], one entry per
    minibatch: loss (the sum of its micro-batches'), grad_norm (the global norm before the optimizer's
    clipping), optimizer_step (1.0 taken, 0.0 not: no row had signal), learning_rate (the rate applied,
    0 when no step; only when the optimizer injects it, as `optim.make_optimizer` does) and each aux
    entry of `loss_fn` summed over the micro-batches.
    """
    batch = data["need"].shape[0]
    n_mb = schedule.num_minibatches
    mb_rows = batch // n_mb
    if batch % (n_mb * schedule.grad_accum_steps):
        raise ValueError(f"batch {batch} is not a multiple of num_minibatches * grad_accum_steps = "
                         f"{n_mb} * {schedule.grad_accum_steps}")

    def minibatch_step(carry, xs):
        p, o = carry
        mb, mb_key = xs
        norms = normalisers(mb) if normalisers is not None else ()
        (loss, aux), grads = minibatch_grads(loss_fn, schedule, p, mb, norms, mb_key)
        stepped = jnp.any(mb["signal"])
        p, o, rate = optimizer_step(optimizer, p, o, grads, stepped)
        step = {**aux, "loss": loss, "grad_norm": global_norm(grads), "optimizer_step": stepped.astype(jnp.float32)}
        if rate is not None:
            step["learning_rate"] = rate
        return (p, o), step

    def one_pass(carry, pass_key):
        shuffled = data
        if schedule.shuffle:
            order = jax.random.permutation(pass_key, batch)
            shuffled = jax.tree_util.tree_map(lambda x: x[order], data)
        minibatches = jax.tree_util.tree_map(lambda x: x.reshape((n_mb, mb_rows) + x.shape[1:]), shuffled)
        keys = jax.random.split(jax.random.fold_in(pass_key, 1), n_mb)
        return jax.lax.scan(minibatch_step, carry, (minibatches, keys))

    (params, opt_state), steps = jax.lax.scan(one_pass, (params, opt_state), jax.random.split(key, schedule.passes))
    return params, opt_state, steps
