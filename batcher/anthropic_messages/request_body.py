"""A Messages API body (POST /v1/messages, and /v1/messages/count_tokens) read into a GenerationRequest.

The conversation becomes batcher's chat messages: `system` the first message, a user turn's tool_result blocks `tool`
messages (each answers the tool_use block of the same id), an assistant turn's tool_use blocks its tool calls, and
thinking blocks of earlier turns are dropped (as Anthropic drops them). Tools and tool_choice become the chat
endpoint's (auto, any -> required, tool -> the named function, none; disable_parallel_tool_use -> no parallel calls),
so the same grammar and call reader run. What batcher cannot honour is refused with the reason, never ignored: an
image or document block, a server tool, an unknown field, a last assistant turn to continue (prefill).
`thinking` enabled needs a model that reasons, which only its worker knows: the route checks it (ParsedBody.thinking);
disabled turns the template's thinking off; absent leaves the model's default.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from rqbatcher.constraints import InvalidConstraint
from rqbatcher.errors import names, quoted, readable, short_name
from rqbatcher.reasoning import THINKING_SWITCH
from rqbatcher.schema import GenerationRequest

# The fields each endpoint reads (`stream` is the route's)
MESSAGES_FIELDS = ("model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p", "top_k",
                   "stream", "metadata", "tools", "tool_choice", "thinking")
COUNT_TOKENS_FIELDS = ("model", "messages", "system", "tools", "tool_choice", "thinking")
BODY_NAMES = {"user": "metadata.user_id", "parallel_tool_calls": "tool_choice"}  # request fields the body names so
SAMPLING_NAMES = {"max_tokens": "max_tokens", "stop_sequences": "stop", "temperature": "temperature",
                  "top_p": "top_p", "top_k": "top_k"}  # Anthropic's name -> SamplingParams'
MAX_TEMPERATURE = 1.0  # Anthropic's range is [0, 1]
MIN_THINKING_BUDGET = 1024  # Anthropic's least budget_tokens
# Each block type a turn may hold, and the fields it may carry (cache_control is a caching hint: batcher's prefix
# cache needs none; citations come back from an answer and mean nothing to the model)
BLOCK_FIELDS = {
    "text": {"type", "text", "cache_control", "citations"},
    "tool_use": {"type", "id", "name", "input", "cache_control", "caller"},
    "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
    "thinking": {"type", "thinking", "signature"},
    "redacted_thinking": {"type", "data"},
}
REQUIRED_STRINGS = {"text": "text", "tool_use": "id", "tool_result": "tool_use_id"}  # each block's string field
TURN_BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}
TEXT_ONLY_BLOCKS = ("image", "document", "search_result")  # refused: the models batcher serves read text
TOOL_FIELDS = {"name", "description", "input_schema", "cache_control", "type", "strict"}
CUSTOM_TOOL = "custom"  # a tool the client runs; any other type is one of Anthropic's server tools
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # and `tool`: the named function
DISABLED = "disabled"
THINKING_TYPES = ("enabled", DISABLED, "adaptive")
ERROR_RESULT_MARK = "Error: "  # a tool_result with is_error, as the model reads it
PART_SEPARATOR = "\n"  # between the text blocks of one turn, as the chat endpoint joins text parts


class InvalidBody(ValueError):
    """A body batcher cannot run; the message names the field at fault, and `param` is that field's top name."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ParsedBody:
    generation: GenerationRequest
    stream: bool = False
    thinking: bool = False  # thinking was enabled: the model must reason


def parse_messages_body(body: dict) -> ParsedBody:
    """A /v1/messages body; InvalidBody naming the field at fault."""
    _check_fields(body, MESSAGES_FIELDS)
    if body.get("max_tokens") is None:
        raise InvalidBody("max_tokens: Field required", "max_tokens")
    if body["max_tokens"] == 0:  # Anthropic's prompt cache warm-up: batcher's prefix cache needs none
        raise InvalidBody("max_tokens: must be at least 1 (0, a cache warm-up, has nothing to do here)", "max_tokens")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidBody("stream: must be true or false", "stream")
    temperature = body.get("temperature")
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and temperature > MAX_TEMPERATURE:
        raise InvalidBody(f"temperature: must be between 0 and {MAX_TEMPERATURE}", "temperature")
    request: dict[str, Any] = {"sampling": {ours: body[theirs] for theirs, ours in SAMPLING_NAMES.items()
                                            if body.get(theirs) is not None}}
    if body.get("metadata") is not None:
        request["user"] = _user_id(body["metadata"])
    thinking = _thinking(body.get("thinking"), body["max_tokens"])
    request.update(_template_switch(thinking))
    return ParsedBody(_generation(body, request), bool(stream), thinking not in (None, DISABLED))


def parse_count_tokens_body(body: dict) -> GenerationRequest:
    """A /v1/messages/count_tokens body: the request whose prompt is counted; InvalidBody naming the field at fault."""
    _check_fields(body, COUNT_TOKENS_FIELDS)
    return _generation(body, _template_switch(_thinking(body.get("thinking"), None)))


def _check_fields(body: dict, known: tuple[str, ...]) -> None:
    unknown = set(body) - set(known)
    if unknown:
        raise InvalidBody(f"{names(unknown)}: Extra inputs are not permitted", short_name(min(unknown)))
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise InvalidBody("model: the name of a served model (a string) is required", "model")


def _generation(body: dict, request: dict[str, Any]) -> GenerationRequest:
    """The request with the body's model, conversation and tools; pydantic's reasons named as the body names them."""
    messages, origins = chat_messages(body.get("system"), body.get("messages"))
    request.update(model=body["model"], messages=messages)
    if body.get("tools") is not None:
        request["tools"] = [_tool(tool, i) for i, tool in enumerate(_list(body["tools"], "tools"))] or None
    if body.get("tool_choice") is not None:
        request.update(_tool_choice(body["tool_choice"]))
    try:
        generation = GenerationRequest.model_validate(request)
    except ValidationError as exc:
        loc = exc.errors()[0]["loc"] if exc.errors() else ()
        where = _namer(origins)
        raise InvalidBody(readable(exc, where), where(loc).split(".")[0].split("[")[0] or None) from None
    if generation.calls_tools:
        try:
            generation.grammar()
        except InvalidConstraint as exc:
            raise InvalidBody(f"tools: {exc}", "tools") from None
    return generation


def _namer(origins: list[str]):
    """How the body names a GenerationRequest location: a message by its place in `messages` (or `system`)."""
    ours = {v: k for k, v in SAMPLING_NAMES.items()}

    def where(loc: tuple) -> str:
        head, rest = (str(loc[0]), loc[1:]) if loc else ("", ())
        if head == "sampling" and rest:
            return ours.get(str(rest[0]), str(rest[0]))
        if head == "messages" and rest and isinstance(rest[0], int) and rest[0] < len(origins):
            return origins[rest[0]]
        if head == "tools" and rest:
            return f"tools[{rest[0]}]" + (".input_schema" if "parameters" in rest else "")
        return BODY_NAMES.get(head, head)

    return where


def chat_messages(system: Any, messages: Any) -> tuple[list[dict], list[str]]:
    """batcher's chat messages of a system prompt and Anthropic's turns, and where each came from (`messages[2]`)."""
    converted, origins = [], []
    if system is not None:
        converted.append({"role": "system", "content": _text(system, "system")})
        origins.append("system")
    if not _list(messages, "messages"):
        raise InvalidBody("messages: at least one message is required", "messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidBody(f"{where}: a message is an object with role and content", "messages")
        if set(message) - {"role", "content"}:
            raise InvalidBody(f"{where}: {names(set(message) - {'role', 'content'})}: Extra inputs are not "
                              "permitted", "messages")
        role, content = message.get("role"), message.get("content")
        if role not in TURN_BLOCKS:
            raise InvalidBody(f"{where}.role: must be user or assistant (a system prompt is the `system` field); "
                              f"got {quoted(role)}", "messages")
        turn = [{"role": role, "content": content}] if isinstance(content, str) else _turn(role, content, where)
        converted += turn
        origins += [where] * len(turn)
    if messages[-1].get("role") == "assistant":
        raise InvalidBody(f"messages[{len(messages) - 1}]: the last message is the user's: continuing an assistant "
                          "turn (prefill) is not supported", "messages")
    return converted, origins


def _turn(role: str, blocks: Any, where: str) -> list[dict]:
    """One turn's content blocks as chat messages: a user's text and tool results in order, an assistant's text and
    calls in one message."""
    if not isinstance(blocks, list) or not blocks:
        raise InvalidBody(f"{where}.content: a string or a non-empty list of content blocks", "messages")
    texts, calls, messages = [], [], []
    for j, block in enumerate(blocks):
        block = _block(block, role, f"{where}.content[{j}]")
        kind = block["type"]
        if kind == "text":
            texts.append(block["text"])
        elif kind == "tool_use":
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}})
        elif kind == "tool_result":
            if texts:  # text before a result stays before it
                messages.append({"role": "user", "content": PART_SEPARATOR.join(texts)})
                texts = []
            result = _text(block.get("content", ""), f"{where}.content[{j}].content")
            mark = ERROR_RESULT_MARK if block.get("is_error") else ""
            messages.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": mark + result})
    if role == "assistant":
        return [{"role": "assistant", "content": PART_SEPARATOR.join(texts) if texts or not calls else None,
                 **({"tool_calls": calls} if calls else {})}]
    return messages + ([{"role": "user", "content": PART_SEPARATOR.join(texts)}] if texts else [])


def _block(block: Any, role: str, where: str) -> dict:
    """A content block its turn may hold, its nulls dropped; InvalidBody naming what is wrong with it."""
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise InvalidBody(f"{where}: a content block is an object with a type", "messages")
    block = {k: v for k, v in block.items() if v is not None}
    kind = block["type"]
    if kind in TEXT_ONLY_BLOCKS:
        raise InvalidBody(f"{where}: {kind} blocks are not supported: the models batcher serves read text",
                          "messages")
    if kind not in TURN_BLOCKS[role]:
        raise InvalidBody(f"{where}: a {role} message holds {', '.join(TURN_BLOCKS[role])} blocks; got "
                          f"{quoted(kind)}", "messages")
    extra = set(block) - BLOCK_FIELDS[kind]
    if extra:
        raise InvalidBody(f"{where}: {names(extra)}: Extra inputs are not permitted", "messages")
    wanted = REQUIRED_STRINGS.get(kind)
    if wanted is not None and not isinstance(block.get(wanted), str):
        raise InvalidBody(f"{where}.{wanted}: a string is required", "messages")
    if kind == "tool_use" and not (isinstance(block.get("name"), str) and isinstance(block.get("input"), dict)):
        raise InvalidBody(f"{where}: a tool_use block has a name (a string) and an input (an object)", "messages")
    if kind == "tool_result" and not isinstance(block.get("is_error", False), bool):
        raise InvalidBody(f"{where}.is_error: must be true or false", "messages")
    return block


def _text(value: Any, where: str) -> str:
    """A string, or text blocks joined (`system`, a tool result's content)."""
    if isinstance(value, str):
        return value
    parts = []
    for j, block in enumerate(_list(value, where)):
        block = _block(block, "user", f"{where}[{j}]")
        if block["type"] != "text":
            raise InvalidBody(f"{where}[{j}]: only text blocks go here; got {quoted(block['type'])}",
                              where.split(".")[0].split("[")[0])
        parts.append(block["text"])
    return PART_SEPARATOR.join(parts)


def _list(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise InvalidBody(f"{where}: must be a list", where.split(".")[0].split("[")[0])
    return value


def _tool(tool: Any, i: int) -> dict:
    """An Anthropic client tool as a chat function tool."""
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise InvalidBody(f"{where}: a tool is an object with name and input_schema", "tools")
    tool = {k: v for k, v in tool.items() if v is not None}
    if tool.get("type", CUSTOM_TOOL) != CUSTOM_TOOL:
        raise InvalidBody(f"{where}: server tools ({quoted(tool['type'])}) are not available: batcher runs the model "
                          "alone; give client tools (name, description, input_schema)", "tools")
    if set(tool) - TOOL_FIELDS:
        raise InvalidBody(f"{where}: {names(set(tool) - TOOL_FIELDS)}: Extra inputs are not permitted", "tools")
    schema = tool.get("input_schema")
    if not isinstance(schema, dict) or schema.get("type") != "object":
        raise InvalidBody(f"{where}.input_schema: a JSON schema of type object is required", "tools")
    function = {"name": tool.get("name"), "parameters": schema}
    if "description" in tool:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> dict:
    """tool_choice and disable_parallel_tool_use as the request's tool_choice and parallel_tool_calls."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in (*TOOL_CHOICES, "tool"):
        raise InvalidBody("tool_choice.type: must be auto, any, tool or none", "tool_choice")
    allowed = {"type", *(("disable_parallel_tool_use",) if kind != "none" else ()), *(("name",) if kind == "tool"
                                                                                        else ())}
    extra = {k for k, v in choice.items() if v is not None} - allowed
    if extra:
        raise InvalidBody(f"tool_choice: {names(extra)}: Extra inputs are not permitted", "tool_choice")
    serial = choice.get("disable_parallel_tool_use")
    if serial is not None and not isinstance(serial, bool):
        raise InvalidBody("tool_choice.disable_parallel_tool_use: must be true or false", "tool_choice")
    if kind == "tool" and not isinstance(choice.get("name"), str):
        raise InvalidBody("tool_choice.name: the name of one of the tools is required", "tool_choice")
    mode = {"type": "function", "function": {"name": choice["name"]}} if kind == "tool" else TOOL_CHOICES[kind]
    return {"tool_choice": mode, **({"parallel_tool_calls": False} if serial else {})}


def _user_id(metadata: Any) -> str | None:
    if not isinstance(metadata, dict) or set(metadata) - {"user_id"}:
        raise InvalidBody("metadata: an object whose one field is user_id", "metadata")
    user = metadata.get("user_id")
    if user is not None and not isinstance(user, str):
        raise InvalidBody("metadata.user_id: must be a string", "metadata")
    return user


def _template_switch(thinking: str | None) -> dict:
    """`thinking` disabled turns the template's thinking off (Qwen3's `enable_thinking`); else the model's default."""
    return {"chat_template_kwargs": {THINKING_SWITCH: False}} if thinking == DISABLED else {}


def _thinking(thinking: Any, max_tokens: Any) -> str | None:
    """`thinking`'s type: `enabled` takes a budget of at least MIN_THINKING_BUDGET tokens and below max_tokens,
    which counts the reasoning in (the budget bounds nothing more: the reasoning ends when the model closes it)."""
    if thinking is None:
        return None
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in THINKING_TYPES:
        raise InvalidBody(f"thinking.type: must be {', '.join(THINKING_TYPES)}", "thinking")
    budget = thinking.get("budget_tokens")
    if set(thinking) - {"type", "budget_tokens", "display"} or (kind != "enabled" and budget is not None):
        raise InvalidBody("thinking: takes type, and budget_tokens with type enabled", "thinking")
    if kind == "enabled" and (not isinstance(budget, int) or isinstance(budget, bool) or budget < MIN_THINKING_BUDGET
                              or (isinstance(max_tokens, int) and budget >= max_tokens)):
        raise InvalidBody(f"thinking.budget_tokens: an integer of at least {MIN_THINKING_BUDGET} and below max_tokens",
                          "thinking")
    return kind
