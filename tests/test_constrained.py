"""Constrained replies: the env's reply grammar drives decoding (issue 30, part 5).

Checked against independent host-side computations: the template's token ids against tokenizing whole
reply texts; constrained replies of random logits (many rows, every content kind the repo's envs use)
against `tests/reference_grammar` (Python's `re`); the content tokens' log-probs against a log-softmax
restricted by hand; the decision mask against a byte-level search of the decoded replies; and, with a tiny
random LFM2 in whole rollouts, the trainer-side recomputation (`restrict_logits`) against the sampler.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import envs
import reference_grammar as rg
from envs.core import ReplyGrammar
from jaxrl_llm import rollout as ro
from jaxrl_llm import text
from jaxrl_llm.config import loads_config
from jaxrl_llm.generate import SamplingConfig, decode, restrict_logits
from models.family import cached_call
from jaxrl_llm.text import grammar as gm
from jaxrl_llm.text.tables import choice_token_ids, reply_texts
from models.lfm2 import PRESETS, Lfm2ForCausalLM, init_cache

TTT = envs.make("tictactoe", prompt="compact")
C4 = envs.make("connect_four")
ARITH = envs.make("arithmetic")


@pytest.fixture(scope="module")
def tok():
    return text.load_tokenizer()


@pytest.fixture(scope="module")
def all_tables(tok):
    return {env.name: text.tables_for_env(tok, env) for env in (TTT, C4, ARITH)}


def _spec_tables(tok, grammar: ReplyGrammar):
    """The arithmetic env's messages with another reply grammar (for kinds and limits no env uses)."""
    p = ARITH.params
    return text.build_text_tables(tok, ARITH.message_spec(p), ARITH.system_prompt(p), name="custom", grammar=grammar)


# ---------------------------------------------------------------------------------------------------------
# The template on the host


def test_reply_texts_of_the_repo_envs():
    assert reply_texts(TTT.reply_grammar(TTT.params)) == ("<think></think>\n<move>", "</move>")
    assert reply_texts(C4.reply_grammar(C4.params)) == ("<think></think><move>", "</move>")
    assert reply_texts(ARITH.reply_grammar(ARITH.params)) == ("<answer>", "</answer>")
    # a format tag after the answer tag goes into the suffix
    g = ReplyGrammar("a", "cell", format_tags=("a", "why"), example_replies=("<a>1</a> <why>x</why>",))
    assert reply_texts(g) == ("<a>", "</a> <why></why>")


@pytest.mark.parametrize("name", ["tictactoe", "connect_four", "arithmetic"])
def test_template_ids_equal_tokenizing_whole_replies(tok, all_tables, name):
    tables = all_tables[name]
    env = {"tictactoe": TTT, "connect_four": C4, "arithmetic": ARITH}[name]
    grammar = env.reply_grammar(env.params)
    assert tables.reply_error == ""
    t = tables.reply_template
    prefix_text, suffix_text = reply_texts(grammar)
    prefix, suffix = [int(i) for i in t.prefix], [int(i) for i in t.suffix]
    assert suffix[-1] == tok.eos_token_id
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    if grammar.content == "cell":
        contents = [str(c) for c in range(grammar.num_cells)]
        np.testing.assert_array_equal(tables.choice_tokens, [enc(c)[0] for c in contents])
        assert all(len(enc(c)) == 1 for c in contents)
        assert t.sets.shape[0] == 1 and int(t.sets.sum()) == grammar.num_cells
    else:
        contents = ["0", "-4", "981", "-" + "9" * grammar.max_digits]
        assert tables.choice_tokens.shape == (0,)
    for c in contents:
        whole = enc(prefix_text + c + suffix_text + tok.eos_token)
        assert whole == prefix + enc(c) + suffix, c
        # the sampler writes one-character content tokens: with this tokenizer that is the tokenization
        assert enc(c) == [enc(ch)[0] for ch in c]


def test_choice_tokens_name_a_choice_that_is_not_one_token(tok):
    wide = ReplyGrammar("move", "cell", num_cells=12)
    with pytest.raises(ValueError, match=r"choice 10 \('10'\) is not one token"):
        choice_token_ids(tok, wide)
    tables = _spec_tables(tok, wide)  # the tables still build: unconstrained decoding does not need it
    assert tables.reply_template is None and "choice 10" in tables.reply_error
    with pytest.raises(ValueError, match="constrained replies are not available.*choice 10"):
        text.require_reply_template(tables)


def test_constrained_option_in_toml_and_its_check():
    config = loads_config("[sampling]\nconstrained = true\n[eval.sampling]\nconstrained = true\n")
    assert config.sampling.constrained and config.eval.sampling.constrained and config.eval.sampling.greedy
    assert not loads_config("").sampling.constrained
    # GRPO stages train on them (the update restricts the content tokens' logits as the sampler does)
    assert loads_config("[[grpo]]\nsteps = 1\n[grpo.sampling]\nconstrained = true\n").grpo[0].sampling.constrained
    assert loads_config("[sampling]\nconstrained = true\n[[grpo]]\nsteps = 1\n").grpo[0].sampling.constrained
    with pytest.raises(Exception, match="constrained"):
        SamplingConfig(constrained=1)


# ---------------------------------------------------------------------------------------------------------
# The decode loop with random logits


@functools.partial(jax.tree_util.register_dataclass, data_fields=["lengths"], meta_fields=["max_len"])
@dataclasses.dataclass(frozen=True)
class FakeCache:
    """A model cache that holds nothing but the lengths."""

    lengths: jax.Array
    max_len: int


EXTRA_VOCAB = 16  # the model's vocabulary is wider than the tokenizer's; ids past it are never allowed


def _random_model(tok, vocab: int):
    """A model_fn whose logits for row b after n cached tokens are 4 * N(0, 1) (key: seed, b, n), pushed
    towards the tokens that would break a reply (end of turn, "</", "<", "-", ">")."""
    bias = np.zeros(vocab, np.float32)
    for piece in ["</", "<", "-", ">"]:
        bias[tok.encode(piece, add_special_tokens=False)[0]] = 6.0
    bias[tok.eos_token_id] = 8.0
    bias = jnp.asarray(bias)

    def logits_at(seed, rows, n):
        def one(r, k):
            key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), r), k)
            return jax.random.normal(key, (vocab,)) * 4.0 + bias
        return jax.vmap(one)(rows, n)

    def model_fn(params, tokens, cache, num_valid):
        n = cache.lengths + num_valid
        return logits_at(params, jnp.arange(n.shape[0]), n)[:, None], FakeCache(n, cache.max_len)

    return model_fn, jax.jit(logits_at)


def _reply_text(tables, ids) -> bytes:
    table, lengths = np.asarray(tables.byte_table), np.asarray(tables.byte_lengths)
    return b"".join(bytes(table[i, : lengths[i]]) if 0 <= i < len(lengths) else b"" for i in ids)


ROWS = 128


def _decode_rows(tok, tables, config: SamplingConfig, seed: int = 0):
    vocab = len(tok) + EXTRA_VOCAB
    model_fn, logits_at = _random_model(tok, vocab)
    config = config.with_tokenizer((tok.eos_token_id,), tok.pad_token_id)
    prompt = jnp.asarray(np.random.default_rng(seed).integers(1, 6, ROWS), jnp.int32)
    rows = jnp.arange(ROWS)

    @jax.jit
    def run(key):
        cache = FakeCache(prompt, 4096)
        return decode(model_fn, config, seed, logits_at(seed, rows, prompt), cache, key, jnp.ones(ROWS, bool),
                      tables.reply_template)

    out = jax.device_get(run(jax.random.PRNGKey(seed + 1)))
    # logits_at(seed, b, prompt + j) are the logits that chose the token at step j of row b
    steps = config.max_new_tokens
    grid = np.asarray(logits_at(seed, jnp.repeat(rows, steps), (prompt[:, None] + jnp.arange(steps)).reshape(-1)))
    return out, grid.reshape(ROWS, steps, vocab)


def _restricted_logprob(logits, allowed_ids, token, config: SamplingConfig) -> float:
    z = np.asarray(logits, np.float64)[allowed_ids] / (1.0 if config.greedy else config.temperature)
    if config.top_k and not config.greedy:
        kth = np.sort(z)[::-1][min(config.top_k, len(z)) - 1]
        keep = z >= kth
        allowed_ids, z = np.asarray(allowed_ids)[keep], z[keep]
    z = z - z.max()
    logp = z - np.log(np.exp(z).sum())
    return float(logp[list(allowed_ids).index(token)])


CASES = [
    ("tictactoe", SamplingConfig(max_new_tokens=16, constrained=True)),
    ("tictactoe", SamplingConfig(max_new_tokens=12, constrained=True, temperature=0.7, top_k=3)),
    ("tictactoe", SamplingConfig(max_new_tokens=12, constrained=True, greedy=True)),
    ("connect_four", SamplingConfig(max_new_tokens=12, constrained=True)),
    ("arithmetic", SamplingConfig(max_new_tokens=24, constrained=True)),
    ("arithmetic", SamplingConfig(max_new_tokens=24, constrained=True, greedy=True)),
    ("int2", SamplingConfig(max_new_tokens=16, constrained=True)),  # at most 2 digits: the end is forced
    ("int2", SamplingConfig(max_new_tokens=12, constrained=True)),  # 5 + 1 + 6: room for one digit only
    ("text", SamplingConfig(max_new_tokens=20, constrained=True)),
]


@pytest.mark.parametrize("name,config", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_constrained_replies_of_random_logits_always_parse(tok, all_tables, name, config):
    if name in all_tables:
        tables = all_tables[name]
        env = {"tictactoe": TTT, "connect_four": C4, "arithmetic": ARITH}[name]
        grammar = env.reply_grammar(env.params)
    else:
        grammar = (ReplyGrammar("answer", "integer", max_digits=2) if name == "int2"
                   else ReplyGrammar("answer", "text"))
        tables = _spec_tables(tok, grammar)
    out, logits = _decode_rows(tok, tables, config)
    t = tables.reply_template
    prefix, suffix, sets = list(np.asarray(t.prefix)), list(np.asarray(t.suffix)), np.asarray(t.sets)
    digits = [tok.encode(str(d), add_special_tokens=False)[0] for d in range(10)]
    minus = tok.encode("-", add_special_tokens=False)[0]
    kinds = {"digit": 0, "minus": 0, "end_sampled": 0, "values": set()}
    for b in range(ROWS):
        n = int(out.lengths[b])
        ids = [int(i) for i in out.tokens[b, :n]]
        assert out.done[b] and not out.truncated[b]
        assert ids[: len(prefix)] == prefix and ids[n - len(suffix):] == suffix
        parsed = rg.parse_bytes(grammar, _reply_text(tables, ids[:-1]))
        assert parsed.found and parsed.format_ok, (b, _reply_text(tables, ids))
        assert parsed.valid or grammar.content == "text"
        kinds["values"].add(parsed.value)
        sampled, content, sets_b = out.sampled[b, :n], out.content[b, :n], out.choice_set[b, :n]
        assert not out.sampled[b, n:].any() and (out.choice_set[b, n:] == -1).all() and (out.logprobs[b, n:] == 0).all()
        # forced tokens: the prefix and the suffix (an integer's end may be sampled), log-prob 0, no set
        assert not sampled[: len(prefix)].any() and not sampled[n - len(suffix) + 1:].any()
        assert (out.logprobs[b, :n][~sampled] == 0).all() and (sets_b[~sampled] == -1).all()
        body = list(range(len(prefix), n - len(suffix) + 1))  # the content and the suffix's first token
        count, signed = 0, False
        for j in body:
            tok_j, remaining = ids[j], config.max_new_tokens - j
            if grammar.content == "cell":
                want_set = 0 if j < body[-1] else None
            elif grammar.content == "integer":
                if j == body[-1]:  # the end: sampled iff digits could still follow
                    want_set = 2 if (count < grammar.max_digits and remaining > len(suffix)) else None
                elif count == 0:
                    want_set = 1 if (signed or remaining <= len(suffix) + 1) else 0
                else:
                    want_set = 2
            else:
                want_set = 0 if (j < body[-1] or remaining > len(suffix)) else None
            if want_set is None:
                assert not sampled[j], (b, j)
                continue
            assert sampled[j] and sets_b[j] == want_set, (b, j, sets_b[j], want_set)
            allowed = np.nonzero(sets[want_set])[0]
            assert tok_j in allowed
            if grammar.content == "cell":
                np.testing.assert_array_equal(allowed, np.sort(np.asarray(tables.choice_tokens)))
            want = _restricted_logprob(logits[b, j], allowed, tok_j, config)
            got = float(out.logprobs[b, j])
            np.testing.assert_allclose(got, 0.0 if config.greedy else want, atol=2e-4)
            if config.greedy:
                assert tok_j == allowed[np.argmax(logits[b, j][allowed])]
            is_content = j < body[-1]
            assert content[j] == is_content
            if grammar.content == "integer" and is_content:
                signed |= tok_j == minus
                count += tok_j in digits
                kinds["minus" if tok_j == minus else "digit"] += 1
            kinds["end_sampled"] += not is_content
    # the model log-probs: the untempered log-softmax over the whole vocabulary, every token
    z = logits.astype(np.float64)
    full = z - z.max(-1, keepdims=True)
    full = full - np.log(np.exp(full).sum(-1, keepdims=True))
    at = np.take_along_axis(full, np.asarray(out.tokens)[..., None].clip(0), -1)[..., 0]
    written = np.arange(config.max_new_tokens)[None, :] < out.lengths[:, None]
    np.testing.assert_allclose(out.model_logprobs[written], at[written], atol=1e-4)
    if grammar.content == "integer" and not config.greedy:
        roomy = config.max_new_tokens > len(prefix) + 1 + len(suffix)
        assert (kinds["minus"] > 0) == roomy and kinds["digit"] > 0 and len(kinds["values"]) >= 10
    if grammar.content == "cell" and not config.greedy:
        assert len(kinds["values"]) == grammar.num_cells


def test_without_the_option_the_template_is_ignored_and_nothing_is_constrained(tok, all_tables):
    out, _ = _decode_rows(tok, all_tables["tictactoe"], SamplingConfig(max_new_tokens=8))
    written = np.arange(8)[None, :] < out.lengths[:, None]
    np.testing.assert_array_equal(out.sampled, written)
    assert not out.content.any() and (out.choice_set == -1).all()
    prefix = np.asarray(all_tables["tictactoe"].reply_template.prefix)
    assert (out.tokens[:, 0] != prefix[0]).mean() > 0.9  # the random logits, unconstrained


def test_constrained_needs_a_template_and_room(tok, all_tables):
    with pytest.raises(ValueError, match="reply template"):
        _decode_rows(tok, dataclasses.replace(all_tables["tictactoe"], reply_template=None),
                     SamplingConfig(max_new_tokens=16, constrained=True))
    with pytest.raises(ValueError, match="max_new_tokens >= 12"):
        _decode_rows(tok, all_tables["tictactoe"], SamplingConfig(max_new_tokens=11, constrained=True))


# ---------------------------------------------------------------------------------------------------------
# The decision mask (both modes) against a host-side search of the decoded replies


def _host_content_tokens(tables, grammar, ids) -> list[bool]:
    """Tokens overlapping the stripped content of the first `<tag>...</tag>`, found on the raw bytes."""
    pieces = [_reply_text(tables, [i]) for i in ids]
    data = b"".join(pieces)
    open_tag, close_tag = f"<{grammar.tag}>".encode(), f"</{grammar.tag}>".encode()
    a = data.find(open_tag)
    b = data.find(close_tag, a + len(open_tag)) if a >= 0 else -1
    if a < 0 or b < 0:
        return [False] * len(ids)
    begin = a + len(open_tag)
    content = data[begin:b].decode("utf-8", errors="replace")
    lead = len(content) - len(content.lstrip())
    trail = len(content) - len(content.rstrip())
    if not content.strip():
        return [False] * len(ids)
    start = begin + len(content[:lead].encode())
    end = b - len(content[len(content) - trail:].encode())
    ends = np.cumsum([len(p) for p in pieces])
    starts = ends - np.array([len(p) for p in pieces])
    return [bool(s < end and e > start and e > s) for s, e in zip(starts, ends)]


def _reply_spans(tables, tokens, length):
    """(start, end) of each reply in a conversation: after each generation prompt, up to its end of turn
    (excluded) or the end of the conversation."""
    gen = [int(i) for i in np.asarray(tables.piece_tokens)[int(tables.close_piece[0])][
        : int(tables.piece_lengths[int(tables.close_piece[0])])]]
    ids = [int(i) for i in tokens[:length]]
    spans = []
    for p in range(len(ids) - len(gen) + 1):
        if ids[p:p + len(gen)] == gen:
            s = e = p + len(gen)
            while e < len(ids) and ids[e] != tables.eos_id:
                e += 1
            spans.append((s, e))
    return spans


def _check_decision_mask(tables, grammar, traj) -> int:
    traj = jax.device_get(traj)
    checked = 0
    for b in range(traj.tokens.shape[0]):
        inside = np.zeros(traj.tokens.shape[1], bool)
        for s, e in _reply_spans(tables, traj.tokens[b], int(traj.length[b])):
            ids = [int(i) for i in traj.tokens[b, s:e]]
            want = _host_content_tokens(tables, grammar, ids)
            got = list(traj.decision_mask[b, s:e] > 0)
            assert got == want, (b, s, _reply_text(tables, ids))
            inside[s:e] = True
            checked += 1
        assert (traj.decision_mask[b][~inside] == 0).all()
    return checked


SCRIPTED = [
    ["<move>4</move>", "<think>x</think>\n<move> 7 \n</move>", "<move>\u2003 8\u00a0</move>", "<move></move>"],
    ["no tag at all", "<move>x y</move>", "<move>12</move> <move>3</move>", "<move>\u20005</move>"],
    ["<move>  \t </move>", "<move>3", "</move><move>0</move>", "<move><move>2</move>"],
]


def test_decision_mask_of_scripted_replies_equals_the_host_search(tok):
    env = envs.make("tictactoe", prompt="reference")
    tables = text.tables_for_env(tok, env)
    reply_tokens, reply_lengths = ro.script_replies(tok, SCRIPTED, 4, 24)
    policy = ro.scripted_policy(reply_tokens, reply_lengths, tables.eos_id)
    examples = env.eval_examples(jax.random.PRNGKey(0), len(SCRIPTED), env.eval_settings()[0].stage)
    run = jax.jit(lambda ex, k: ro.rollout(env, policy, None, None, None, tables, ex, k,
                                           ro.RolloutConfig(context_length=1152, max_turns=4),
                                           SamplingConfig(max_new_tokens=24).with_tokenizer((tables.eos_id,), tables.pad_id)))
    traj = run(examples, jax.random.PRNGKey(1))
    assert _check_decision_mask(tables, env.reply_grammar(env.params), traj) >= 6
    assert float(jnp.sum(traj.decision_mask)) > 0 and (np.asarray(traj.choice_set) == -1).all()


# ---------------------------------------------------------------------------------------------------------
# Whole rollouts with a tiny random LFM2


@pytest.fixture(scope="module")
def tiny_model(tok):
    config = dataclasses.replace(PRESETS["tiny"], vocab_size=len(tok))
    module = Lfm2ForCausalLM(config)
    params = module.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]
    return config, module, params


def _model_rollout(tiny_model, tables, env, sampling: SamplingConfig, games: int = 8, turns: int = 3):
    config, module, params = tiny_model
    run = ro.make_rollout(env, cached_call(module), lambda b, n: init_cache(config, b, n), tables,
                          ro.RolloutConfig(context_length=448, max_turns=turns), sampling)
    examples = env.eval_examples(jax.random.PRNGKey(5), games, env.eval_settings()[0].stage)
    return run(params, examples, jax.random.PRNGKey(6))


@pytest.mark.parametrize("name,greedy", [("tictactoe", False), ("arithmetic", False), ("connect_four", True)])
def test_constrained_rollouts_parse_and_the_trainer_recomputes_their_logprobs(tok, all_tables, tiny_model, name,
                                                                               greedy):
    env = {"tictactoe": TTT, "arithmetic": ARITH, "connect_four": C4}[name]
    tables = all_tables[name]
    grammar = env.reply_grammar(env.params)
    sampling = SamplingConfig(max_new_tokens=16, constrained=True, greedy=greedy, temperature=0.9)
    traj = jax.device_get(_model_rollout(tiny_model, tables, env, sampling))
    played = traj.reply_kind >= 0
    assert played.sum() >= 8
    assert (traj.reply_kind[played] == 2).all() and traj.reply_format[played].all()
    assert not traj.reply_truncated.any()
    mask = traj.loss_mask > 0
    decision = traj.decision_mask > 0
    assert (mask >= decision).all() and ((traj.choice_set >= 0) == mask).all()
    if grammar.content == "cell":  # one loss token a reply: the choice
        np.testing.assert_array_equal(mask.sum(1), played.sum(1))
        np.testing.assert_array_equal(mask, decision)
    assert _check_decision_mask(tables, grammar, traj) == played.sum()
    # the trainer's side: a full forward, the logits restricted to each token's set, then its log-softmax
    config, module, params = tiny_model

    @jax.jit
    def trainer_logprobs(tokens, choice_set):
        logits, _ = module.apply({"params": params}, tokens)
        restricted = restrict_logits(logits[:, :-1], choice_set[:, 1:], tables.reply_template.sets)
        logp = jax.nn.log_softmax(restricted / sampling.temperature, axis=-1)
        return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0], jnp.max(logp, axis=-1)

    at, best = (np.asarray(x) for x in trainer_logprobs(jnp.asarray(traj.tokens), jnp.asarray(traj.choice_set)))
    if greedy:
        assert (traj.logprobs == 0).all()
        # greedy picks the allowed token of highest logit
        assert (at[mask[:, 1:]] >= best[mask[:, 1:]] - 1e-5).all()
    else:
        np.testing.assert_allclose(traj.logprobs[:, 1:][mask[:, 1:]], at[mask[:, 1:]], atol=1e-4)
    assert (traj.logprobs[~mask] == 0).all()


def test_unconstrained_rollout_decision_mask_equals_the_host_search(tok):
    """A bigram model that babbles tag pieces, digits and spaces: many replies hold a tag, some a content."""
    env = envs.make("tictactoe", prompt="compact")
    tables = text.tables_for_env(tok, env)
    vocab = len(tok) + EXTRA_VOCAB
    one = lambda piece: tok.encode(piece, add_special_tokens=False)[0]  # noqa: E731
    gen = tables.piece_tokens[int(tables.close_piece[0])][int(tables.piece_lengths[int(tables.close_piece[0])]) - 1]
    follow = {int(gen): {"<move": 8, "x": 5}, one("<move"): {">": 9}, one("</"): {"move": 9}, one("move"): {">": 9},
              one(">"): {"4": 6, " ": 6, "1": 5, "x": 4, "</": 6, None: 5}}
    for piece in ["4", " ", "1", "x"]:
        follow[one(piece)] = {"</": 7, " ": 5, "4": 5, "x": 3}
    bigram = np.zeros((vocab, vocab), np.float32)
    for prev, nxt in follow.items():
        for piece, w in nxt.items():
            bigram[prev, tok.eos_token_id if piece is None else one(piece)] = w
    bigram = jnp.asarray(bigram)

    def model_fn(params, tokens, cache, num_valid):
        n = cache.lengths + num_valid
        last = jnp.take_along_axis(tokens, jnp.clip(num_valid - 1, 0)[:, None], axis=1)[:, 0]
        keys = jax.vmap(lambda r, k: jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(7), r), k))(
            jnp.arange(n.shape[0]), n)
        logits = jax.vmap(lambda k: jax.random.normal(k, (vocab,)))(keys) + bigram[last]
        return logits[:, None], FakeCache(n, cache.max_len)

    run = ro.make_rollout(env, model_fn, lambda b, n: FakeCache(jnp.zeros((b,), jnp.int32), n), tables,
                          ro.RolloutConfig(context_length=448, max_turns=4), SamplingConfig(max_new_tokens=12))
    examples = env.eval_examples(jax.random.PRNGKey(5), 64, env.eval_settings()[0].stage)
    traj = jax.device_get(run(None, examples, jax.random.PRNGKey(6)))
    assert _check_decision_mask(tables, env.reply_grammar(env.params), traj) >= 64
    assert (traj.reply_kind == 2).sum() >= 10 and (traj.reply_kind == 1).sum() >= 10
    np.testing.assert_array_equal(traj.loss_mask.sum(1), traj.reply_lengths.sum(1))
    assert (traj.choice_set == -1).all()


def test_content_span_on_random_bytes_equals_the_host_search():
    """Random byte strings built from tag pieces, whitespace characters and stray bytes, with invalid
    (skipped) bytes between them, against the host search on the valid bytes."""
    grammar = ReplyGrammar("move", "cell")
    rng = np.random.default_rng(0)
    atoms = [b"<move>", b"</move>", b"<", b"/", b"move>", b" ", b"\n", "\u2003".encode(), "\u00a0".encode(),
             b"\xe2\x80", b"\x80", b"4", b"12", b"x", "\u3000".encode(), b"\x1c"]
    rows, width = 300, 48
    data = np.zeros((rows, width), np.uint8)
    valid = np.zeros((rows, width), bool)
    want = []
    for r in range(rows):
        chunks, n = [], 0
        while True:
            atom = atoms[rng.integers(len(atoms))]
            gap = int(rng.integers(0, 2))
            if n + gap + len(atom) > width:
                break
            n += gap
            data[r, n:n + len(atom)] = np.frombuffer(atom, np.uint8)
            valid[r, n:n + len(atom)] = True
            chunks.append((n, atom))
            n += len(atom)
        want.append(chunks)
    has, start, end = jax.device_get(jax.jit(jax.vmap(lambda d, v: gm.content_span(grammar, d, v)))(data, valid))
    hits = 0
    for r in range(rows):
        flat = np.nonzero(valid[r])[0]
        raw = bytes(data[r][flat])
        mask = _host_content_tokens_bytes(grammar, raw)
        if not mask:
            assert not has[r], r
            continue
        hits += 1
        s, e = mask
        assert has[r] and start[r] == flat[s] and end[r] == flat[e - 1] + 1, (r, raw)
    assert hits > 30


def _host_content_tokens_bytes(grammar, data: bytes):
    """(start, end) of the stripped content in data, or None."""
    open_tag, close_tag = f"<{grammar.tag}>".encode(), f"</{grammar.tag}>".encode()
    a = data.find(open_tag)
    b = data.find(close_tag, a + len(open_tag)) if a >= 0 else -1
    if a < 0 or b < 0:
        return None
    begin = a + len(open_tag)
    content = data[begin:b].decode("utf-8", errors="replace")
    if not content.strip():
        return None
    lead = len(content) - len(content.lstrip())
    trail = len(content) - len(content.rstrip())
    return begin + len(content[:lead].encode()), b - len(content[len(content) - trail:].encode())
