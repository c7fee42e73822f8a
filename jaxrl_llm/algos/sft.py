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

Decision tokens (issue 30). Given the env's reply grammar, `tokenize_sft` also marks the DECISION tokens: the
tokens of each reply's grammar content (the first `<tag>\\s*(.*?)\\s*</tag>`, the move / the answer), located in
the rendered text by character offsets as the assistant mask is. The loss then splits into `decision_loss` (those
tokens) and `format_loss` (the other assistant tokens), and `decision_weight` can weigh the decision tokens up.
Where the rows say which choices were legal (the teacher knows the board: `info["legal_choices"]`, one list of
legal choice indices per assistant reply, for a "cell" grammar), every decision token also carries its legal
choices, and the metrics add `decision_loss_floor` (ln #legal: the loss of a uniform pick among the legal
choices, averaged like the loss) and `illegal_prob` (the probability the model puts on the illegal choices'
tokens, `choice_token_ids`). `decision_eval` measures the same on held-out rows.

Training (`make_sft_step`): one jitted step (params and optimizer state donated). The host loop over shuffled
batches, `train_sft`, is `jaxrl_llm.train.sft_loop.train_sft` (still importable from here).
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Annotated, Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl_base.moved import moved_names
from jaxrl_llm.algos.optim import OptimConfig, global_norm
from jaxrl_llm.checks import ConfigError, EnvBound, check_choice, check_float, check_int
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
    decision_weight: the loss weight of the decision tokens (the reply grammar's content; 1: a plain mean
    over the assistant tokens; w: those tokens count w times, the mean still divides by the token count).
    legal_targets: at a decision token whose legal choices the row gives, train toward the uniform distribution
    over those choices (cross-entropy -mean over legal c of log p(c): the expectation of a uniformly random legal
    reply, without its sampling noise) instead of the reply's own token; the logged losses stay those of the
    replies' tokens. Needs rows with `info["legal_choices"]` and a "cell" grammar.
    eval_rows: at the end of SFT, the decision metrics on that many held-out rows of the teacher (drawn with
    their own key; 0: none), printed and saved to `<output_dir>/sft_eval.json`.
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
    decision_weight: float = 1.0
    legal_targets: bool = False
    eval_rows: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.legal_targets, bool):
            raise ConfigError(f"must be true or false, got {self.legal_targets!r}", ("legal_targets",), "SftConfig")
        check_float(self, "decision_weight", low=0.0, low_open=True)
        check_int(self, "eval_rows", 0)
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


def content_span(grammar: Any, text: str, start: int, end: int) -> tuple[int, int] | None:
    """(start, end) character span of the reply grammar's content in text[start:end] (one assistant reply):
    the group of the first `<tag>\\s*(.*?)\\s*</tag>` (DOTALL, Python `re`, as `ReplyGrammar` reads a reply),
    or None when the reply has no such pair or its content is empty."""
    tag = re.escape(grammar.tag)
    found = re.compile(rf"<{tag}>\s*(.*?)\s*</{tag}>", re.DOTALL).search(text, start, end)
    if found is None or found.end(1) <= found.start(1):
        return None
    return found.start(1), found.end(1)


def choice_token_ids(tokenizer, grammar: Any) -> np.ndarray | None:
    """int32[C]: for a "cell" grammar (C = num_cells), the token id that spells choice c's content as ONE token
    inside `<tag>c</tag>`; None for other grammars. ValueError naming the choice if it is not a single token."""
    if grammar is None or grammar.content != "cell":
        return None
    ids = np.zeros(grammar.num_cells, np.int32)
    for c in range(grammar.num_cells):
        text = f"<{grammar.tag}>{c}</{grammar.tag}>"
        span = content_span(grammar, text, 0, len(text))
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        inside = [i for i, (a, b) in zip(enc["input_ids"], enc["offset_mapping"]) if span[0] <= a < span[1]]
        if len(inside) != 1 or enc["offset_mapping"][enc["input_ids"].index(inside[0])] != span:
            raise ValueError(f"choice {c} of the <{grammar.tag}> grammar is not one token with this tokenizer "
                             f"({len(inside)} tokens): the decision metrics need one token per choice")
        ids[c] = inside[0]
    return ids


def _row_info(row: Any) -> dict:
    info = row.get("info") if isinstance(row, dict) or hasattr(row, "get") else None
    return info if isinstance(info, dict) else {}


def tokenize_sft(tokenizer, rows: Iterable[dict], seq_len: int, *, overflow: str = "truncate",
                 grammar: Any = None) -> dict[str, np.ndarray]:
    """Rows -> {"tokens": int32[N, seq_len], "loss_mask": float32[N, seq_len], "lengths": int32[N]}, and with
    a reply grammar (`envs.core.ReplyGrammar`) also "decision_mask": float32[N, seq_len] and, for a "cell"
    grammar, "choice_legal": bool[N, seq_len, C].

    tokens: the chat template's tokens, right-padded with the pad id; loss_mask 1 exactly on assistant reply tokens
    and each reply's end-of-turn token. decision_mask: 1 on the assistant tokens whose first character lies in a
    reply's grammar content (`content_span`). choice_legal[n, t]: at a decision token, the legal choices of its
    reply from the row's `info["legal_choices"]` (one list of choice indices per assistant reply); all False
    where the row does not say. Conversations longer than seq_len are truncated (overflow="truncate") or
    dropped ("drop"); either way a warning counts them."""
    if overflow not in ("truncate", "drop"):
        raise ValueError(f"overflow must be 'truncate' or 'drop', got {overflow!r}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 2:
        raise ValueError(f"seq_len must be an int >= 2, got {seq_len!r}")
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id
    num_choices = grammar.num_cells if grammar is not None and grammar.content == "cell" else 0
    texts, all_spans, all_legal = [], [], []
    for row in rows:
        text, spans = assistant_spans(tokenizer, _conversation(row))
        texts.append(text)
        all_spans.append(spans)
        all_legal.append(_row_info(row).get("legal_choices") if num_choices else None)
    token_rows, mask_rows, decision_rows, legal_rows = [], [], [], []
    if texts:
        encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        for text, ids, offsets, spans, legal in zip(texts, encoded["input_ids"], encoded["offset_mapping"],
                                                    all_spans, all_legal):
            starts = np.array([o[0] for o in offsets], np.int64)
            mask = np.zeros(len(ids), np.float32)
            decision = np.zeros(len(ids), np.float32)
            choices = np.zeros((len(ids), num_choices), bool)
            for j, (s, e) in enumerate(spans):
                mask[(starts >= s) & (starts < e)] = 1.0
                content = content_span(grammar, text, s, e) if grammar is not None else None
                if content is None:
                    continue
                at = (starts >= content[0]) & (starts < content[1])
                decision[at] = 1.0
                if legal is not None and j < len(legal) and legal[j] is not None:
                    cells = np.asarray(list(legal[j]), np.int64)
                    if cells.size and (cells.min() < 0 or cells.max() >= num_choices):
                        raise ValueError(f"info.legal_choices {list(legal[j])} outside 0..{num_choices - 1}")
                    choices[np.ix_(np.flatnonzero(at), cells)] = True
            token_rows.append(ids)
            mask_rows.append(mask)
            decision_rows.append(decision)
            legal_rows.append(choices)
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
            decision_rows = [decision_rows[i] for i in keep]
            legal_rows = [legal_rows[i] for i in keep]
    n = len(token_rows)
    tokens = np.full((n, seq_len), pad_id, np.int32)
    loss_mask = np.zeros((n, seq_len), np.float32)
    decision_mask = np.zeros((n, seq_len), np.float32)
    choice_legal = np.zeros((n, seq_len, num_choices), bool)
    lengths = np.zeros((n,), np.int32)
    for i, (ids, mask) in enumerate(zip(token_rows, mask_rows)):
        k = min(len(ids), seq_len)
        tokens[i, :k] = ids[:k]
        loss_mask[i, :k] = mask[:k]
        decision_mask[i, :k] = decision_rows[i][:k]
        choice_legal[i, :k] = legal_rows[i][:k]
        lengths[i] = k
    out = {"tokens": tokens, "loss_mask": loss_mask, "lengths": lengths}
    if grammar is not None:
        out["decision_mask"] = decision_mask
        if num_choices:
            out["choice_legal"] = choice_legal
    return out


# ---------------------------------------------------------------------------------------------------------
# Loss and step
# ---------------------------------------------------------------------------------------------------------


DECISION_SUMS = ("decision_ce", "decision_tokens", "format_ce", "format_tokens", "decision_hits", "floor",
                 "illegal_prob", "choice_entropy", "legal_tokens")


def decision_sums(logits: jax.Array, targets: jax.Array, mask: jax.Array, decision: jax.Array,
                  ce: jax.Array, choice_legal: jax.Array | None = None,
                  choice_tokens: jax.Array | None = None) -> dict[str, jax.Array]:
    """Sums over a batch of the decision metrics, at TARGET-aligned positions (already shifted).

    logits f32[B, T, V] (the logits predicting each target), targets int32[B, T], mask / decision f32[B, T]
    (assistant tokens / decision tokens among them), ce f32[B, T] (per-token cross-entropy), choice_legal
    bool[B, T, C] and choice_tokens int32[C] (optional, a "cell" grammar). Returns f32[] sums (`DECISION_SUMS`):
    decision_ce / decision_tokens / decision_hits (argmax = target) over the decision tokens, format_ce /
    format_tokens over the other assistant tokens; over the decision tokens with at least one legal choice
    (legal_tokens): floor (ln #legal), illegal_prob (softmax mass on the illegal choices' tokens) and
    choice_entropy (the entropy of the softmax renormalized over the C choice tokens)."""
    decision = decision * mask
    other = mask - decision
    sums = {"decision_ce": (ce * decision).sum(), "decision_tokens": decision.sum(),
            "format_ce": (ce * other).sum(), "format_tokens": other.sum(),
            "decision_hits": ((jnp.argmax(logits, -1) == targets) * decision).sum()}
    zero = jnp.zeros((), jnp.float32)
    sums.update(floor=zero, illegal_prob=zero, choice_entropy=zero, legal_tokens=zero)
    if choice_legal is not None and choice_tokens is not None and choice_legal.shape[-1]:
        logits = jax.lax.stop_gradient(logits)
        n_legal = choice_legal.sum(-1).astype(jnp.float32)
        counted = decision * (n_legal > 0)
        log_z = jax.nn.logsumexp(logits, axis=-1)
        logp = jnp.take(logits, jnp.asarray(choice_tokens), axis=-1) - log_z[..., None]  # [B, T, C]
        probs = jnp.exp(logp)
        illegal = jnp.where(choice_legal, 0.0, probs).sum(-1)
        logq = jax.nn.log_softmax(logp, axis=-1)
        entropy = -(jnp.exp(logq) * logq).sum(-1)
        sums.update(floor=(jnp.log(jnp.maximum(n_legal, 1.0)) * counted).sum(), illegal_prob=(illegal * counted).sum(),
                    choice_entropy=(entropy * counted).sum(), legal_tokens=counted.sum())
    return sums


def decision_means(sums: dict[str, Any]) -> dict[str, Any]:
    """`decision_sums` (of one batch or added over many) -> the logged means: decision_loss, format_loss,
    decision_accuracy, decision_tokens; and where some decision token knew its legal choices,
    decision_loss_floor, illegal_prob, choice_entropy."""
    def mean(num, den):
        return sums[num] / jnp.maximum(sums[den], 1.0)

    out = {"decision_loss": mean("decision_ce", "decision_tokens"), "format_loss": mean("format_ce", "format_tokens"),
           "decision_accuracy": mean("decision_hits", "decision_tokens"), "decision_tokens": sums["decision_tokens"]}
    out.update(decision_loss_floor=mean("floor", "legal_tokens"), illegal_prob=mean("illegal_prob", "legal_tokens"),
               choice_entropy=mean("choice_entropy", "legal_tokens"))
    return out


def sft_loss(logits: jax.Array, tokens: jax.Array, loss_mask: jax.Array, decision_mask: jax.Array | None = None,
             choice_legal: jax.Array | None = None, choice_tokens: jax.Array | None = None,
             decision_weight: float = 1.0, legal_targets: bool = False) -> tuple[jax.Array, dict[str, jax.Array]]:
    """logits f32[B, T, V], tokens int32[B, T], loss_mask f32[B, T] -> (objective f32[], {loss, accuracy, tokens}).

    Next-token cross-entropy: logits[:, t-1] predict tokens[:, t], counted where loss_mask[:, t] = 1 (the mask
    sits on TARGET positions); loss: the mean over the counted tokens (0 when there are none). With
    decision_mask f32[B, T] (also on target positions) the metrics add `decision_means` (choice_legal
    bool[B, T, C] and choice_tokens int32[C] for the floor and illegal_prob), and the objective weighs the
    decision tokens by decision_weight: sum(ce * mask * (1 + (w - 1) * decision)) / count (= loss at w = 1).
    legal_targets: at decision tokens with legal choices the objective's ce is -mean_{c legal} log p(choice c)
    (the uniform legal distribution as the target); the metrics keep the replies' own tokens."""
    logits = logits[:, :-1].astype(jnp.float32)
    targets = tokens[:, 1:]
    mask = loss_mask[:, 1:].astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    count = mask.sum()
    denom = jnp.maximum(count, 1.0)
    loss = (ce * mask).sum() / denom
    accuracy = ((jnp.argmax(logits, -1) == targets) * mask).sum() / denom
    metrics = {"loss": loss, "accuracy": accuracy, "tokens": count}
    objective = loss
    if decision_mask is not None:
        decision = decision_mask[:, 1:].astype(jnp.float32)
        legal = None if choice_legal is None else choice_legal[:, 1:]
        metrics.update(decision_means(decision_sums(logits, targets, mask, decision, ce, legal, choice_tokens)))
        train_ce = ce
        if legal_targets and legal is not None and choice_tokens is not None:
            n_legal = legal.sum(-1).astype(jnp.float32)
            logp = jnp.take(logits, jnp.asarray(choice_tokens), axis=-1) - jax.nn.logsumexp(logits, axis=-1)[..., None]
            soft = -jnp.where(legal, logp, 0.0).sum(-1) / jnp.maximum(n_legal, 1.0)
            train_ce = jnp.where((decision > 0) & (n_legal > 0), soft, ce)
        if decision_weight != 1.0 or train_ce is not ce:
            objective = (train_ce * mask * (1.0 + (decision_weight - 1.0) * decision)).sum() / denom
    return objective, metrics


def make_sft_step(module, optimizer: optax.GradientTransformation, choice_tokens: np.ndarray | None = None,
                  decision_weight: float = 1.0, legal_targets: bool = False) -> Callable:
    """-> jitted step(params, opt_state, tokens int32[B, T], loss_mask f32[B, T], frozen=None, dropout_key=None,
    decision_mask=None, choice_legal=None) -> (params, opt_state, metrics).

    metrics: loss, accuracy, grad_norm (before clipping), tokens (masked targets in the batch); with
    decision_mask f32[B, T] also `decision_means` (choice_legal bool[B, T, C] with the static choice_tokens
    int32[C] for decision_loss_floor / illegal_prob / choice_entropy), and the objective weighs the decision
    tokens by decision_weight and, with legal_targets, trains them toward the uniform legal choice (`sft_loss`).
    params and opt_state are donated. `module.apply({"params": p},
    tokens)` must return (logits[B, T, V], _). frozen: None, or the frozen base of a LoRA policy
    (`models.lora`): params are then its adapters, the model applies `lora.join(frozen, params, dropout_key)`
    and only the adapters are trained."""
    choice_ids = None if choice_tokens is None else np.asarray(choice_tokens, np.int32)

    def loss_fn(params, tokens, loss_mask, frozen, dropout_key, decision_mask, choice_legal):
        policy = params if frozen is None else lora.join(frozen, params, dropout_key)
        logits, _ = module.apply({"params": policy}, tokens)
        return sft_loss(logits, tokens, loss_mask, decision_mask, choice_legal, choice_ids, decision_weight,
                        legal_targets)

    def step(params, opt_state, tokens, loss_mask, frozen=None, dropout_key=None, decision_mask=None,
             choice_legal=None):
        (_, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens, loss_mask, frozen,
                                                                    dropout_key, decision_mask, choice_legal)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = {**aux, "grad_norm": global_norm(grads)}
        return params, opt_state, metrics

    return jax.jit(step, donate_argnums=(0, 1))


def decision_eval(module, params, data: dict[str, np.ndarray], choice_tokens: np.ndarray | None = None,
                  batch_size: int = 64) -> dict[str, float]:
    """The decision metrics (`decision_means`, plus loss = the mean over all assistant tokens and `rows`) of a
    model, teacher-forced, on `tokenize_sft` arrays made with a grammar (e.g. held-out rows). Sums are added
    over batches of `batch_size` (the last padded with empty rows), so the means are exact over all rows."""
    if "decision_mask" not in data:
        raise ValueError("decision_eval needs tokenize_sft arrays made with a reply grammar (decision_mask)")
    choice_ids = None if choice_tokens is None else jnp.asarray(choice_tokens, jnp.int32)
    has_legal = "choice_legal" in data and choice_ids is not None

    @jax.jit
    def sums(params, tokens, loss_mask, decision_mask, choice_legal):
        logits, _ = module.apply({"params": params}, tokens)
        logits = logits[:, :-1].astype(jnp.float32)
        targets, mask = tokens[:, 1:], loss_mask[:, 1:]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        out = decision_sums(logits, targets, mask, decision_mask[:, 1:], ce,
                            None if choice_legal is None else choice_legal[:, 1:], choice_ids)
        return {**out, "ce": (ce * mask).sum(), "tokens": mask.sum()}

    n, length = data["tokens"].shape
    total: dict[str, float] = {}
    for start in range(0, n, batch_size):
        stop = min(start + batch_size, n)
        pad = batch_size - (stop - start)

        def batch(name):
            a = data[name][start:stop]
            return jnp.asarray(np.concatenate([a, np.zeros((pad,) + a.shape[1:], a.dtype)]))

        got = jax.device_get(sums(params, batch("tokens"), batch("loss_mask"), batch("decision_mask"),
                                  batch("choice_legal") if has_legal else None))
        for k, v in got.items():
            total[k] = total.get(k, 0.0) + float(v)
    out = {k: float(v) for k, v in decision_means(total).items()}
    if not has_legal or total.get("legal_tokens", 0.0) == 0:
        for k in ("decision_loss_floor", "illegal_prob", "choice_entropy"):
            out.pop(k)
    out.update(loss=total["ce"] / max(total["tokens"], 1.0), rows=float(n))
    return out


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


# `train_sft`, the SFT training loop, lives in `jaxrl_llm.train.sft_loop` (above this module); this old path still
# names it, resolved on first use.
__getattr__ = moved_names(__name__, {"train_sft": "jaxrl_llm.train.sft_loop"})
