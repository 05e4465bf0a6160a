"""The body fields that batcher checks itself, by OpenAI's reference, before a body becomes a job.

They are the fields the schema (rqbatcher.schema) does not check as OpenAI does: those accepted and ignored (their
type and, for an enumeration, their value are still checked, as OpenAI checks them), the server's own flags, and
those whose OpenAI range is narrower than batcher's (`temperature` up to 2, at most 4 `stop` sequences). The schema
checks the rest just as strictly: no value is coerced to another type (`"4"` is not 4, `true` is not 1, 2.0 is
not an integer). Each refusal names the field as the client sent it, in its message and as its `param`, and quotes
at most a short prefix of the value.

The enumerations are the Literal types of the `openai` package's `*_create_params` (chat, completions, responses).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rqbatcher.errors import quoted
from rqbatcher.sampling_params import MAX_TOP_LOGPROBS


@dataclass(frozen=True)
class Kind:
    """What a field takes: in words, for its refusal, and as a test of a value."""

    words: str
    accepts: Callable[[Any], bool]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def integer(low: int) -> Kind:
    return Kind(f"an integer of at least {low}", lambda v: _is_int(v) and v >= low)


def integer_in(low: int, high: int) -> Kind:
    return Kind(f"an integer from {low} to {high}", lambda v: _is_int(v) and low <= v <= high)


def number_in(low: float, high: float) -> Kind:
    return Kind(f"a number from {low:g} to {high:g}",
                lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and low <= v <= high)


def one_of(*values: str) -> Kind:
    return Kind(f"one of {', '.join(values)}", lambda v: isinstance(v, str) and v in values)


def text(max_chars: int | None = None) -> Kind:
    words = "a string" if max_chars is None else f"a string of at most {max_chars} characters"
    return Kind(words, lambda v: isinstance(v, str) and (max_chars is None or len(v) <= max_chars))


def strings(max_items: int) -> Kind:
    """One string, or a list of up to `max_items` of them (`stop`)."""
    return Kind(f"a string or a list of at most {max_items} strings", lambda v: isinstance(v, str) or (
        isinstance(v, list) and len(v) <= max_items and all(isinstance(s, str) for s in v)))


def list_of(item: Kind) -> Kind:
    return Kind(f"a list, each item {item.words}", lambda v: isinstance(v, list) and all(map(item.accepts, v)))


def object_of(required: tuple[str, ...] = (), **fields: Kind) -> Kind:
    """An object of these fields alone (each null or of its kind), with the `required` ones."""
    described = ", ".join(f"{name} ({kind.words})" for name, kind in fields.items())
    needs = f", {' and '.join(required)} required" if required else ""

    def accepts(value: Any) -> bool:
        return isinstance(value, dict) and set(value) <= fields.keys() and all(
            kind.accepts(value[name]) if value.get(name) is not None else name not in required
            for name, kind in fields.items())

    return Kind(f"an object of {described}{needs}", accepts)


BOOLEAN = Kind("true or false", lambda v: isinstance(v, bool))
STRING = text()
TEXT_PART = object_of(("type", "text"), type=one_of("text"), text=STRING)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
VERBOSITIES = ("low", "medium", "high")
PROMPT_CACHE_RETENTIONS = ("in_memory", "24h")
MAX_SAFETY_IDENTIFIER_CHARS = 128  # OpenAI's
MAX_STOP_SEQUENCES = 4  # OpenAI's (batcher's own limit is higher: sampling_params.MAX_STOP_STRINGS)
MAX_TEMPERATURE = 2.0  # OpenAI's (batcher's own is higher)

# Both generation endpoints (chat and completions): the fields generation_body.IGNORED_BODY_FIELDS names, and those
# with a narrower range than the schema's
GENERATION_KINDS = {
    "temperature": number_in(0, MAX_TEMPERATURE), "stop": strings(MAX_STOP_SEQUENCES), "stream": BOOLEAN,
    "store": BOOLEAN, "safety_identifier": text(MAX_SAFETY_IDENTIFIER_CHARS), "prompt_cache_key": STRING,
    "prompt_cache_retention": one_of(*PROMPT_CACHE_RETENTIONS), "reasoning_effort": one_of(*REASONING_EFFORTS),
    "verbosity": one_of(*VERBOSITIES),
    "prediction": object_of(("type", "content"), type=one_of("content"),
                            content=Kind(f"a string or a list of text parts ({TEXT_PART.words})",
                                         lambda v: STRING.accepts(v) or list_of(TEXT_PART).accepts(v))),
}
RESPONSE_INCLUDABLES = ("file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                        "message.input_image.image_url", "computer_call_output.output.image_url",
                        "code_interpreter_call.outputs", "reasoning.encrypted_content", "message.output_text.logprobs")
RESPONSES_KINDS = {
    "temperature": number_in(0, MAX_TEMPERATURE), "instructions": STRING, "previous_response_id": STRING,
    "store": BOOLEAN, "background": BOOLEAN, "stream": BOOLEAN, "parallel_tool_calls": BOOLEAN,
    "include": list_of(one_of(*RESPONSE_INCLUDABLES)),
    "reasoning": object_of(effort=one_of(*REASONING_EFFORTS), summary=one_of("auto", "concise", "detailed"),
                           generate_summary=one_of("auto", "concise", "detailed"),
                           context=one_of("auto", "current_turn", "all_turns"), mode=STRING),
    "top_logprobs": integer_in(0, MAX_TOP_LOGPROBS), "truncation": one_of("auto", "disabled"),
    "prompt_cache_key": STRING, "prompt_cache_retention": one_of(*PROMPT_CACHE_RETENTIONS),
    "prompt_cache_options": object_of(mode=one_of("implicit", "explicit"), ttl=one_of("30m", "12h"),
                                      prewarm=BOOLEAN, comparison_response_id=STRING),
    "safety_identifier": text(MAX_SAFETY_IDENTIFIER_CHARS), "max_tool_calls": integer(0),
    "stream_options": object_of(include_obfuscation=BOOLEAN),
    "access_programs": object_of(cyber=one_of("standard", "daybreak_blue", "daybreak_red")),
}


def refusal(body: dict, kinds: dict[str, Kind]) -> tuple[str, str] | None:
    """(the reason, the field) for the first field of `body` that `kinds` names and whose value is not of its kind
    (null means the default, and passes); None when every one is."""
    for name, kind in kinds.items():
        value = body.get(name)
        if value is not None and not kind.accepts(value):
            return f"{name} is {kind.words}; got {quoted(value)}", name
    return None
