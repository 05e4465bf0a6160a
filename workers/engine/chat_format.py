"""The served model's chat format: how it writes tool calls and marks its reasoning, found once at load from its
chat template and tokenizer (rqbatcher.schema.ChatFormat)."""

from __future__ import annotations

from rqbatcher.schema import ChatFormat
from rqbatcher.workers.engine.reasoning_probe import reasoning_format_of
from rqbatcher.workers.engine.tool_format_probe import tool_format_name


def chat_format_of(tokenizer) -> ChatFormat:
    """The format of `tokenizer`'s chat answers."""
    return ChatFormat(tools=tool_format_name(tokenizer), reasoning=reasoning_format_of(tokenizer))

