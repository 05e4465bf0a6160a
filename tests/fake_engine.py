"""A stand-in for workers.engine.Engine (it satisfies workers.engine_api.EngineProtocol) with no model.

Each request generates one token per step: token i of the output is `FIRST_TOKEN + i`, whose text is
one letter. A prompt containing "boom" fails in its first step, the way the engine reports an
exception inside one request's forward; a prompt of "too long" is refused by `add`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import SimpleNamespace

from batcher.blocks import PrefixCacheStats
from batcher.scheduler import Sequence
from batcher.schema import GenerationRequest
from workers.engine_api import RequestError, RequestOutput, StepStats

FIRST_TOKEN = 65  # "A"


@dataclass
class _Request:
    request: GenerationRequest
    seq: Sequence

    @property
    def token_ids(self) -> list[int]:
        return self.seq.output_token_ids


class FakeEngine:
    def __init__(self, max_num_seqs: int = 4) -> None:
        self.loaded = SimpleNamespace(name="fake-model")
        self.max_num_seqs = max_num_seqs
        self.step_index = 0
        self.last_step: StepStats | None = None
        self.added: list[str] = []
        self._requests: dict[str, _Request] = {}
        self._prefix_cache_stats = PrefixCacheStats()

    def add(self, request_id: str, request: GenerationRequest, arrival_time: float | None = None) -> Sequence:
        if request.prompt == "too long":
            raise RequestError("the prompt has 9999 tokens; this model's context is 512")
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already in the engine")
        prompt_len = len(request.prompt_token_ids or request.prompt or "x")
        seq = Sequence(request_id, [0] * prompt_len, request.sampling,
                       arrival_time=time.monotonic() if arrival_time is None else arrival_time)
        self._requests[request_id] = _Request(request, seq)
        self.added.append(request_id)
        return seq

    def has_work(self) -> bool:
        return bool(self._requests)

    @property
    def free_slots(self) -> int:
        return max(0, self.max_num_seqs - len(self._requests))

    @property
    def urgent_room(self) -> int:
        return 0  # no preemption: the fake takes only what its slots hold

    @property
    def batch_deficit(self) -> int:
        return 0

    @property
    def urgency_preemptions(self) -> dict[str, int]:
        return {}

    @property
    def num_running(self) -> int:
        return len(self._requests)

    @property
    def num_waiting(self) -> int:
        return 0

    @property
    def kv_cache_usage(self) -> float:
        return len(self._requests) / self.max_num_seqs

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self._prefix_cache_stats

    @property
    def dtype(self) -> str:
        return "float32"

    def step(self) -> list[RequestOutput]:
        outputs = []
        for request_id, req in list(self._requests.items()):
            if "boom" in (req.request.prompt or ""):
                del self._requests[request_id]
                outputs.append(self._output(request_id, req, [], error="RuntimeError: boom in the forward"))
                continue
            token = FIRST_TOKEN + len(req.token_ids)
            req.seq.token_ids.append(token)
            req.seq.first_token_time = req.seq.first_token_time or time.monotonic()
            req.seq.last_token_time = time.monotonic()
            reason = "length" if len(req.token_ids) >= req.request.sampling.max_tokens else None
            if reason:
                del self._requests[request_id]
            outputs.append(self._output(request_id, req, [token], finish_reason=reason))
        self.last_step = StepStats(step=self.step_index, num_seqs=len(outputs), num_tokens=len(outputs),
                                   num_prefill_tokens=0, num_preempted=0, duration_s=0.0)
        self.step_index += 1
        return outputs

    def abort(self, request_id: str, reason: str = "cancelled") -> RequestOutput | None:
        req = self._requests.pop(request_id, None)
        return None if req is None else self._output(request_id, req, [], finish_reason=reason)

    @staticmethod
    def _output(request_id, req, new, finish_reason=None, error=None) -> RequestOutput:
        return RequestOutput(request_id=request_id, new_token_ids=new, delta_text="".join(map(chr, new)),
                             text="".join(map(chr, req.token_ids)), token_ids=list(req.token_ids),
                             num_prompt_tokens=req.seq.num_prompt_tokens, finish_reason=finish_reason, error=error)


def expected_text(max_tokens: int) -> str:
    return "".join(chr(FIRST_TOKEN + i) for i in range(max_tokens))
