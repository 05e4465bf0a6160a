"""Which tool-call format the served model writes (rqbatcher.tools.formats), found once at load: a conversation
with one call is rendered through the chat template, and the family whose call text appears in what the call added
names the format. A template without tools, or one that refuses the probe, gets the fallback (our own prompt).

The family's markers that the tokenizer holds as special tokens (`<tool_call>`, `[TOOL_CALLS]`...) are then tokens
in the grammar, as the model writes them, and the detokenizer keeps them in the text the readers see."""

from __future__ import annotations

import re

from rqbatcher.tools.formats import (
    ARGS,
    BATCHER,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    MISTRAL_ARGS,
    TOOL_CALL_OPEN,
    TOOL_CALLS,
    ToolFormat,
    tool_format,
)
from rqbatcher.tools.prompt import template_reads_tools

PROBE_NAME = "probe_function"
PROBE_CALL_ID = "probe0001"  # nine characters: Mistral's templates refuse other ids
PROBE_TOOL = {"type": "function", "function": {"name": PROBE_NAME, "description": "a probe",
                                               "parameters": {"type": "object", "properties": {
                                                   "probe_argument": {"type": "integer"}}}}}
PROBE_ASK = {"role": "user", "content": "probe"}
PROBE_CALL = {"role": "assistant", "content": "", "tool_calls": [{
    "id": PROBE_CALL_ID, "type": "function", "function": {"name": PROBE_NAME, "arguments": {"probe_argument": 1}}}]}
LLAMA3_CALL = re.compile(r'\{\s*"name"\s*:\s*"' + PROBE_NAME + r'"\s*,\s*"parameters"\s*:')


def tool_format_name(tokenizer) -> str:
    """The name of the format `tokenizer`'s chat template writes calls in (the fallback's if none is found)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template or not template_reads_tools(template):
        return BATCHER
    try:
        asked = tokenizer.apply_chat_template([PROBE_ASK], tools=[PROBE_TOOL], tokenize=False)
        called = tokenizer.apply_chat_template([PROBE_ASK, PROBE_CALL], tools=[PROBE_TOOL], tokenize=False)
    except Exception:  # noqa: BLE001  (a template that refuses the probe: jinja's own errors)
        return BATCHER
    call = called[_common_prefix(asked, called):]
    if PROBE_NAME not in call:
        return BATCHER
    if TOOL_CALLS in call:
        return MISTRAL_ARGS if ARGS in call else MISTRAL
    if TOOL_CALL_OPEN in call:
        return HERMES
    return LLAMA3_JSON if LLAMA3_CALL.search(call) else BATCHER


def served_tool_format(tokenizer, name: str) -> ToolFormat:
    """The format named `name`, with the ids of its markers that `tokenizer` holds as special tokens."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {})
    special = {token.content: token_id for token_id, token in decoder.items() if getattr(token, "special", False)}
    return tool_format(name).with_special_ids(special)


def _common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
