"""Tool-call formats by model family: the exact text each family's chat template writes a call in, so the grammar
(batcher/tools/grammar.py) makes a model write calls as it was trained to, and the reader (batcher/tools/calls.py)
reads them back. The worker finds its model's format (workers/engine/tool_format_probe.py) and names it in
`ChatFormat.tools`; a name this module does not know reads as the fallback.

- `batcher`: a template without tools gets our fallback prompt, which shows this format (calls one right after
  the other, only at the answer's start);
- `hermes` (Qwen2.5/3, Hermes): `<tool_call>\\n{"name": .., "arguments": {..}}\\n</tool_call>`, calls joined by a
  newline; the tags are often single special tokens;
- `llama3_json` (Llama 3.1-3.3): `{"name": .., "parameters": {..}}`, calls joined by `; ` (vLLM's parser);
  an answer is calls when it begins with `{"name"` (or `<|python_tag|>`);
- `mistral`: `[TOOL_CALLS][{"name": .., "arguments": {..}}, ..]`;
- `mistral_args` (newer Mistral tokenizers, with `[ARGS]`): `[TOOL_CALLS]name[ARGS]{..}` for each call.

A call's arguments are always one JSON object, so where they end is found by counting brackets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

BATCHER, HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_ARGS = "batcher", "hermes", "llama3_json", "mistral", "mistral_args"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
# A call as a JSON object: its name, then its arguments (or Llama's `parameters`), up to the arguments' `{`
JSON_HEAD = re.compile(r'\{\s*"name"\s*:\s*"(?P<name>(?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
ARGS_HEAD = re.compile(r"\[TOOL_CALLS\]\s*(?P<name>[A-Za-z0-9_-]+)\s*\[ARGS\]\s*(?=\{)")
JSON_CALL_START = '{"name"'


@dataclass(frozen=True)
class ToolFormat:
    """One family's calls: `begin`, then each call (`before_name`, the name, `after_name`, the arguments object,
    `after_arguments`) with `separator` between calls, then `end`."""

    name: str
    before_name: str
    after_name: str
    after_arguments: str
    separator: str = ""
    begin: str = ""
    end: str = ""
    starts: tuple[str, ...] = ()  # texts that begin the calls; the text before them is content
    anywhere: bool = True  # calls may follow content (else: only at the answer's start, after whitespace)
    head: re.Pattern = JSON_HEAD  # a call up to its arguments, read back
    markers: tuple[str, ...] = ()  # texts a tokenizer may hold as single special tokens
    special_ids: dict[str, int] = field(default_factory=dict)  # of those markers, in the served tokenizer

    def call_text(self, name: str, arguments: str) -> str:
        """One call as the family writes it (alone in its answer)."""
        return f"{self.begin}{self.call_prefix(name)}{arguments}{self.after_arguments}{self.end}"

    def call_prefix(self, name: str) -> str:
        return f"{self.before_name}{name}{self.after_name}"

    def with_special_ids(self, ids: dict[str, int]) -> ToolFormat:
        """This format in a tokenizer that holds some of its markers as special tokens (text -> token id)."""
        return replace(self, special_ids={m: ids[m] for m in self.markers if m in ids})


_HERMES_PIECES = dict(before_name=f'{TOOL_CALL_OPEN}\n{{"name": "', after_name='", "arguments": ',
                      after_arguments=f"}}\n{TOOL_CALL_CLOSE}", starts=(TOOL_CALL_OPEN,),
                      markers=(TOOL_CALL_OPEN, TOOL_CALL_CLOSE))
FORMATS = {f.name: f for f in (
    ToolFormat(BATCHER, anywhere=False, **_HERMES_PIECES),
    ToolFormat(HERMES, separator="\n", **_HERMES_PIECES),
    ToolFormat(LLAMA3_JSON, '{"name": "', '", "parameters": ', "}", separator="; ", anywhere=False,
               starts=(JSON_CALL_START, PYTHON_TAG), markers=(PYTHON_TAG,)),
    ToolFormat(MISTRAL, '{"name": "', '", "arguments": ', "}", separator=", ", begin=f"{TOOL_CALLS}[", end="]",
               starts=(TOOL_CALLS,), markers=(TOOL_CALLS,)),
    ToolFormat(MISTRAL_ARGS, TOOL_CALLS, ARGS, "", starts=(TOOL_CALLS,), head=ARGS_HEAD, markers=(TOOL_CALLS, ARGS)),
)}
DEFAULT_FORMAT = FORMATS[BATCHER]


def tool_format(name: str | None) -> ToolFormat:
    """The format named `name` (a worker's `ChatFormat.tools`); the fallback for None or a name unknown here."""
    return FORMATS.get(name or BATCHER, DEFAULT_FORMAT)
