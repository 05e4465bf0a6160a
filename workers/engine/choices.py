"""`n` choices of one request: the engine runs them as n sequences and reports them under the request's id.

`expand` names the sequences (`<id>#choice<i>`) and gives each its sampling: choice 0 keeps the request's seed,
choice i a seed derived from it, so a seeded request gets the same n answers wherever it runs. All n join
the scheduler together, so the prompt's full blocks are computed by one and found in the prefix cache by the
others. `merge` turns their outputs back into the request's: each output names its `choice`; a choice that
ends while others still run reports no finish reason yet, and the output of the last one to end carries every
choice (`choices`). A choice that fails fails the request: its siblings are aborted. The worker, the
job and its cancel and recovery see one request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from batcher.schema import Choice, GenerationRequest, SamplingParams
from workers.engine.api import RequestOutput

CHOICE_SEPARATOR = "#choice"
SEED_STRIDE = 0x9E3779B97F4A7C15  # choice i's seed is the request's plus i strides (mod 2**63)
SEED_MODULUS = 1 << 63


def choice_seed(seed: int | None, index: int) -> int | None:
    return None if seed is None else (seed + index * SEED_STRIDE) % SEED_MODULUS


@dataclass
class _Group:
    request_id: str
    live: list[str]  # the sequence ids of the choices still running
    ended: dict[int, RequestOutput] = field(default_factory=dict)
    n: int = 0


class Choices:
    def __init__(self) -> None:
        self._groups: dict[str, _Group] = {}
        self._choice_of: dict[str, tuple[_Group, int]] = {}  # sequence id -> (its request's group, its index)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    @staticmethod
    def expand(request_id: str, request: GenerationRequest) -> list[tuple[str, SamplingParams]]:
        """(sequence id, sampling) of each choice; one sequence under the request's own id when n is 1."""
        sampling = request.sampling
        if sampling.n == 1:
            return [(request_id, sampling)]
        return [(f"{request_id}{CHOICE_SEPARATOR}{i}",
                 sampling.model_copy(update={"seed": choice_seed(sampling.seed, i)})) for i in range(sampling.n)]

    def register(self, request_id: str, sequence_ids: list[str]) -> None:
        if len(sequence_ids) == 1:
            return
        group = self._groups[request_id] = _Group(request_id, list(sequence_ids), n=len(sequence_ids))
        for i, sequence_id in enumerate(sequence_ids):
            self._choice_of[sequence_id] = (group, i)

    def live(self, request_id: str) -> list[str]:
        """The sequence ids of a request's choices still running (the request's own id when it has one choice)."""
        group = self._groups.get(request_id)
        return [request_id] if group is None else list(group.live)

    def merge(self, outputs: list[RequestOutput], abort: Callable[[str], RequestOutput | None]) -> list[RequestOutput]:
        """The requests' outputs from their choices' outputs (`abort` ends a sequence: a failed choice's siblings)."""
        if not self._choice_of:  # no request with n > 1 in the engine: every output is its request's own
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
                merged.append(as_request)
                continue
            group.ended[index] = out
            if group.live:
                merged.append(replace(as_request, finish_reason=None))
                continue
            del self._groups[group.request_id]
            merged.append(replace(as_request, choices=[
                Choice(index=i, text=o.text, token_ids=o.token_ids, finish_reason=o.finish_reason, logprobs=o.logprobs)
                for i, o in sorted(group.ended.items())]))
        return merged
