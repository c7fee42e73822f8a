"""The training loop: components from a config, SFT warm-up, resumable GRPO stages, evaluation.

Reading order: `components.build` (env, tokenizer, text tables, model), `grpo_loop.make_grpo_step` (ONE
jitted program: the env's examples -> rollout -> group advantages -> optimizer passes -> metrics),
`grpo_loop.train_grpo` (stages and steps: checkpoints, metrics, samples), `sft_loop.run_sft` (`train_sft`),
`evaluate.evaluate`; `keys` names the random streams; `events` the loops' moments a caller may observe;
`loop` the one training loop both run in (`TrainState`, `RunLog`, `run_loop`, resume and checkpoint helpers).
"""

from jaxrl_llm.compat import ENV_FILE, env_record  # noqa: F401
from jaxrl_llm.train.components import (  # noqa: F401
    Components, base_params, build, fresh_params, fresh_trainable, init_key, initial_policy,
    make_mesh, merged_params, policy_params, policy_view, sft_dir, shard_params, trainable_target,
    fresh_start_warning, policy_source,
)
from jaxrl_llm.train.evaluate import evaluate, exactness_check, summarize  # noqa: F401
from jaxrl_llm.train.grpo_loop import (  # noqa: F401
    games_played, global_stage, make_grpo_step, progress_keys, rollout_metrics, time_stage_rollout, train_grpo,
    write_samples,
)
from jaxrl_llm.train.keys import stream  # noqa: F401
from jaxrl_llm.train.loop import Loop, RunLog, TrainState, run_loop  # noqa: F401
from jaxrl_llm.train.sft_loop import run_sft, sft_rows, train_sft  # noqa: F401
