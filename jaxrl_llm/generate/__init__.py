"""Generation: the jitted batched sampler (prefill, then a `lax.while_loop` of cached decode steps)."""

from jaxrl_llm.generate.sampler import (  # noqa: F401
    ModelFn, SampleOutput, SamplingConfig, check_constrained, decode, last_logits, make_sampler,
    process_logits, restrict_logits, sample,
)
