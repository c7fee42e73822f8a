"""Does a warm-up read the board? The SFT decision metrics of a model on two fixed held-out sets (issue 30).

    python experiments/warmup_eval.py CONFIG --checkpoint DIR [--positions 500] [--games 150] [--out FILE]

CONFIG: the preset the model was trained with (its env, tokenizer and model); DIR: an SFT / GRPO checkpoint
folder or a Hugging Face folder (as `jaxrl-llm eval --checkpoint`). The two sets are the same for every
model (their own seeds), so recipes compare on equal terms:

    positions   --positions one-reply rows: a uniformly random reachable position (one turn of a random-mover
                game against the random opponent) and a uniformly random legal reply (`layout = "positions"`)
    games       every reply of --games whole games of the random legal mover against the random opponent, in
                their multi-turn context: the conversations GRPO's rollouts build

Per set, teacher-forced (`jaxrl_llm.algos.sft.decision_eval`): decision_loss (the move token's cross-entropy),
decision_loss_floor (ln #free cells: a uniform pick among the free cells), illegal_prob (probability on occupied
cells), choice_entropy, format_loss. Prints one JSON object ({set: metrics}) and writes it to --out if given.
The bar of issue 30: decision_loss at the floor and illegal_prob < 2 % on both sets.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax

from envs.tictactoe.teacher import Teacher
from jaxrl_llm.algos import sft
from jaxrl_llm.config import load_config
from jaxrl_llm.train.components import build, policy_params

SEED = 12345  # the held-out sets' key: not a training stream of any preset


def heldout_sets(preset: str, positions: int, games: int, max_turns: int) -> dict[str, list[dict]]:
    """The two held-out row sets (see the module docstring) for a Tic-Tac-Toe prompt preset."""
    key = jax.random.PRNGKey(SEED)
    random_mover = dict(kind="uniform", reasoning="none", explore_prob=1.0, opponent_p_min=1.0, opponent_p_max=1.0,
                        keep_losses=True)
    return {
        "positions": Teacher(num_games=positions, layout="positions", **random_mover).rows(
            jax.random.fold_in(key, 0), preset, max_turns),
        "games": Teacher(num_games=games, layout="games", **random_mover).rows(jax.random.fold_in(key, 1), preset,
                                                                               max_turns),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--positions", type=int, default=500)
    parser.add_argument("--games", type=int, default=150)
    parser.add_argument("--seq-len", type=int, default=400)
    parser.add_argument("--out", default=None)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    config = load_config(args.config, args.set)
    comp = build(config)
    if comp.env.name != "tictactoe":
        raise SystemExit(f"warmup_eval measures Tic-Tac-Toe models; the config's env is {comp.env.name!r}")
    params = policy_params(config, comp, args.checkpoint)
    grammar = comp.env.reply_grammar(comp.env.params)
    choice_tokens = sft.choice_token_ids(comp.tokenizer, grammar)
    results = {}
    for name, rows in heldout_sets(comp.env.params.prompt, args.positions, args.games,
                                   config.rollout.max_turns).items():
        data = sft.tokenize_sft(comp.tokenizer, rows, args.seq_len, grammar=grammar)
        results[name] = sft.decision_eval(comp.module, params, data, choice_tokens)
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
