"""Generation: the jitted batched sampler (prefill, then a `lax.while_loop` of cached decode steps)."""

from jaxrl_llm.generate.sampler import (  # noqa: F401
    ModelFn, SampleOutput, SamplingConfig, check_constrained, decode, last_logits, make_sampler,
    process_logits, restrict_logits, sample,
)

# The old name of the model seam's cached call (from when LFM2 was the one family); serves any family's module.
from models.family import cached_call as lfm2_model_fn  # noqa: E402,F401
