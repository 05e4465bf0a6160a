"""Whether a request's token ids fit a model's vocabulary: its `logit_bias` for the gateway (with the vocabulary size
its live workers publish, `rqbatcher.jobs.worker_stats.WorkerStats.vocab_size`) and the engine (with its own), and
for the gateway its prompt's and embedding inputs' ids too, so that a job no worker could run is never enqueued.

The schema bounds the ids alone (`SamplingParams.logit_bias`); only a model knows its vocabulary. No torch here.
"""

from __future__ import annotations

from collections.abc import Iterable

from rqbatcher.schema import GenerationRequest, SamplingParams

UNKNOWN_VOCAB_SIZE = 0  # what an older worker publishes: no check can be made


def logit_bias_problem(sampling: SamplingParams, vocab_size: int) -> str | None:
    """Why `sampling.logit_bias` cannot be honoured by a model of `vocab_size` tokens, or None if it can (and when
    the size is unknown). The message names the field and the first id outside the vocabulary."""
    return _outside("logit_bias", sampling.logit_bias, vocab_size)


def token_ids_problem(request: GenerationRequest, vocab_size: int) -> tuple[str, str] | None:
    """(the body field, why) when a token id of the request lies outside a vocabulary of `vocab_size` tokens: one of
    its logit_bias, of its prompt (OpenAI's `prompt` holds `prompt_token_ids`) or of an embedding input (`input`);
    None when every one fits, or the size is unknown."""
    given = {"logit_bias": request.sampling.logit_bias, "prompt": request.prompt_token_ids or (),
             "input": (t for item in request.embed or () if isinstance(item, list) for t in item)}
    for field, token_ids in given.items():
        problem = _outside(field, token_ids, vocab_size)
        if problem is not None:
            return field, problem
    return None


def _outside(field: str, token_ids: Iterable[int], vocab_size: int) -> str | None:
    if vocab_size <= UNKNOWN_VOCAB_SIZE:
        return None
    bad = next((token for token in token_ids if token >= vocab_size), None)
    if bad is None:
        return None
    return f"{field}: token id {bad} is outside the vocabulary (size {vocab_size})"
