"""`GrpoConfig`: the `[grpo.loss]` table, validated on construction (static under jit).

It lives beside, not inside, `algos.grpo` so that the GRPO helpers (`grpo_inputs`, `grpo_metrics`,
`token_logprobs`) and the config loader can import it without importing the update that uses them;
`jaxrl_llm.algos.grpo.GrpoConfig` still names it.
"""

from __future__ import annotations

import dataclasses

from jaxrl_base.checks import ConfigError, check_choice, check_float, check_int

LOSS_TYPES = ("token-mean", "sequence-mean-token-mean", "dr-grpo")
SCALE_REWARDS = ("group", "none")
LOSS_ON = ("reply", "decision")
ADVANTAGES = ("episode", "step", "mix")
ESTIMATORS = ("grpo", "rloo")


@dataclasses.dataclass(frozen=True)
class GrpoConfig:
    """GRPO hyper-parameters (static under jit; validated on construction): exactly the `[grpo.loss]` table.
    The group size and the temperature are not in it: `grpo_update_step` / `make_grpo_update` take them.

    scale_rewards: "group" divides the centred rewards by the group's std (+ std_eps); "none" only
        centres them (Dr. GRPO's advice).
    std_eps: added to the group std before dividing (as TRL, 1e-4).
    epsilon_low, epsilon_high: the ratio is clipped to [1 - epsilon_low, 1 + epsilon_high] (DAPO's
        asymmetric "clip higher"; 0.2 / 0.28).
    beta: coefficient of the k3 KL estimator to the frozen reference; 0 needs no reference model (it is
        then never evaluated).
    loss_type: how per-token losses are aggregated (formulas in `grpo_loss`): "token-mean",
        "sequence-mean-token-mean" or "dr-grpo".
    max_completion_tokens: the constant normaliser of "dr-grpo" (required for it, ignored otherwise):
        the most model tokens a row can hold. In a multi-turn game that is the loss-mask tokens of all
        replies together, e.g. `env.max_turns * sampling.max_new_tokens`.
    ratio_mask_low, ratio_mask_high: importance-ratio masking; a token whose ratio r = pi / pi_sampler is
        outside [ratio_mask_low, ratio_mask_high] contributes nothing to the loss (None disables a side).
        Guards against tokens where sampler and trainer disagree (e.g. numerics, stale samples).
    num_minibatches: optimizer steps per pass; must divide B.
    passes: passes over the batch per update (each pass sees every row once).
    grad_accum_steps: micro-batches per minibatch (gradient accumulated with `lax.scan`); must divide
        B / num_minibatches. The result equals the minibatch taken in one piece.
    shuffle: rows are permuted with the update's key at each pass (else taken in order).
    compute_entropy: also compute the policy's per-token entropy (a metric; no gradient).
    skip_zero_advantage: with beta = 0 a row whose advantage is 0 (e.g. every row of a group whose rewards
        are all equal) has an exactly zero gradient, so the update does not compute it. Each minibatch's rows
        are ordered with the advantaged ones first, and a micro-batch whose rows all have advantage 0 skips
        its forward and backward pass (`lax.cond`); its gradient is the exact zero, and the optimizer step
        is the same. The params come out as without skipping (up to float summation order); the per-token
        metrics (clip fractions, ratio, entropy) are then means over the computed rows. Use
        grad_accum_steps > 1 for a finer granularity. Ignored when beta > 0 or entropy_coef > 0 (the KL
        term and the entropy bonus have a gradient on every row).
    entropy_coef: an entropy bonus (>= 0; 0 = off, the default): each loss token's loss gets
        - entropy_coef * H, H the entropy of the policy's distribution for that token (the logits divided by
        the sampler's temperature; under constrained replies over the allowed set, so a forced token has
        H = 0), aggregated like the rest of the loss. Against the collapse of the sampled decisions' entropy,
        which ends exploration: every group's replies become the same and carry no reward spread. On
        unconstrained replies it also raises the entropy of the format tokens: keep it small there, or use
        constrained replies or loss_on = "decision".
    length_buckets: the update runs each micro-batch (and the reference / metric forwards, chunk by chunk)
        over the shortest of `length_buckets` static lengths (`bucket_lengths`: multiples of L / n rounded
        up to 8, the last L) that holds its longest real row (the last loss token + 1), chosen with
        `lax.switch`: each bucket compiles once, no step recompiles. A causal model's log-probs at the kept
        positions are those of the full context, so the update equals the full-length one (float
        rounding aside). With grad_accum_steps > 1 each minibatch's rows are ordered by length (the
        advantaged ones first under skip_zero_advantage) before it is cut into micro-batches (exact: the
        micro-batches share their minibatch's normalisers). 1: every row at the full context (the old path).
    logits_at_loss_only: the final hidden states are gathered at the positions that predict loss tokens
        before the LM head (the model's `logit_positions=...`), so the logits and log-softmax cost
        K positions a row instead of L, with K = max_completion_tokens rounded up to 8 (at most L; L when
        it is unset). A row with more loss tokens than K loses the later ones (metric `loss_tokens_cut`;
        0 when max_completion_tokens is the true bound, max_turns * max_new_tokens, as a stage sets it).
        False: the logits at every position (the old path).
    loss_on: "reply" (every model token, today) or "decision" (only the tokens that carry the reply
        grammar's content, the `decision_mask` given to `grpo_update_step`: the move, the answer; the
        fixed format text then gets no gradient and cannot drift).
    advantage: what each token's advantage is (`algos.advantages.token_advantages`): "episode" the group
        advantage of the game's reward on every token (today's GRPO); "step" per-turn step groups after
        GiGPO (turns of one group played from the same state, keyed by `Env.state_key`, compared by
        their discounted returns; each turn's advantage on its own tokens); "mix" episode_weight *
        episode + step_weight * step.
    episode_weight, step_weight: the two weights of "mix" (>= 0, not both 0; ignored otherwise).
    step_discount: the discount of the per-turn return of "step" and "mix", in [0, 1] (GiGPO's 0.95).
    policy_change_rows: how many rows (the batch's first: its examples are drawn at random) the metric
        `decision_policy_change` measures: it costs one no-gradient forward of those rows after the
        update. At least the batch size: every row (exact, one more forward of the whole batch: ~1/3 of
        an every-row update); 0: off (NaN). Default 16: an eighth of the CPU preset's 128 rows, ~100
        decision tokens.
    estimator: the episode advantage (`episode_advantages`): "grpo" the group-relative one
        (`group_advantages`, with scale_rewards and std_eps); "rloo" REINFORCE's leave-one-out baseline
        (`rloo_advantages`: a row's reward minus the mean of the other rows of its group; no std division,
        so scale_rewards and std_eps do not touch it), through the same clipped-ratio loss, which with one
        pass and one minibatch (ratio 1) is REINFORCE's -A grad log pi. It sets the episode advantage of
        "episode" and of "mix" (the step part stays GiGPO's); "step" uses no episode advantage, so "rloo"
        with it is an error.
    """

    scale_rewards: str = "group"
    std_eps: float = 1e-4
    epsilon_low: float = 0.2
    epsilon_high: float = 0.28
    beta: float = 0.0
    loss_type: str = "token-mean"
    max_completion_tokens: int | None = None
    ratio_mask_low: float | None = None
    ratio_mask_high: float | None = None
    num_minibatches: int = 1
    passes: int = 1
    grad_accum_steps: int = 1
    shuffle: bool = True
    compute_entropy: bool = True
    skip_zero_advantage: bool = True
    length_buckets: int = 4
    logits_at_loss_only: bool = True
    loss_on: str = "reply"
    advantage: str = "episode"
    episode_weight: float = 1.0
    step_weight: float = 1.0
    step_discount: float = 0.95
    estimator: str = "grpo"
    policy_change_rows: int = 16
    entropy_coef: float = 0.0

    def __post_init__(self):
        for name in ("num_minibatches", "passes", "grad_accum_steps"):
            check_int(self, name, 1)
        check_choice(self, "scale_rewards", SCALE_REWARDS)
        check_float(self, "std_eps", low=0.0, low_open=True)
        check_float(self, "epsilon_low", 0.0, 1.0, high_open=True)
        check_float(self, "epsilon_high", low=0.0)
        check_float(self, "beta", low=0.0)
        check_choice(self, "loss_type", LOSS_TYPES)
        if self.max_completion_tokens is not None:
            check_int(self, "max_completion_tokens", 1)
        elif self.loss_type == "dr-grpo":
            raise ConfigError("is needed by loss_type 'dr-grpo' (its constant normaliser, e.g. max_turns * "
                              "max_new_tokens)", ("max_completion_tokens",), "GrpoConfig")
        if self.ratio_mask_low is not None:
            check_float(self, "ratio_mask_low", 0.0, 1.0, high_open=True)
        if self.ratio_mask_high is not None:
            check_float(self, "ratio_mask_high", low=1.0, low_open=True)
        check_int(self, "length_buckets", 1)
        check_choice(self, "loss_on", LOSS_ON)
        check_choice(self, "advantage", ADVANTAGES)
        check_float(self, "episode_weight", low=0.0)
        check_float(self, "step_weight", low=0.0)
        check_float(self, "step_discount", 0.0, 1.0)
        if self.advantage == "mix" and self.episode_weight == 0 and self.step_weight == 0:
            raise ConfigError("advantage 'mix' needs episode_weight or step_weight > 0 (both are 0)",
                              ("step_weight",), "GrpoConfig")
        check_choice(self, "estimator", ESTIMATORS)
        check_int(self, "policy_change_rows", 0)
        check_float(self, "entropy_coef", low=0.0)
        if self.estimator == "rloo" and self.advantage == "step":
            raise ConfigError("'rloo' is an episode advantage, which advantage 'step' does not use (use "
                              "advantage 'episode' or 'mix', or estimator 'grpo')", ("estimator",), "GrpoConfig")

    @property
    def dense_gradient(self) -> bool:
        """Whether every row has a gradient whatever its advantage (the KL term or the entropy bonus is on)."""
        return self.beta > 0 or self.entropy_coef > 0

    @property
    def micro_batches(self) -> int:
        """Micro-batches per pass: num_minibatches * grad_accum_steps (must divide B)."""
        return self.num_minibatches * self.grad_accum_steps
