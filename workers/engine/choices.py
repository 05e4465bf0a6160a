"""`n` choices of one request, and `best_of` candidates: the engine runs them as sequences and reports them
under the request's id.

`expand` names the sequences (`<id>#choice<i>`) and gives each its sampling: choice 0 keeps the request's seed,
choice i a seed derived from it, and the sampler keys each draw by that seed and the output position
(workers/engine/sampling.py), so a seeded request gets the same n answers wherever it runs. All n join
the scheduler together, so the prompt's full blocks are computed by one and found in the prefix cache by the
others. `merge` turns their outputs back into the request's: each output names its `choice`; a choice that
ends while others still run reports no finish reason yet, and the output of the last one to end carries every
choice (`choices`). A choice that fails fails the request: its siblings are aborted. The worker, the
job and its cancel and recovery see one request.

With `best_of` > n, the sequences are best_of candidates, named and seeded as choices are, and once all have
ended the request returns the n whose generated tokens have the highest mean logprob (the logprobs as reported:
rqbatcher.schema.TokenLogprob), re-indexed 0..n-1, best first (OpenAI: "the one with the highest log probability
per token"). Scoring needs each token's logprob, so a candidate of a request that did not ask for logprobs
samples with `logprobs=0` (the chosen token's alone; only these rows pay for a log-softmax) and the answers lose
them. Such a request streams nothing: its candidates are not its answers, and the worker writes every output's
new tokens to the job's stream as a choice, so the candidates' outputs are held back and the last output carries
no new tokens, only the answers (`choices` when n > 1; the top-level fields hold the best) and
`completion_tokens`, every candidate's tokens, as OpenAI bills them. The gateway refuses `stream` with it. (The
worker's token counters, which count outputs' new tokens, therefore miss these requests' tokens.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from rqbatcher.schema import Choice, GenerationRequest, SamplingParams
from rqbatcher.workers.engine.api import RequestOutput

CHOICE_SEPARATOR = "#choice"
SEED_STRIDE = 0x9E3779B97F4A7C15  # choice i's seed is the request's plus i strides (mod 2**63)
SEED_MODULUS = 1 << 63
NATURAL_ENDS = ("stop", "length")  # a sequence's own ends; any other reason is an abort's (cancelled, timeout)
CHOSEN_TOKEN_ONLY = 0  # the `logprobs` a best_of candidate samples with when the request asked for none


def choice_seed(seed: int | None, index: int) -> int | None:
    return None if seed is None else (seed + index * SEED_STRIDE) % SEED_MODULUS


def mean_logprob(out: RequestOutput) -> float:
    """A best_of candidate's score: the mean logprob of its generated tokens (-inf without any)."""
    logprobs = out.logprobs or []
    return math.fsum(lp.logprob for lp in logprobs) / len(logprobs) if logprobs else -math.inf


@dataclass
class _Group:
    request_id: str
    live: list[str]  # the sequence ids of the choices still running
    ended: dict[int, RequestOutput] = field(default_factory=dict)
    n: int = 0  # the answers returned
    best_of: bool = False  # the sequences are candidates: the n best are returned at the end, nothing before
    strip_logprobs: bool = False  # the candidates' logprobs were for scoring only


class Choices:
    def __init__(self) -> None:
        self._groups: dict[str, _Group] = {}
        self._choice_of: dict[str, tuple[_Group, int]] = {}  # sequence id -> (its request's group, its index)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    @staticmethod
    def expand(request_id: str, request: GenerationRequest) -> list[tuple[str, SamplingParams]]:
        """(sequence id, sampling) of each choice or candidate; one sequence under the request's own id when the
        request generates one answer."""
        sampling = request.sampling
        if sampling.candidates == 1:
            return [(request_id, sampling)]
        scoring = sampling.candidates > sampling.n and sampling.logprobs is None
        extra = {"logprobs": CHOSEN_TOKEN_ONLY} if scoring else {}
        return [(f"{request_id}{CHOICE_SEPARATOR}{i}",
                 sampling.model_copy(update={"seed": choice_seed(sampling.seed, i), **extra}))
                for i in range(sampling.candidates)]

    def register(self, request_id: str, sequence_ids: list[str], sampling: SamplingParams) -> None:
        if len(sequence_ids) == 1:
            return
        best_of = sampling.candidates > sampling.n
        group = self._groups[request_id] = _Group(request_id, list(sequence_ids), n=sampling.n, best_of=best_of,
                                                  strip_logprobs=best_of and sampling.logprobs is None)
        for i, sequence_id in enumerate(sequence_ids):
            self._choice_of[sequence_id] = (group, i)

    def live(self, request_id: str) -> list[str]:
        """The sequence ids of a request's choices still running (the request's own id when it has one choice)."""
        group = self._groups.get(request_id)
        return [request_id] if group is None else list(group.live)

    def merge(self, outputs: list[RequestOutput], abort: Callable[[str], RequestOutput | None]) -> list[RequestOutput]:
        """The requests' outputs from their choices' outputs (`abort` ends a sequence: a failed choice's siblings)."""
        if not self._choice_of:  # no request of several sequences in the engine: every output is its request's own
            return outputs
        merged, aborted = [], set()
        for out in outputs:
            if out.request_id in aborted:  # a sibling of a failed choice, which produced before it was aborted
                continue
            link = self._choice_of.pop(out.request_id, None) if out.finished else self._choice_of.get(out.request_id)
            if link is None:
                if out.request_id not in self._groups:  # a request with one choice
                    merged.append(out)
                continue
            group, index = link
            if group.best_of:
                if not out.finished:
                    continue  # a candidate's tokens are not an answer's
                as_request = replace(out, request_id=group.request_id, new_token_ids=[], delta_text="",
                                     new_logprobs=None)
            else:
                as_request = replace(out, request_id=group.request_id, choice=index)
                if not out.finished:
                    merged.append(as_request)
                    continue
            group.live.remove(out.request_id)
            if out.error is not None:
                for sibling in list(group.live):
                    self._choice_of.pop(sibling, None)
                    aborted.add(sibling)
                    abort(sibling)
                del self._groups[group.request_id]
                merged.append(replace(as_request, logprobs=None) if group.best_of else as_request)
                continue
            group.ended[index] = out
            if group.live:
                if not group.best_of:
                    merged.append(replace(as_request, finish_reason=None))
                continue
            del self._groups[group.request_id]
            merged.append(_best_of(group, as_request) if group.best_of else replace(as_request, choices=[
                Choice(index=i, text=o.text, token_ids=o.token_ids, finish_reason=o.finish_reason,
                       stop_sequence=o.stop_sequence, logprobs=o.logprobs)
                for i, o in sorted(group.ended.items())]))
        return merged


def _best_of(group: _Group, last: RequestOutput) -> RequestOutput:
    """The request's last output from its ended candidates (`last`: the last to end, as the request): the n best
    by mean logprob, best first (ties in candidate order), and every candidate's tokens counted."""
    candidates = [o for _, o in sorted(group.ended.items())]
    ranked = sorted(candidates, key=mean_logprob, reverse=True)[:group.n]  # stable, reversed or not
    keep = not group.strip_logprobs
    best = ranked[0]
    firsts = [o.first_token_time for o in candidates if o.first_token_time is not None]
    choices = None if group.n == 1 else [
        Choice(index=i, text=o.text, token_ids=o.token_ids, finish_reason=o.finish_reason,
               stop_sequence=o.stop_sequence, logprobs=o.logprobs if keep else None) for i, o in enumerate(ranked)]
    natural = last.finish_reason in NATURAL_ENDS
    return replace(last, text=best.text, token_ids=best.token_ids, logprobs=best.logprobs if keep else None,
                   finish_reason=best.finish_reason if natural else last.finish_reason,
                   stop_sequence=best.stop_sequence if natural else None,
                   choices=choices, first_token_time=min(firsts, default=None),
                   completion_tokens=sum(len(o.token_ids) for o in candidates))
