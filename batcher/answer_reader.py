"""A chat answer read as its model writes it: the reasoning split off first (batcher/reasoning.py), the rest read
for tool calls (batcher/tools/calls.py). Every door reads its answers here: streamed (chat chunks, Responses and
Messages events) through an `AnswerReader`, whole (chat and Responses objects, batch lines, Messages) through
`read_whole`."""

from __future__ import annotations

from rqbatcher.reasoning import ReasoningSplitter, split_answer, thinking_enabled
from rqbatcher.schema import ChatFormat, GenerationRequest
from rqbatcher.tools.calls import Call, CallDelta, CallReader, read_answer


class AnswerReader:
    """Fed one answer's text deltas; returns (reasoning, content, call pieces) for each. The format is known once
    the job's `start` event names it (`read_as`); until then the text is read as the fallback's, without reasoning."""

    def __init__(self, job_id: str, choice: int, request: GenerationRequest) -> None:
        self.thinking = thinking_enabled(request.chat_template_kwargs)
        self.calls = CallReader(job_id, choice, request.calls_tools)
        self.splitter = ReasoningSplitter(None)

    def read_as(self, chat_format: ChatFormat) -> None:
        """Read as the model writes (a rerun's `start` names the same format: reading goes on where it was)."""
        self.calls.chat_format = chat_format
        if self.splitter.format is None:
            self.splitter = ReasoningSplitter(chat_format.reasoning, self.thinking)

    @property
    def made_calls(self) -> bool:
        return self.calls.made_calls

    def feed(self, text: str) -> tuple[str, str, list[CallDelta]]:
        reasoning, rest = self.splitter.feed(text)
        content, calls = self.calls.feed(rest) if rest else ("", [])
        return reasoning, content, calls

    def finish(self) -> tuple[str, str, list[CallDelta]]:
        """What was held back once the answer has ended (a cut inside a marker, the arguments of a call cut short)."""
        reasoning, rest = self.splitter.finish()
        content, calls = self.calls.feed(rest) if rest else ("", [])
        more, more_calls = self.calls.finish()
        return reasoning, content + more, calls + more_calls


def read_whole(text: str, job_id: str, choice: int, request: GenerationRequest | None,
               chat_format: ChatFormat | None) -> tuple[str | None, str | None, list[Call]]:
    """A whole answer: (its reasoning, None if it wrote none; its content, None if it made calls; its complete
    calls). The reasoning is split off unless the request turned thinking off; calls are read if it gave tools."""
    thinking = request is None or thinking_enabled(request.chat_template_kwargs)
    reasoning, answer = split_answer(text, None if chat_format is None else chat_format.reasoning, thinking)
    content, calls = read_answer(answer, job_id, choice, request is not None and request.calls_tools, chat_format)
    return reasoning, content, calls
