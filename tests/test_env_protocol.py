"""An environment defined outside the package (tests/nim_env.py) plugs into the framework through the public
API alone: registry, text tables, rollout, a GRPO step, evaluation, checkpoints; no package module is edited
or patched. Also: the registry's errors, and a checkpoint of one env refused for another."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import envs
from jaxrl_llm import rollout as ro
from jaxrl_llm import text
from jaxrl_llm.config import ConfigError, loads_config
from jaxrl_llm.generate import SamplingConfig
from jaxrl_llm.metrics import read_metrics
from nim_env import LOST, WON, Nim

ROOT = Path(__file__).resolve().parents[1]
envs.register("nim", Nim, overwrite=True)

CONFIG = """
[model]
preset = "tiny"
vocab_size = 576
num_hidden_layers = 2
layer_types = ["conv", "full_attention"]

[env]
name = "nim"

[sampling]
max_new_tokens = 8

[rollout]
context_length = 256
max_turns = 4

[sft]
steps = 0

[[grpo]]
steps = 2
num_prompts = 2
group_size = 2

[grpo.curriculum]
p_min = 0.5
p_max = 1.0

[grpo.optim]
learning_rate = 1e-3

[eval]
num_games = 4

[checkpoint]
every_steps = 1
async_save = false
"""


def _py_game(seed: int, takes: list[int], p: float):
    """Plain-Python Nim with the env's opponent draws (its randomness comes from the env): final stones, won."""
    stones = 5 + seed % 16
    for take in takes:
        if not 1 <= take <= min(3, stones):
            continue
        stones -= take
        if stones == 0:
            return 0, True
        key = jax.random.fold_in(jax.random.PRNGKey(seed), stones)
        rnd = int(jax.random.randint(key, (), 1, max(min(3, stones), 1) + 1))
        best = 1 if stones % 4 == 0 else stones % 4
        stones -= rnd if float(jax.random.uniform(jax.random.fold_in(key, 1))) < p else best
        if stones == 0:
            return 0, False
    return stones, None


def test_registry_makes_and_names_envs():
    assert "tictactoe" in envs.registered() and "nim" in envs.registered()
    env = envs.make("nim", format_weight=0.3)
    assert isinstance(env, Nim) and env.params.format_weight == 0.3 and hash(env) == hash(envs.make("nim", format_weight=0.3))
    with pytest.raises(KeyError, match="did you mean 'nim'"):
        envs.make("nimm")
    with pytest.raises(ValueError, match="already registered"):
        envs.register("nim", envs.env_class("tictactoe"))
    with pytest.raises(TypeError, match="not a subclass"):
        envs.register("other", int)
    with pytest.raises(ConfigError, match="env.name: unknown env 'nimm'; did you mean 'nim'"):
        loads_config(CONFIG, ["env.name=nimm"])


def test_a_scripted_nim_rollout_follows_the_rules():
    env = envs.make("nim")
    tok = text.load_tokenizer()
    tables = text.tables_for_env(tok, env)  # verified against the chat template
    seeds = np.array([3, 4, 9, 17, 22, 30, 41, 58], np.uint32)
    p = np.array([0.0, 1.0] * 4, np.float32)
    script = [[f"<take>{t}</take>" for t in row] for row in
              [[1, 2, 3, 1], [3, 3, 3, 3], [2, 9, 1, 1], [1, 1, 1, 1], [3, 2, 1, 3], [0, 1, 2, 3], [2, 2, 2, 2], [1, 3, 1, 3]]]
    script[1][1] = "I take two."  # no tag
    reply_tokens, reply_lengths = ro.script_replies(tok, script, 4, 12)
    policy = ro.scripted_policy(reply_tokens, reply_lengths, tables.eos_id)
    run = jax.jit(lambda ex, k: ro.rollout(env, policy, None, None, None, tables, ex, k,
                                           ro.RolloutConfig(context_length=400, max_turns=4), SamplingConfig(max_new_tokens=12)))
    traj = jax.device_get(run((jnp.asarray(seeds), jnp.asarray(p)), jax.random.PRNGKey(0)))
    for b in range(len(seeds)):
        takes = [int(re.search(r"\d+", r).group()) if "<take>" in r else -1 for r in script[b]]
        stones, won = _py_game(int(seeds[b]), takes[: int(traj.turns[b])], float(p[b]))
        assert int(traj.final_state.stones[b]) == stones
        assert traj.metrics["win"][b] == (won is True) and traj.metrics["loss"][b] == (won is False)
        conversation = ro.decode_game(tok, traj, b)
        assert conversation.startswith("<|startoftext|><|im_start|>system\nNim:")
        if won is not None:
            assert ("You win!" if won else "You lose!") in conversation and traj.metrics["unfinished"][b] == 0
    assert traj.metrics["invalid"][2] == 1 and traj.reply_kind[1, 1] == 0  # "9" and the untagged reply
    np.testing.assert_allclose(traj.reward, traj.reward_parts["win"] + 0.1 * traj.reward_parts["format"], atol=1e-6)
    assert {int(s) for s in traj.final_state.status} & {WON, LOST}


def test_grpo_eval_and_checkpoints_run_through_the_public_api(tmp_path):
    from jaxrl_llm import train
    from jaxrl_llm.checkpoint import CheckpointMismatchError, restore_params_only

    config = loads_config(CONFIG, [f'run.output_dir="{tmp_path}"'])
    comp = train.build(config)
    assert comp.env.name == "nim" and comp.tables.slot_names == ("status", "pile", "turn")
    result = train.train_grpo(config, comp, log=lambda *a: None)
    assert result["step"] == 2
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and {"win_rate", "loss_rate", "unfinished_rate", "win_reward"} <= set(rows[0])
    results = train.evaluate(comp, result["params"], games_path=tmp_path / "games.jsonl")
    assert set(results) == {"random", "optimal"} and set(results["random"]) >= {"win", "loss", "unfinished", "format"}
    restored = restore_params_only(config.checkpoint_dir())
    for a, b in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(result["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    again = train.train_grpo(config, comp, log=lambda *a: None)  # resumes at the end: nothing to do
    assert again["step"] == 2
    # The same checkpoint folder with another env is refused, naming both.
    other = loads_config(CONFIG.replace('name = "nim"', 'name = "tictactoe"'),
                         [f'run.output_dir="{tmp_path}"', "env.params.prompt=compact", "rollout.context_length=448"])
    with pytest.raises(CheckpointMismatchError, match="trained on env 'nim' but the config uses env 'tictactoe'"):
        train.policy_params(other, train.build(other), config.checkpoint_dir())


def test_the_readme_shows_this_env_verbatim():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```python\n(\"\"\"Nim against a scripted opponent.*?)```", readme, re.DOTALL)
    assert block is not None, "README: the 'Write your own environment' code block is missing"
    assert block.group(1) == (Path(__file__).parent / "nim_env.py").read_text()
