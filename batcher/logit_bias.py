"""Whether a request's `logit_bias` fits a model's vocabulary: one check for the gateway (with the vocabulary size
its live workers publish, `rqbatcher.jobs.worker_stats.WorkerStats.vocab_size`) and the engine (with its own).

The schema bounds the ids alone (`SamplingParams.logit_bias`); only a model knows its vocabulary. No torch here.
"""

from __future__ import annotations

from rqbatcher.schema import SamplingParams

UNKNOWN_VOCAB_SIZE = 0  # what an older worker publishes: no check can be made


def logit_bias_problem(sampling: SamplingParams, vocab_size: int) -> str | None:
    """Why `sampling.logit_bias` cannot be honoured by a model of `vocab_size` tokens, or None if it can (and when
    the size is unknown). The message names the field and the first id outside the vocabulary."""
    if vocab_size <= UNKNOWN_VOCAB_SIZE:
        return None
    bad = next((token for token in sampling.logit_bias if token >= vocab_size), None)
    if bad is None:
        return None
    return f"logit_bias: token id {bad} is outside the vocabulary (size {vocab_size})"
