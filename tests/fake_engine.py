"""The test suite's stand-in for rqbatcher.workers.engine.engine.Engine: the bench's engine without a model
(`tests.letter_engine`), plus the faults a test needs.

Each request generates one token per step: token i of the output is `FIRST_TOKEN + i`, whose text is
one letter; it serves embedding requests too (`tests.letter_engine.letter_vector`: EMBEDDING_SIZE numbers
from each input, and any shorter `dimensions`). A prompt containing "boom" fails in its first step, the way the
engine reports an exception inside one request's forward; a prompt of "too long" is refused by `add`
(unless it is only tokenized: a count is no generation).
"""

from __future__ import annotations

from dataclasses import replace

from rqbatcher.schema import GenerationRequest
from rqbatcher.workers.engine.api import EngineStats, Progress, RequestError, RequestOutput
from tests.letter_engine import FIRST_TOKEN, LetterEngine

VOCAB_SIZE = 256  # what it publishes: its tokens are letters
MAX_MODEL_LEN = 512  # what it publishes, and its refusal of a prompt "too long" says


class FakeEngine(LetterEngine):
    def __init__(self, max_num_seqs: int = 4) -> None:
        super().__init__(max_num_seqs, name="fake-model", embeds=True)
        self.added: list[str] = []
        self.resumed: dict[str, int] = {}  # request id -> the tokens it went on from

    def add(self, request_id: str, request: GenerationRequest, arrival_time: float | None = None,
            progress: dict[int, Progress] | None = None) -> None:
        if request.prompt == "too long" and not request.tokenize_only:
            raise RequestError(f"the prompt has 9999 tokens; this model's context is {MAX_MODEL_LEN}")
        super().add(request_id, request, arrival_time, progress)
        self.added.append(request_id)
        if progress:
            self.resumed[request_id] = len(progress[0].token_ids)

    def stats(self) -> EngineStats:
        return replace(super().stats(), vocab_size=VOCAB_SIZE, max_model_len=MAX_MODEL_LEN)

    def advance(self, request_id, req) -> RequestOutput:
        if "boom" in (req.request.prompt or ""):
            del self.requests[request_id]
            return self.output(request_id, req, [], error="RuntimeError: boom in the forward")
        return super().advance(request_id, req)


def expected_text(max_tokens: int) -> str:
    return "".join(chr(FIRST_TOKEN + i) for i in range(max_tokens))
