"""What a chat template is given for a request with tools, or with tool calls and results in its history.

A template with tool support (its source reads `tools`: Qwen2.5, Llama 3.1, Mistral, Hermes...) gets the tools
and the messages in transformers' shape: an assistant's calls as `tool_calls` with their arguments as objects,
and each result as a `tool` message. A template without it gets the fallback: a system prompt that lists the
tools and shows the call format (batcher/tools/grammar.py), the calls written into the assistant's text, and
each result as a user message in `<tool_response>` tags; consecutive messages of one role are then joined,
since many templates insist that roles alternate.

With `tool_choice: none` the tools are not shown: the model answers in text, and the grammar enforces nothing.
"""

from __future__ import annotations

import json

from rqbatcher.schema import ChatMessage, GenerationRequest
from rqbatcher.tools.definitions import Tool, effective_choice
from rqbatcher.tools.grammar import call_text

RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>\n", "\n</tool_response>"
FALLBACK_PROMPT = """You can call functions to answer. Here they are, each as a JSON object:
<tools>
{tools}
</tools>
To call a function, answer with nothing but the call{plural}, each written as:
<tool_call>
{{"name": "<the function's name>", "arguments": <the arguments, as a JSON object>}}
</tool_call>
The results come back in <tool_response> tags."""


def template_reads_tools(chat_template) -> bool:
    """Whether a tokenizer's chat template (a string, or a dict of named templates) renders `tools`."""
    templates = chat_template.values() if isinstance(chat_template, dict) else [chat_template or ""]
    return any("tools" in t for t in templates)


def chat_inputs(request: GenerationRequest, template_has_tools: bool) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for `apply_chat_template(messages, tools=tools, ...)`, as transformers takes them."""
    shown = request.tools if request.tools and effective_choice(request.tools, request.tool_choice) != "none" else None
    names = _call_names(request.messages)
    if template_has_tools:
        return [_native(m, names) for m in request.messages], _tool_dicts(shown) if shown else None
    messages = [_fallback(m) for m in request.messages]
    if shown:
        prompt = FALLBACK_PROMPT.format(tools="\n".join(json.dumps(t) for t in _tool_dicts(shown)),
                                        plural="s, one after the other" if request.parallel_tool_calls else "")
        messages.insert(0, {"role": "system", "content": prompt})
    return _joined(messages), None


def _tool_dicts(tools: list[Tool]) -> list[dict]:
    return [t.model_dump(exclude_none=True) for t in tools]


def _call_names(messages: list[ChatMessage]) -> dict[str, str]:
    """The function each call id called, for the `tool` messages that answer them."""
    return {call.id: call.function.name for m in messages for call in m.tool_calls or ()}


def _native(message: ChatMessage, names: dict[str, str]) -> dict:
    shaped = {"role": message.role, "content": message.content or ""}
    if message.tool_calls:
        shaped["tool_calls"] = [{"id": c.id, "type": "function",
                                 "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)}}
                                for c in message.tool_calls]
    if message.role == "tool":
        shaped.update(tool_call_id=message.tool_call_id, name=names.get(message.tool_call_id, ""))
    return shaped


def _fallback(message: ChatMessage) -> dict:
    if message.role == "tool":
        return {"role": "user", "content": f"{RESPONSE_OPEN}{message.content}{RESPONSE_CLOSE}"}
    content = message.content or ""
    if message.tool_calls:
        calls = "".join(call_text(c.function.name, c.function.arguments) for c in message.tool_calls)
        content = f"{content}\n{calls}" if content else calls
    return {"role": message.role, "content": content}


def _joined(messages: list[dict]) -> list[dict]:
    joined: list[dict] = []
    for message in messages:
        if joined and joined[-1]["role"] == message["role"]:
            joined[-1] = {**joined[-1], "content": joined[-1]["content"] + "\n" + message["content"]}
        else:
            joined.append(message)
    return joined
