"""The items of OpenAI's Responses API in batcher's chat shapes, both ways.

In: a request's `input` (a string, or messages, `function_call` and `function_call_output` items) becomes
ChatMessages (a call becomes an assistant's `tool_calls`, its output a `tool` message); its flat function `tools`,
`tool_choice` and `text.format` become the Chat Completions shapes batcher's schema reads. Out: an answer becomes
output items (one `message` with an `output_text` part, or `function_call` items), read with the same CallReader
as chat answers, so call ids are the same in a stream, a retrieved response and a rerun job. A thinking model's
reasoning comes first, as a `reasoning` item (batcher/reasoning.py); a client that sends reasoning items back in its
input has them dropped, as the templates drop an earlier turn's reasoning.

Item ids derive from the job id, so that the streamed events and the stored response name the same items.
"""

from __future__ import annotations

import hashlib
from typing import Any

from rqbatcher.answer_reader import read_whole
from rqbatcher.errors import quoted
from rqbatcher.openai.body_fields import VERBOSITIES
from rqbatcher.openai.generation_body import BodyError
from rqbatcher.schema import ChatMessage, GenerationRequest, GenerationResult
from rqbatcher.tools.calls import CALL_ID_PREFIX
from rqbatcher.tools.definitions import NamedToolChoice

INPUT = "input"  # the field named by a fault in an input item
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text")  # the parts the model can read; images, files and audio it cannot
# Fields a client copies back from an output item (or sets on its own items) that change nothing here
MESSAGE_KEYS = {"type", "role", "content", "id", "status", "phase"}
PART_KEYS = {"type", "text", "annotations", "logprobs"}
CALL_KEYS = {"type", "call_id", "name", "arguments", "id", "status"}
CALL_OUTPUT_KEYS = {"type", "call_id", "output", "id", "status"}
TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}
ITEM_ID_DIGEST_CHARS = 32
MESSAGE_ITEM_PREFIX = "msg_"
CALL_ITEM_PREFIX = "fc_"
CALL_OUTPUT_ITEM_PREFIX = "fco_"
REASONING_ITEM_PREFIX = "rs_"
INCOMPLETE_FINISHES = ("length", "timeout")  # an answer cut short by a limit the request set


# ----- input -----
def input_messages(value: Any) -> list[dict]:
    """The messages (dicts, for GenerationRequest to validate) of a request's `input`: consecutive
    `function_call` items become one assistant message that makes those calls."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise BodyError("input is a string or a non-empty list of input items", param=INPUT)
    messages: list[dict] = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise BodyError(f"input[{i}] is an object", param=INPUT)
        kind = item.get("type") or "message"
        if kind == "message":
            messages.append(_message(item, i))
        elif kind == "function_call":
            call = _call(item, i)
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("content") is None:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "tool_calls": [call]})
        elif kind == "reasoning":
            continue
        elif kind == "function_call_output":
            _check_keys(item, CALL_OUTPUT_KEYS, i)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": _text(item.get("output"), i)})
        else:
            raise BodyError(f"input[{i}] is an item of type {quoted(kind)}; batcher reads messages, function_call and "
                            "function_call_output items", param=INPUT)
    if not messages:
        raise BodyError("input holds only reasoning items, which are dropped: give something to answer", param=INPUT)
    return messages


def _message(item: dict, i: int) -> dict:
    _check_keys(item, MESSAGE_KEYS, i)
    role = item.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise BodyError(f"input[{i}].role is one of {', '.join(ROLES)}; got {quoted(role)}", param=INPUT)
    return {"role": ROLES[role], "content": _text(item.get("content"), i)}


def _call(item: dict, i: int) -> dict:
    _check_keys(item, CALL_KEYS, i)
    return {"id": item.get("call_id"), "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments")}}


def _text(content: Any, i: int) -> Any:
    """A content's text: a string, or text parts joined with newlines (as chat's are); another part is refused,
    since the models batcher serves read text only."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise BodyError(f"input[{i}].content: only input_text and output_text parts are read (the model takes "
                            f"text); got a part of type {quoted(kind)}", param=INPUT)
        _check_keys(part, PART_KEYS, i)
        texts.append(part["text"])
    return "\n".join(texts)


def _check_keys(item: dict, allowed: set[str], i: int) -> None:
    unknown = sorted(k for k, v in item.items() if k not in allowed and v is not None)
    if unknown:
        raise BodyError(f"input[{i}] has unsupported fields: {', '.join(unknown)}", param=INPUT)


def input_items(value: Any, job_id: str) -> list[dict]:
    """A request's `input` as OpenAI's input item objects, with ids (what GET .../input_items lists). The input
    has been read by `input_messages` already, so its shape is known to be good."""
    value = [{"role": "user", "content": value}] if isinstance(value, str) else value
    items = []
    for i, item in enumerate(value):
        item = {k: v for k, v in item.items() if v is not None}
        kind = item.get("type") or "message"
        prefix = {"message": MESSAGE_ITEM_PREFIX, "function_call": CALL_ITEM_PREFIX,
                  "reasoning": REASONING_ITEM_PREFIX}.get(kind, CALL_OUTPUT_ITEM_PREFIX)
        shaped = {**item, "type": kind, "id": _item_id(prefix, f"{job_id}:input:{i}"), "status": "completed"}
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            shaped["content"] = [{"type": part, "text": item["content"]}]
        items.append(shaped)
    return items


# ----- tools, tool_choice and text.format: Responses' flat shapes to chat's, and back -----
def chat_tools(tools: Any) -> Any:
    if not isinstance(tools, list):
        return tools
    converted = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise BodyError(f"tools[{i}] is of type {quoted(kind)}; batcher runs the model alone, with function tools "
                            "only", param="tools")
        unknown = sorted(k for k, v in tool.items() if k not in TOOL_KEYS and v is not None)
        if unknown:
            raise BodyError(f"tools[{i}] has unsupported fields: {', '.join(unknown)}", param="tools")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        converted.append({"type": "function", "function": function})
    return converted


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) == {"type", "name"}:
        return {"type": "function", "function": {"name": choice["name"]}}
    raise BodyError("tool_choice is none, auto, required or {\"type\": \"function\", \"name\": ...}",
                    param="tool_choice")


def chat_response_format(text: Any) -> Any:
    """`text.format` as chat's `response_format` (None: free text); `text.verbosity` tunes reasoning models,
    which batcher serves none of, and is ignored."""
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise BodyError("text is an object with format (and verbosity)", param="text")
    if text.get("verbosity") is not None and text["verbosity"] not in VERBOSITIES:
        raise BodyError(f"text.verbosity is one of {', '.join(VERBOSITIES)}; got {quoted(text['verbosity'])}",
                        param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise BodyError("text.format is an object", param="text")
    if fmt.get("type") != "json_schema":
        return fmt
    schema = {k: fmt[k] for k in ("name", "schema", "description", "strict") if fmt.get(k) is not None}
    unknown = sorted(set(fmt) - {"type", "name", "schema", "description", "strict"})
    if unknown:
        raise BodyError(f"text.format has unsupported fields: {', '.join(unknown)}", param="text")
    return {"type": "json_schema", "json_schema": schema}


def tools_echo(request: GenerationRequest) -> list[dict]:
    return [{"type": "function", "name": t.function.name, "description": t.function.description,
             "parameters": t.function.parameters, "strict": t.function.strict} for t in request.tools or ()]


def tool_choice_echo(request: GenerationRequest) -> str | dict:
    choice = request.tool_choice
    if isinstance(choice, NamedToolChoice):
        return {"type": "function", "name": choice.function.name}
    return choice if choice is not None else "auto"  # OpenAI echoes auto when the request named none


def text_echo(request: GenerationRequest) -> dict:
    fmt = request.response_format
    if fmt is None or fmt.type != "json_schema":
        return {"format": {"type": "text" if fmt is None else fmt.type}}
    schema = fmt.json_schema
    return {"format": {"type": "json_schema", "name": schema.name, "schema": schema.schema_,
                       "description": schema.description, "strict": schema.strict}}


# ----- output -----
def message_item_id(job_id: str) -> str:
    return _item_id(MESSAGE_ITEM_PREFIX, f"{job_id}:output")


def call_item_id(call_id: str) -> str:
    return CALL_ITEM_PREFIX + call_id.removeprefix(CALL_ID_PREFIX)


def _item_id(prefix: str, seed: str) -> str:
    return prefix + hashlib.sha256(seed.encode()).hexdigest()[:ITEM_ID_DIGEST_CHARS]


def message_item(job_id: str, text: str, status: str) -> dict:
    return {"id": message_item_id(job_id), "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text)]}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": call_item_id(call_id), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def reasoning_item_id(job_id: str) -> str:
    return _item_id(REASONING_ITEM_PREFIX, f"{job_id}:reasoning")


def reasoning_item(job_id: str, text: str, status: str) -> dict:
    return {"id": reasoning_item_id(job_id), "type": "reasoning", "summary": [], "status": status,
            "content": [reasoning_part(text)]}


def reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def output_items(request: GenerationRequest, result: GenerationResult, job_id: str) -> list[dict]:
    """The answer's output items: its reasoning, if the model wrote any, then its text as one message, or the calls
    it made (a call cut short by max_output_tokens is left out, as chat's whole answers leave it out)."""
    reasoning, content, calls = read_whole(result.text, job_id, 0, request, result.chat_format)
    status = "incomplete" if result.finish_reason in INCOMPLETE_FINISHES else "completed"
    answered = bool(content or calls)  # else it ended inside its reasoning
    items = [] if reasoning is None else [reasoning_item(job_id, reasoning, "completed" if answered else status)]
    if calls:
        return items + [call_item(c.id, c.name, c.arguments, "completed") for c in calls]
    return items + [message_item(job_id, content or "", status)]


def answer_messages(request: GenerationRequest, result: GenerationResult, job_id: str) -> list[ChatMessage]:
    """The answer as the assistant's turn of a conversation that goes on (previous_response_id), without its
    reasoning."""
    _, content, calls = read_whole(result.text, job_id, 0, request, result.chat_format)
    if calls:
        return [ChatMessage.model_validate({"role": "assistant", "tool_calls": [c.to_dict() for c in calls]})]
    return [ChatMessage(role="assistant", content=content or "")]
