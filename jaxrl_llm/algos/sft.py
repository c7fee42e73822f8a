"""Supervised fine-tuning on whole games: chat tokenization with assistant-only loss masks, the loss, the step.

Tokenization (`tokenize_sft`, host). Each row (prompt + completion messages, see `jaxrl_llm.data.sft_data`) is rendered
with the tokenizer's own chat template and tokenized once, exactly as `tokenizer.apply_chat_template(messages,
tokenize=True)` does. The loss mask is NOT taken from `return_assistant_tokens_mask` (ChatML templates such as
LFM2's carry no generation markers); it is computed by locating each assistant turn in the rendered text: the turn
starts where `apply_chat_template(messages[:i], add_generation_prompt=True)` ends and runs through the end-of-turn
token (`tokenizer.eos_token`, `<|im_end|>`). A token is an assistant token when its character offset falls in such
a span, so the mask is 1 exactly on every reply's tokens and its `<|im_end|>`, 0 on system / user / template
tokens (`<|im_start|>assistant\\n` included) and on padding. A template whose shorter renderings are not prefixes
of the whole (one that rewrites past turns) is rejected with a ValueError.

Loss (`sft_loss`). Next-token cross-entropy with the mask aligned to TARGET positions: the logits at t - 1 predict
token t and count where loss_mask[t] = 1; the mean is over masked tokens of the whole batch.

Training (`make_sft_step`, `train_sft`). One jitted step (params and optimizer state donated) and a host loop over
shuffled batches (as many epochs as `steps` needs) with `make_optimizer(OptimConfig)`.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Annotated, Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl_llm.algos.optim import OptimConfig, global_norm, learning_rate_schedule, make_optimizer
from jaxrl_llm.checks import ConfigError, EnvBound, check_choice, check_int
from jaxrl_llm.data import sft_data
from models import lora


def _default_optim() -> OptimConfig:
    return OptimConfig(learning_rate=1e-5, warmup_steps=0, schedule="cosine")


@dataclasses.dataclass(frozen=True)
class SftConfig:
    """SFT warm-up (the `[sft]` table; steps 0 skips it). Defaults: the reference run's 30 steps of batch 32.

    steps / batch_size / seq_len: the training loop and the token buffer of a conversation (longer ones are
    truncated, or dropped with overflow="drop", with a counted warning). optim: the optimizer (its
    total_steps defaults to `steps`). teacher: the env's demonstrations (`env.Teacher`, the `[sft.teacher]`
    table; see the env). dataset: train on this prompt / completion data set instead (a `save_to_disk`
    folder, a .jsonl / .parquet file), None makes the teacher's rows. check_every: every that many steps
    (0: never) a teacher-forced greedy check on the env's check rows (`env.check_rows(teacher)`; logged as
    check_exact); stop_when_exact: end SFT at the first exact check (`steps` is then the most it runs).
    """

    steps: int = 30
    batch_size: int = 32
    seq_len: int = 700
    overflow: str = "truncate"
    optim: OptimConfig = dataclasses.field(default_factory=_default_optim)
    teacher: Annotated[Any, EnvBound("Teacher")] = None
    dataset: str | None = None
    check_every: int = 0
    stop_when_exact: bool = False

    def __post_init__(self) -> None:
        check_int(self, "steps", 0)
        check_int(self, "batch_size", 1)
        check_int(self, "seq_len", 16)
        check_choice(self, "overflow", ("truncate", "drop"))
        check_int(self, "check_every", 0)
        if not isinstance(self.optim, OptimConfig):
            raise ConfigError(f"must be an OptimConfig, got {type(self.optim).__name__}", ("optim",), "SftConfig")
        if self.stop_when_exact and not self.check_every:
            raise ConfigError("needs check_every > 0", ("stop_when_exact",), "SftConfig")


# ---------------------------------------------------------------------------------------------------------
# Tokenization with assistant-only masks
# ---------------------------------------------------------------------------------------------------------


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """(rendered text, [(start, end) character spans]) of every assistant reply + its end-of-turn token.

    ValueError when the chat template is not prefix-stable or a conversation starts with an assistant turn."""
    full = _render(tokenizer, messages)
    eos = tokenizer.eos_token
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise ValueError("a conversation must not start with an assistant message")
        before = _render(tokenizer, messages[:i], add_generation_prompt=True)
        through = _render(tokenizer, messages[: i + 1])
        if not (full.startswith(before) and full.startswith(through) and len(through) > len(before)):
            raise ValueError(
                "the chat template is not prefix-stable (rendering the first turns is not a prefix of the whole "
                f"conversation at message {i}); cannot locate assistant turns")
        end = through.rfind(eos) if eos else -1
        end = end + len(eos) if end >= len(before) else len(through.rstrip())
        spans.append((len(before), end))
    return full, spans


def _conversation(row: Any) -> list[dict]:
    if "prompt" in row and "completion" in row:
        return sft_data.conversation(row)
    if "messages" in row:
        return [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
    raise ValueError(f"row has neither prompt/completion nor messages (keys: {sorted(row)})")


def tokenize_sft(tokenizer, rows: Iterable[dict], seq_len: int, *, overflow: str = "truncate") -> dict[str, np.ndarray]:
    """Rows -> {"tokens": int32[N, seq_len], "loss_mask": float32[N, seq_len], "lengths": int32[N]}.

    tokens: the chat template's tokens, right-padded with the pad id; loss_mask 1 exactly on assistant reply tokens
    and each reply's end-of-turn token. Conversations longer than seq_len are truncated (overflow="truncate") or
    dropped ("drop"); either way a warning counts them."""
    if overflow not in ("truncate", "drop"):
        raise ValueError(f"overflow must be 'truncate' or 'drop', got {overflow!r}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 2:
        raise ValueError(f"seq_len must be an int >= 2, got {seq_len!r}")
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id
    texts, all_spans = [], []
    for row in rows:
        text, spans = assistant_spans(tokenizer, _conversation(row))
        texts.append(text)
        all_spans.append(spans)
    token_rows, mask_rows = [], []
    if texts:
        encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        for ids, offsets, spans in zip(encoded["input_ids"], encoded["offset_mapping"], all_spans):
            starts = np.array([o[0] for o in offsets], np.int64)
            mask = np.zeros(len(ids), np.float32)
            for s, e in spans:
                mask[(starts >= s) & (starts < e)] = 1.0
            token_rows.append(ids)
            mask_rows.append(mask)
    too_long = [i for i, ids in enumerate(token_rows) if len(ids) > seq_len]
    if too_long:
        longest = max(len(token_rows[i]) for i in too_long)
        action = "truncated to" if overflow == "truncate" else "dropped; longer than"
        warnings.warn(f"tokenize_sft: {len(too_long)} of {len(token_rows)} conversations {action} seq_len={seq_len} "
                      f"tokens (longest {longest})", stacklevel=2)
        if overflow == "drop":
            keep = sorted(set(range(len(token_rows))) - set(too_long))
            token_rows = [token_rows[i] for i in keep]
            mask_rows = [mask_rows[i] for i in keep]
    n = len(token_rows)
    tokens = np.full((n, seq_len), pad_id, np.int32)
    loss_mask = np.zeros((n, seq_len), np.float32)
    lengths = np.zeros((n,), np.int32)
    for i, (ids, mask) in enumerate(zip(token_rows, mask_rows)):
        k = min(len(ids), seq_len)
        tokens[i, :k] = ids[:k]
        loss_mask[i, :k] = mask[:k]
        lengths[i] = k
    return {"tokens": tokens, "loss_mask": loss_mask, "lengths": lengths}


# ---------------------------------------------------------------------------------------------------------
# Loss and step
# ---------------------------------------------------------------------------------------------------------


def sft_loss(logits: jax.Array, tokens: jax.Array, loss_mask: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """logits f32[B, T, V], tokens int32[B, T], loss_mask f32[B, T] -> (loss f32[], {accuracy, tokens}).

    Next-token cross-entropy: logits[:, t-1] predict tokens[:, t], counted where loss_mask[:, t] = 1 (the mask
    sits on TARGET positions); mean over the counted tokens (0 when there are none)."""
    logits = logits[:, :-1].astype(jnp.float32)
    targets = tokens[:, 1:]
    mask = loss_mask[:, 1:].astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    count = mask.sum()
    denom = jnp.maximum(count, 1.0)
    loss = (ce * mask).sum() / denom
    accuracy = ((jnp.argmax(logits, -1) == targets) * mask).sum() / denom
    return loss, {"accuracy": accuracy, "tokens": count}


def make_sft_step(module, optimizer: optax.GradientTransformation) -> Callable:
    """-> jitted step(params, opt_state, tokens int32[B, T], loss_mask f32[B, T], frozen=None, dropout_key=None)
    -> (params, opt_state, metrics).

    metrics: loss, accuracy, grad_norm (before clipping), tokens (masked targets in the batch); params and
    opt_state are donated. `module.apply({"params": p}, tokens)` must return (logits[B, T, V], _).
    frozen: None, or the frozen base of a LoRA policy (`models.lora`): params are then its adapters, the
    model applies `lora.join(frozen, params, dropout_key)` and only the adapters are trained."""

    def loss_fn(params, tokens, loss_mask, frozen, dropout_key):
        policy = params if frozen is None else lora.join(frozen, params, dropout_key)
        logits, _ = module.apply({"params": policy}, tokens)
        return sft_loss(logits, tokens, loss_mask)

    def step(params, opt_state, tokens, loss_mask, frozen=None, dropout_key=None):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens, loss_mask, frozen,
                                                                       dropout_key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = {"loss": loss, "accuracy": aux["accuracy"], "grad_norm": global_norm(grads),
                   "tokens": aux["tokens"]}
        return params, opt_state, metrics

    return jax.jit(step, donate_argnums=(0, 1))


def teacher_forced_check(module, params, data: dict[str, np.ndarray], batch_size: int = 64) -> dict[str, Any]:
    """How exactly a model reproduces a set of conversations, teacher-forced, greedy.

    data: `tokenize_sft`'s arrays (N rows). Returns {"token_accuracy": float over the masked tokens,
    "exact": fraction of rows whose every masked token is the argmax, "exact_rows": bool[N],
    "wrong_rows": [indices]}. On an env's check rows
    (`env.check_rows`: for a deterministic teacher, every game it can meet) exact = 1.0 means that greedy
    decoding plays exactly like the teacher against every opponent."""

    @jax.jit
    def check(params, tokens, loss_mask):
        logits, _ = module.apply({"params": params}, tokens)
        mask = loss_mask[:, 1:] > 0
        hit = jnp.argmax(logits[:, :-1], -1) == tokens[:, 1:]
        return (hit & mask).sum(), mask.sum(), (hit | ~mask).all(-1)

    tokens, loss_mask = data["tokens"], data["loss_mask"]
    n = tokens.shape[0]
    hits = total = 0
    exact = np.zeros(n, bool)
    for start in range(0, n, batch_size):
        stop = min(start + batch_size, n)
        pad = batch_size - (stop - start)  # one compiled shape: pad the last batch with masked-out rows
        t = np.concatenate([tokens[start:stop], np.zeros((pad, tokens.shape[1]), tokens.dtype)])
        m = np.concatenate([loss_mask[start:stop], np.zeros((pad, tokens.shape[1]), loss_mask.dtype)])
        h, c, e = jax.device_get(check(params, jnp.asarray(t), jnp.asarray(m)))
        hits, total = hits + int(h), total + int(c)
        exact[start:stop] = e[: stop - start]
    return {"token_accuracy": hits / max(total, 1), "exact": float(exact.mean()) if n else 0.0,
            "exact_rows": exact, "wrong_rows": [int(i) for i in np.flatnonzero(~exact)]}


def check_group_exact(rows, exact_rows) -> dict[str, float]:
    """{"check_exact_<group>": exact rate} for the check rows whose `info.check_group` names a group
    (e.g. an arithmetic level); {} when no row names one or the rows and results do not line up."""
    groups = [str((row.get("info") or {}).get("check_group") or "") if isinstance(row, dict) else "" for row in rows]
    if len(groups) != len(exact_rows) or not any(groups):
        return {}
    exact_rows = np.asarray(exact_rows, bool)
    names = np.asarray(groups)
    return {f"check_exact_{g}": float(exact_rows[names == g].mean()) for g in dict.fromkeys(groups) if g}


def _batch_indices(key: jax.Array, num_rows: int, batch_size: int, steps: int) -> np.ndarray:
    """int[steps, batch_size]: consecutive slices of a stream of per-epoch permutations (epoch e: fold_in(key, e))."""
    needed = steps * batch_size
    epochs = math.ceil(needed / num_rows)
    stream = np.concatenate([np.asarray(jax.random.permutation(jax.random.fold_in(key, e), num_rows))
                             for e in range(epochs)])
    return stream[:needed].reshape(steps, batch_size)


def train_sft(module, params, tokenizer, dataset, config: SftConfig, key: jax.Array,
              callback: Callable[[int, dict], None] | None = None, check_rows=None,
              frozen=None) -> tuple[Any, list[dict]]:
    """SFT for `config.steps` steps -> (params, history: one dict of floats per step).

    dataset: rows with prompt/completion (a `datasets.Dataset` or a list), tokenized with `tokenize_sft`
    at config.seq_len; batches of config.batch_size are drawn from shuffled epochs (key). The caller's params
    are copied first (the step donates its inputs). callback(step, metrics) runs after every step; metrics hold
    loss, accuracy, grad_norm, tokens, learning_rate, epoch. With check_rows and config.check_every > 0,
    every check_every steps (and after the last) `teacher_forced_check` runs on those rows and adds
    check_exact and check_token_accuracy to that step's metrics; config.stop_when_exact ends training at
    the first check with every row exact. Check rows whose `info` names a `check_group` also give
    check_exact_<group>, the exact rate of that group's rows (e.g. one per arithmetic level).
    frozen: None, or the frozen base of a LoRA policy: params are then its adapters (trained and
    returned alone; dropout keys from `key`'s second split, the batch order is unchanged)."""
    if not isinstance(config, SftConfig):
        raise ValueError(f"config must be an SftConfig, got {type(config).__name__}")
    if config.steps < 1:
        raise ValueError(f"train_sft needs config.steps >= 1 (got {config.steps}); steps = 0 skips SFT")
    data = tokenize_sft(tokenizer, dataset, config.seq_len, overflow=config.overflow)
    num_rows = data["tokens"].shape[0]
    if num_rows == 0:
        raise ValueError("train_sft: the dataset holds no usable conversation")
    optim = config.optim.for_steps(config.steps)
    optimizer = make_optimizer(optim)
    schedule = learning_rate_schedule(optim)
    params = jax.tree.map(jnp.array, params)  # a private copy: the step donates it
    opt_state = optimizer.init(params)
    step_fn = make_sft_step(module, optimizer)
    batches = _batch_indices(key, num_rows, config.batch_size, config.steps)
    check_every, stop_when_exact = config.check_every, config.stop_when_exact
    check_data = None
    if check_rows is not None and check_every > 0:
        check_data = tokenize_sft(tokenizer, check_rows, config.seq_len, overflow=config.overflow)
    drop_root = jax.random.split(key)[1] if frozen is not None else None
    history = []
    for step in range(config.steps):
        idx = batches[step]
        drop_key = None if frozen is None else jax.random.fold_in(drop_root, step)
        params, opt_state, metrics = step_fn(params, opt_state, jnp.asarray(data["tokens"][idx]),
                                             jnp.asarray(data["loss_mask"][idx]), frozen, drop_key)
        record = {k: float(v) for k, v in jax.device_get(metrics).items()}
        record["learning_rate"] = float(schedule(step))
        record["epoch"] = (step + 1) * config.batch_size / num_rows
        exact = False
        if check_data is not None and ((step + 1) % check_every == 0 or step + 1 == config.steps):
            result = teacher_forced_check(module, params if frozen is None else lora.join(frozen, params),
                                          check_data)
            record["check_exact"], record["check_token_accuracy"] = result["exact"], result["token_accuracy"]
            record.update(check_group_exact(check_rows, result["exact_rows"]))
            exact = result["exact"] == 1.0
        history.append(record)
        if callback is not None:
            callback(step, record)
        if stop_when_exact and exact:
            break
    return params, history
