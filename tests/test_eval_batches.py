"""`[eval] batch_size`: evaluation in batches of games plays the same greedy games as one batch, a padded last
batch included, and writes them in the same order."""

from __future__ import annotations

import dataclasses

from jaxrl_llm.config import loads_config
from test_env_protocol import CONFIG  # registers the Nim env


def test_batches_play_the_games_of_one_batch(tmp_path):
    from jaxrl_llm import train
    from jaxrl_llm.train.components import fresh_params, init_key

    config = loads_config(CONFIG, [f'run.output_dir="{tmp_path}"', "eval.num_games=10"])
    comp = train.build(config)
    params = fresh_params(comp, init_key(config))
    whole = train.evaluate(comp, params, games_path=tmp_path / "whole.jsonl")
    batched_config = dataclasses.replace(config, eval=dataclasses.replace(config.eval, batch_size=4))  # 4 + 4 + 2
    batched = train.evaluate(train.build(batched_config), params, games_path=tmp_path / "batched.jsonl")
    assert batched == whole and whole["random"]["games"] == 10
    assert (tmp_path / "batched.jsonl").read_text() == (tmp_path / "whole.jsonl").read_text()
