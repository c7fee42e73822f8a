"""Rollouts: whole multi-turn episodes of any env in one `jit` (`rollout.py`), and their records (`records.py`)."""

from jaxrl_llm.rollout.records import (  # noqa: F401
    decode_game, game_record, games_text, outcome_label, script_replies, write_games_jsonl,
)
from jaxrl_llm.rollout.rollout import (  # noqa: F401
    Buffer, Carry, Flags, Policy, Reply, RolloutConfig, Trajectory, TurnLog, cache_stage_plan, grow_cache,
    make_rollout, model_policy, rollout, scripted_policy,
)
