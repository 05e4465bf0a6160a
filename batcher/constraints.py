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
"""

from __future__ import annotations

import json
from functools import lru_cache

import llguidance

from batcher.errors import BatcherError

MAX_SCHEMA_BYTES = 64 * 1024
MAX_REGEX_CHARS = 4096
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
VALIDATION_CACHE_SIZE = 256
JSON_OPTIONS = {"whitespace_flexible": False}
ANY_JSON_OBJECT = {"type": "object"}


class InvalidConstraint(BatcherError, ValueError):
    """A schema, regex or choice list that is invalid, or that the grammar library does not support."""


def json_schema_grammar(schema: dict) -> str:
    size = len(json.dumps(schema))
    if size > MAX_SCHEMA_BYTES:
        raise InvalidConstraint(f"the schema is {size} bytes; the limit is {MAX_SCHEMA_BYTES}")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as exc:
        raise InvalidConstraint(f"invalid JSON schema: {exc}") from None
    return checked(grammar, "JSON schema")


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
