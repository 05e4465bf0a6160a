"""Resume, not restart: what a rerun job's earlier attempts left in its stream, read back so that the rerun goes on
from there (`Engine.add(progress=...)`) and its stream continues with the next event.

A job runs again after its worker crashed, lost its lease, was force-stopped or a failover moved Redis. Every
event in its stream passed the fence (`rqbatcher.workers.job_worker.stream_writer`): it was written while its execution
held the job's lease, so the stream holds exactly what readers may have seen. The rerun reads it as readers do
(a `restart` starts the text over; a `start` hands the stream to a new execution) and keeps each choice's tokens,
text and logprobs. Continuing is impossible, and the rerun restarts, when the stream is not one unbroken text:
an event missing at its start (trimmed) or in the middle (an index that skips), or logprobs missing where the
request asked for them.

A sampled request draws token i from (seed, choice, i) alone (`workers.engine.sampling`), so a rerun draws what
the lost attempt would have drawn only with the same seed: a request sent without one gets a seed derived from
its job id (`with_job_seed`), the same on every attempt, and for plain-RQ producers too.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from rqbatcher.schema import GenerationRequest, StreamEvent, TokenLogprob, Usage
from rqbatcher.workers.engine.api import Progress


@dataclass
class Resumed:
    """A stream that a rerun can continue: each choice's tokens (and logprobs), its text, and the prompt's usage
    as the first token events carried it."""

    progress: dict[int, Progress] = field(default_factory=dict)
    text: dict[int, str] = field(default_factory=dict)
    prompt_usage: Usage | None = None


class _Choice:
    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] | None = []


def read_resumable(entries: list, wants_logprobs: bool) -> Resumed | None:
    """What the stream's `entries` (XRANGE's reply) let a rerun continue from; None if it cannot continue."""
    current: str | None = None
    choices: dict[int, _Choice] = {}
    usage = None
    for position, (_, fields) in enumerate(entries):
        event = StreamEvent.from_fields(fields)
        if position == 0 and event.type not in ("start", "restart"):
            return None  # trimmed: its beginning is gone
        if event.type in ("start", "restart"):
            if event.type == "restart":
                choices, usage = {}, None
            current = event.execution_id
            continue
        if event.execution_id not in (current, None):
            continue  # a lost attempt that was still writing (before the fence existed)
        if event.terminal:
            return None  # the job ended: nothing to continue
        choice = choices.setdefault(event.choice, _Choice())
        if event.index != len(choice.token_ids):
            return None  # a gap, or tokens written twice
        choice.token_ids += event.token_ids
        choice.text.append(event.text)
        if event.usage is not None and event.index == 0:
            usage = event.usage
        if choice.logprobs is not None and event.logprobs is not None and len(event.logprobs) == len(event.token_ids):
            choice.logprobs += event.logprobs
        else:
            choice.logprobs = None
    if wants_logprobs and any(c.logprobs is None for c in choices.values()):
        return None
    return Resumed(
        progress={i: Progress(c.token_ids, c.logprobs if wants_logprobs else None) for i, c in choices.items()},
        text={i: "".join(c.text) for i, c in choices.items()},
        prompt_usage=usage)


def with_job_seed(request: GenerationRequest, job_id: str) -> GenerationRequest:
    """The request, with a seed derived from the job id if it has none: every attempt of the job draws the same."""
    if request.sampling.seed is not None or request.sampling.greedy:
        return request
    seed = int.from_bytes(hashlib.sha256(job_id.encode()).digest()[:8], "big") >> 1  # 63 bits
    return request.model_copy(update={"sampling": request.sampling.model_copy(update={"seed": seed})})
