"""The calls read back out of an answer's text, whole or as it streams, in the served model's tool-call format.

The format (batcher/tools/formats.py, named by the worker's `ChatFormat`) says where calls begin: at its marker
(`<tool_call>`, `[TOOL_CALLS]`; the text before it is content), or, for a family whose calls are bare JSON, at the
answer's start. From there the answer is calls: each one's head (its name, up to its arguments) is found, then its
arguments object is read to its closing bracket, whatever comes between calls (end tags, separators) skipped.
`CallReader` is fed the text as it arrives and returns what can be sent: content, or OpenAI's `tool_calls` deltas
(a call's id and name first, then its arguments in pieces), several calls included. A call cut short by
`max_tokens` has streamed the arguments written so far (its answer ends with `length`, as OpenAI's does); a whole
answer keeps it only if its arguments were closed, and leaves it out otherwise.

Call ids are derived from the job's id, the choice and the call's position, so a streamed answer, the final
answer and a restarted job all give the same ids.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field

from rqbatcher.schema import ChatFormat, GenerationRequest
from rqbatcher.tools.formats import ToolFormat, tool_format

CALL_ID_PREFIX = "call_"
CALL_ID_DIGEST_CHARS = 24
MAX_HEAD_CHARS = 256  # a call's head (its name, up to its arguments) longer than this is not one
OPENING_BRACKETS, CLOSING_BRACKETS = "{[", "}]"
SPACE_AFTER_BRACE = re.compile(r"^\{\s*")


def answer_format(request: GenerationRequest, served: ChatFormat) -> ChatFormat | None:
    """The format a job's answer is read in: the served model's for a chat job (the worker puts it on the job's
    `start` event and its result), None for a completion, which is read as text."""
    return served if request.messages is not None or request.chat else None


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
class _Arguments:
    """Where an arguments object ends: its brackets counted outside strings."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def end_in(self, text: str, start: int) -> int:
        """The index just past the object's closing bracket in `text[start:]`, or -1 if it is not there yet."""
        for i in range(start, len(text)):
            char = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in OPENING_BRACKETS:
                self.depth += 1
            elif char in CLOSING_BRACKETS:
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return -1


@dataclass
class CallReader:
    """Reads one choice's answer. `reads_calls` is False when the request's tools are off (`none`, or no tools):
    everything is then content. `chat_format` is the worker's (None: the fallback format)."""

    job_id: str
    choice: int = 0
    reads_calls: bool = True
    chat_format: ChatFormat | None = None
    calls: list[Call] = field(default_factory=list)
    _text: str = ""  # everything fed
    _at: int = 0  # where the unread part of `_text` starts
    _mode: str | None = None  # "text" or "calls", once that is known
    _arguments: _Arguments | None = None  # of the call being read

    @property
    def format(self) -> ToolFormat:
        return tool_format(self.chat_format.tools if self.chat_format is not None else None)

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        """Content and call pieces that `text` completes."""
        self._text += text
        content = "" if self._mode == "calls" else self._read_content()
        return content, self._read_calls() if self._mode == "calls" else []

    def finish(self) -> tuple[str, list[CallDelta]]:
        """What is left when the answer ends: held-back text, or the arguments of a call cut short."""
        if self._mode == "calls":
            return "", self._read_calls()
        content, self._at = self._text[self._at:], len(self._text)
        return content, []

    @property
    def made_calls(self) -> bool:
        return self._mode == "calls"

    def _read_content(self) -> str:
        """Content up to where calls begin (then in "calls" mode), less an end that may still begin them."""
        fmt, rest = self.format, self._text[self._at:]
        if not self.reads_calls or self._mode == "text":
            self._at = len(self._text)
            return rest
        if not fmt.anywhere:  # calls only at the answer's start: decided once its first characters tell
            opening = SPACE_AFTER_BRACE.sub("{", rest.lstrip())
            if any(opening.startswith(s) for s in fmt.starts):
                self._mode = "calls"
                return ""
            if opening and not any(s.startswith(opening) for s in fmt.starts):
                self._mode = "text"
                self._at = len(self._text)
                return rest
            return ""
        found = [at for s in fmt.starts if (at := rest.find(s)) >= 0]
        if found:
            self._mode = "calls"
            self._at += min(found)
            return rest[:min(found)]
        upto = len(rest) - max((n for s in fmt.starts for n in range(len(s) - 1, 0, -1) if rest.endswith(s[:n])),
                               default=0)
        self._at += upto
        return rest[:upto]

    def _read_calls(self) -> list[CallDelta]:
        deltas = []
        while True:
            if self._arguments is None:
                head = self.format.head.search(self._text, self._at)
                if head is None or head.start() - self._at > MAX_HEAD_CHARS:
                    return deltas
                name = _unescaped(head["name"])
                call = Call(call_id(self.job_id, self.choice, len(self.calls)), name)
                self.calls.append(call)
                deltas.append(CallDelta(len(self.calls) - 1, "", call.id, name))
                self._at, self._arguments = head.end(), _Arguments()
            call = self.calls[-1]
            end = self._arguments.end_in(self._text, self._at)
            piece = self._text[self._at:end if end >= 0 else len(self._text)]
            self._at += len(piece)
            call.arguments += piece
            if piece:
                deltas.append(CallDelta(len(self.calls) - 1, piece))
            if end < 0:
                return deltas
            call.complete, self._arguments = _is_json(call.arguments), None


def _unescaped(name: str) -> str:
    """A name as JSON text writes it (a model's bad escape kept as written)."""
    try:
        return json.loads(f'"{name}"')
    except ValueError:
        return name


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def read_answer(text: str, job_id: str, choice: int = 0, reads_calls: bool = True,
                chat_format: ChatFormat | None = None) -> tuple[str | None, list[Call]]:
    """A whole answer: (content, complete calls); content is None when the answer is calls alone. A call cut short
    (by max_tokens) is left out: a whole answer holds only calls whose arguments are whole."""
    reader = CallReader(job_id, choice, reads_calls, chat_format)
    content, _ = reader.feed(text)
    more, _ = reader.finish()
    content += more
    if reader.made_calls:
        return content.strip() or None, [call for call in reader.calls if call.complete]
    return content, []
