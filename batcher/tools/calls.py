"""The calls read back out of an answer's text, whole or as it streams.

The grammar (batcher/tools/grammar.py) makes an answer either text without the call marker, or calls written in
one exact format; so the first characters tell which it is, and a call's arguments are the text between its
fixed prefix and its fixed end. `CallReader` is fed the text as it arrives and returns what can be sent: content,
or OpenAI's `tool_calls` deltas (a call's id and name first, then its arguments in pieces). A call cut short by
`max_tokens` has streamed the arguments written so far (its answer ends with `length`, as OpenAI's does); a
whole answer keeps it only if its arguments were closed (cut inside the end tag), and leaves it out otherwise.

Call ids are derived from the job's id, the choice and the call's position, so a streamed answer, the final
answer and a restarted job all give the same ids.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from rqbatcher.tools.grammar import ARGUMENTS_CLOSE, ARGUMENTS_OPEN, CALL_CLOSE, CALL_OPEN, NAME_OPEN

CALL_ID_PREFIX = "call_"
CALL_ID_DIGEST_CHARS = 24
_END = ARGUMENTS_CLOSE + CALL_CLOSE  # arguments hold no raw newline (JSON without whitespace): found at the end only
_HEAD = CALL_OPEN + NAME_OPEN


def call_id(job_id: str, choice: int, index: int) -> str:
    digest = hashlib.sha256(f"{job_id}:{choice}:{index}".encode()).hexdigest()
    return CALL_ID_PREFIX + digest[:CALL_ID_DIGEST_CHARS]


@dataclass
class CallDelta:
    """A piece of one call, as OpenAI's streamed `tool_calls` item: id and name on the call's first piece."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_dict(self) -> dict:
        function = {"arguments": self.arguments} if self.name is None else {"name": self.name,
                                                                             "arguments": self.arguments}
        item = {"index": self.index, "function": function}
        return item if self.id is None else {"index": self.index, "id": self.id, "type": "function", **item}


@dataclass
class Call:
    id: str
    name: str
    arguments: str = ""
    complete: bool = False

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class CallReader:
    """Reads one choice's answer. `reads_calls` is False when the request's tools are off (`none`, or no tools):
    everything is then content."""

    job_id: str
    choice: int = 0
    reads_calls: bool = True
    calls: list[Call] = field(default_factory=list)
    _text: str = ""  # everything fed
    _at: int = 0  # where the unread part of `_text` starts
    _mode: str | None = None  # "text" or "calls", once the first characters tell

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        """Content and call pieces that `text` completes."""
        self._text += text
        if self._mode is None:
            if not self.reads_calls or not (self._text.startswith(CALL_OPEN) or CALL_OPEN.startswith(self._text)):
                self._mode = "text"
            elif self._text.startswith(CALL_OPEN):
                self._mode = "calls"
            else:
                return "", []  # could still become a call
        if self._mode == "text":
            content, self._at = self._text[self._at:], len(self._text)
            return content, []
        return "", self._read_calls(final=False)

    def finish(self) -> tuple[str, list[CallDelta]]:
        """What is left when the answer ends: held-back text, or the arguments of a call cut short."""
        if self._mode == "calls":
            return "", self._read_calls(final=True)
        content, self._at = self._text[self._at:], len(self._text)
        return content, []

    @property
    def made_calls(self) -> bool:
        return self._mode == "calls"

    def _read_calls(self, final: bool) -> list[CallDelta]:
        deltas = []
        while True:
            open_call = self.calls[-1] if self.calls and not self.calls[-1].complete else None
            if open_call is None:
                rest = self._text[self._at:]
                end_of_name = rest.find(ARGUMENTS_OPEN, len(_HEAD))
                if not rest.startswith(_HEAD) or end_of_name < 0:
                    return deltas
                name = rest[len(_HEAD):end_of_name]
                open_call = Call(call_id(self.job_id, self.choice, len(self.calls)), name)
                self.calls.append(open_call)
                deltas.append(CallDelta(len(self.calls) - 1, "", open_call.id, name))
                self._at += end_of_name + len(ARGUMENTS_OPEN)
            end = self._text.find(_END, self._at)
            upto = end if end >= 0 else (_without_partial_end(self._text) if final
                                         else max(self._at, len(self._text) - len(_END) + 1))
            piece, self._at = self._text[self._at:upto], max(self._at, upto)
            open_call.arguments += piece
            if piece:
                deltas.append(CallDelta(len(self.calls) - 1, piece))
            if end < 0:
                if final:  # cut short: whole if its arguments are (the grammar closes them only when they validate)
                    open_call.complete = _is_json(open_call.arguments)
                return deltas
            open_call.complete = True
            self._at = end + len(_END)


def _without_partial_end(text: str) -> int:
    """Where `text` ends, less a beginning of the call's end it ends with (an answer cut inside it)."""
    for size in range(len(_END) - 1, 0, -1):
        if text.endswith(_END[:size]):
            return len(text) - size
    return len(text)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def read_answer(text: str, job_id: str, choice: int = 0, reads_calls: bool = True) -> tuple[str | None, list[Call]]:
    """A whole answer: (content, complete calls); content is None when the answer is calls. A call cut short (by
    max_tokens) is left out: a whole answer holds only calls whose arguments follow their schema."""
    reader = CallReader(job_id, choice, reads_calls)
    content, _ = reader.feed(text)
    more, _ = reader.finish()
    if reader.made_calls:
        return None, [call for call in reader.calls if call.complete]
    return content + more, []
