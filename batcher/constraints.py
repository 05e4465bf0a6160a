"""Constrained decoding, the torch-free half: a request's constraint as a grammar, and whether it is one
we can honour.

A request may carry one constraint: `response_format` (OpenAI's `json_schema`, `json_object` or `text`),
`regex`, or `choice` (a list of strings, one of which is the whole answer). Each becomes an llguidance
grammar string. The same function runs where the request is made (pydantic validation of
`GenerationRequest`: the client, the gateway and batch lines refuse an invalid or unsupported schema
before anything is enqueued) and in the worker, which compiles that grammar against its tokenizer
(workers/engine/structured.py). llguidance refuses schema keywords it does not implement rather than ignoring
them, so an answer that ends with `stop` always validates against its schema.

JSON is generated without whitespace between tokens (llguidance's `whitespace_flexible: false`): a model
cannot loop on blank lines, and a schema whose strings and arrays are bounded always ends.

Every number literal a JSON grammar allows is bounded too (`bounded_schema`), or a small greedy model runs on in
digits until max_tokens. llguidance has no option for this: an unbounded `integer` or `number` becomes an
unbounded digit regex, a bounded `number` still takes any count of decimals, and exponents exist only when a
number has no bound. So the schema is rewritten: an integer is within INT_MIN..INT_MAX (int64, as near as
llguidance allows) unless its own bounds are tighter; a number is one of NUMBER's fixed-point ranges (below
10**d, a multiple of 10**(d - NUMBER_DIGITS)): at most NUMBER_DIGITS significant digits, NUMBER_DECIMALS
decimals, no exponent; and a value the schema leaves free (`{}`, `true`, an absent `items` or
`additionalProperties`, the `json_object` mode) is ANY_VALUE, any JSON value with those bounded numbers.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import lru_cache

import llguidance

from rqbatcher.errors import BatcherError

MAX_SCHEMA_BYTES = 64 * 1024
MAX_REGEX_CHARS = 4096
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
VALIDATION_CACHE_SIZE = 256
JSON_OPTIONS = {"whitespace_flexible": False}
ANY_JSON_OBJECT = {"type": "object"}
# The bounds of a number literal. llguidance reads a bound as a float and its integer ranges cannot take int64's
# own minimum (it negates it), so INT_MIN is the float next above -2**63; INT_MAX reads as 2**63 and is clamped.
INT_MAX = 2**63 - 1
INT_MIN = -(2**63) + 1024
NUMBER_DIGITS = 17  # significant digits of a `number` (17 round-trip any float64)
NUMBER_DECIMALS = 10  # digits after its point: llguidance's `multipleOf` goes down to 10**-10
# The bounded values' names in the `$defs` of a bounded schema: an integer, a number, any JSON value.
INT64, NUMBER, ANY_VALUE = "batcher_int64", "batcher_number", "batcher_any_value"
_ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly"}
_ROOT_ONLY = ("x-guidance", "$schema", "$id", "$defs", "definitions")
_NOT_NUMBERS = frozenset({"array", "boolean", "null", "object", "string"})
_SCHEMA = ("items", "additionalProperties", "additionalItems")  # not `not` or `if`: bounding those would loosen
_SCHEMA_LISTS = ("prefixItems", "items")  # `items` as a list: the older tuple form
_OPTIONS = ("anyOf", "oneOf", "allOf")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_COMBINED = ("$ref", *_OPTIONS)


class InvalidConstraint(BatcherError, ValueError):
    """A schema, regex or choice list that is invalid, or that the grammar library does not support."""


def json_schema_grammar(schema: dict) -> str:
    size = len(json.dumps(schema))
    if size > MAX_SCHEMA_BYTES:
        raise InvalidConstraint(f"the schema is {size} bytes; the limit is {MAX_SCHEMA_BYTES}")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(bounded_schema(schema), defaults=JSON_OPTIONS)
    except ValueError as exc:
        raise InvalidConstraint(f"invalid JSON schema: {exc}") from None
    return checked(grammar, "JSON schema")


def bounded_schema(schema: dict | bool) -> dict | bool:
    """`schema` (a schema's root, left unchanged) with every integer and number literal it allows bounded.

    The result is a root too: its `$ref`s to the bounded values (INT64, NUMBER, ANY_VALUE) name its own `$defs`
    from the root. Embedded whole, as `%json {...}` in a Lark grammar, it keeps its bounds."""
    used: set[str] = set()

    def ref(name: str) -> dict:
        used.add(name)
        return {"$ref": f"#/$defs/{name}"}

    root = _bounded(schema, ref)
    if not used:
        return root
    definitions = {}
    if ANY_VALUE in used:  # first: it names NUMBER
        definitions[ANY_VALUE] = {"anyOf": [{"type": ["boolean", "null", "string"]}, ref(NUMBER),
                                            {"type": "array", "items": ref(ANY_VALUE)},
                                            {"type": "object", "additionalProperties": ref(ANY_VALUE)}]}
    if NUMBER in used:
        definitions[NUMBER] = {"anyOf": _fixed_point_ranges()}
    if INT64 in used:
        definitions[INT64] = {"type": "integer", "minimum": INT_MIN, "maximum": INT_MAX}
    return {**root, "$defs": {**root.get("$defs", {}), **definitions}}


def _bounded(schema, ref: Callable[[str], dict], named: bool = True):
    """One schema, its subschemas first; `ref(name)` names a bounded value in the root's `$defs`, which stands
    for a schema that has only its types where `named` (a name costs nothing to compile; an intersection does)."""
    if not isinstance(schema, dict):
        return ref(ANY_VALUE) if schema is True else schema
    out = dict(schema)
    for key in _SCHEMA:
        if isinstance(out.get(key), dict | bool):
            out[key] = _bounded(out[key], ref)
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_bounded(s, ref) for s in out[key]]
    for key in _OPTIONS:  # llguidance proves oneOf's options disjoint by their types, which a name would hide
        if isinstance(out.get(key), list):
            out[key] = [_bounded(s, ref, named and key != "oneOf") for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _bounded(s, ref) for name, s in out[key].items()}
    if "enum" in out or "const" in out:
        return out
    types = out.get("type")
    types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else None
    if any(key in out for key in _COMBINED):
        if types is not None and "integer" in types:
            _clamp_integer(out)
        return out  # otherwise it allows what its subschemas allow, and those are bounded
    numeric = NUMBER if types is None or "number" in types else INT64 if "integer" in types else None
    others = _NOT_NUMBERS if types is None else types - {"integer", "number"}
    if numeric and named and not set(out) - {"type", *_ANNOTATIONS, *_ROOT_ONLY}:  # only types: named
        kept = {key: out[key] for key in _ROOT_ONLY if key in out}
        if types is None:
            return {**kept, **ref(ANY_VALUE)}
        if not others:
            return {**kept, **ref(numeric)}
        return {**kept, "anyOf": [_with_free_values({"type": sorted(others)}, others, ref), ref(numeric)]}
    out = _with_free_values(out, others, ref)
    if numeric == INT64:  # its own keywords bound it too: intersected, which llguidance compiles for each one
        _clamp_integer(out)
    elif numeric == NUMBER:
        out["anyOf"] = [{"type": sorted(others)}] * bool(others) + [ref(NUMBER)]
    return out


def _with_free_values(schema: dict, types: set[str], ref: Callable[[str], dict]) -> dict:
    """`schema` with its array items and object values bounded where it leaves them free."""
    if "array" in types:
        schema.setdefault("items", ref(ANY_VALUE))
    if "object" in types:
        schema.setdefault("additionalProperties", ref(ANY_VALUE))
    return schema


def _clamp_integer(schema: dict) -> None:
    """Drop the integer's bounds that are looser than int64's, and add int64's where none is left."""
    for keys, bound, tighter in ((("minimum", "exclusiveMinimum"), INT_MIN, max),
                                 (("maximum", "exclusiveMaximum"), INT_MAX, min)):
        for key in keys:
            value = schema.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool) and tighter(value, bound) != value:
                del schema[key]
        if not any(key in schema for key in keys):
            schema[keys[0]] = bound


def _fixed_point_ranges() -> list[dict]:
    """For each d from NUMBER_DIGITS - NUMBER_DECIMALS up: the numbers below 10**d with NUMBER_DIGITS - d
    decimals. Each is a bounded llguidance number, so none has an exponent."""
    return [{"type": "number", "exclusiveMinimum": -(10**d), "exclusiveMaximum": 10**d,
             "multipleOf": 10.0 ** (d - NUMBER_DIGITS) if d < NUMBER_DIGITS else 1}
            for d in range(NUMBER_DIGITS - NUMBER_DECIMALS, NUMBER_DIGITS + 1)]


def regex_grammar(regex: str) -> str:
    if len(regex) > MAX_REGEX_CHARS:
        raise InvalidConstraint(f"the regex has {len(regex)} characters; the limit is {MAX_REGEX_CHARS}")
    return checked(llguidance.LLMatcher.grammar_from_regex(regex), "regex")


def choice_grammar(choices: list[str]) -> str:
    """A grammar whose only sentences are the choices (Lark string literals take JSON's escapes)."""
    if not choices or len(choices) > MAX_CHOICES:
        raise InvalidConstraint(f"choice takes 1 to {MAX_CHOICES} strings")
    if any(not c or len(c) > MAX_CHOICE_CHARS for c in choices):
        raise InvalidConstraint(f"each choice must have 1 to {MAX_CHOICE_CHARS} characters")
    lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))
    return checked(llguidance.LLMatcher.grammar_from_lark(lark), "choice")


def checked(grammar: str, what: str) -> str:
    """`grammar`, if llguidance can build it; InvalidConstraint with its reason otherwise."""
    problem = _problem(grammar)
    if problem:
        raise InvalidConstraint(f"unsupported or invalid {what}: {problem.strip()}")
    return grammar


@lru_cache(maxsize=VALIDATION_CACHE_SIZE)
def _problem(grammar: str) -> str:
    return llguidance.LLMatcher.validate_grammar(grammar)
