"""A stand-in for workers.engine.Engine with the same add/step/abort API and no model.

Each request generates one token per step: token i of the output is `FIRST_TOKEN + i`, whose text is
one letter. A prompt containing "boom" fails in its first step, the way the engine reports an
exception inside one request's forward; a prompt of "too long" is refused by `add`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from batcher.schema import GenerationRequest
from workers.engine import RequestError, RequestOutput

FIRST_TOKEN = 65  # "A"


@dataclass
class _Request:
    request: GenerationRequest
    num_prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)


class FakeEngine:
    def __init__(self, max_num_seqs: int = 4) -> None:
        self.loaded = SimpleNamespace(name="fake-model")
        self.max_num_seqs = max_num_seqs
        self.step_index = 0
        self.added: list[str] = []
        self._requests: dict[str, _Request] = {}

    def add(self, request_id: str, request: GenerationRequest, arrival_time: float | None = None) -> _Request:
        if request.prompt == "too long":
            raise RequestError("the prompt has 9999 tokens; this model's context is 512")
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already in the engine")
        prompt_len = len(request.prompt_token_ids or request.prompt or "x")
        self._requests[request_id] = _Request(request, prompt_len)
        self.added.append(request_id)
        return self._requests[request_id]

    def has_work(self) -> bool:
        return bool(self._requests)

    @property
    def free_slots(self) -> int:
        return max(0, self.max_num_seqs - len(self._requests))

    @property
    def kv_cache_usage(self) -> float:
        return len(self._requests) / self.max_num_seqs

    def step(self) -> list[RequestOutput]:
        outputs = []
        for request_id, req in list(self._requests.items()):
            if "boom" in (req.request.prompt or ""):
                del self._requests[request_id]
                outputs.append(self._output(request_id, req, [], error="RuntimeError: boom in the forward"))
                continue
            token = FIRST_TOKEN + len(req.token_ids)
            req.token_ids.append(token)
            reason = "length" if len(req.token_ids) >= req.request.sampling.max_tokens else None
            if reason:
                del self._requests[request_id]
            outputs.append(self._output(request_id, req, [token], finish_reason=reason))
        self.step_index += 1
        return outputs

    def abort(self, request_id: str, reason: str = "cancelled") -> RequestOutput | None:
        req = self._requests.pop(request_id, None)
        return None if req is None else self._output(request_id, req, [], finish_reason=reason)

    @staticmethod
    def _output(request_id, req, new, finish_reason=None, error=None) -> RequestOutput:
        return RequestOutput(request_id=request_id, new_token_ids=new, delta_text="".join(map(chr, new)),
                             text="".join(map(chr, req.token_ids)), token_ids=list(req.token_ids),
                             num_prompt_tokens=req.num_prompt_tokens, finish_reason=finish_reason, error=error)


def expected_text(max_tokens: int) -> str:
    return "".join(chr(FIRST_TOKEN + i) for i in range(max_tokens))
