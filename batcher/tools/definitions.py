"""The request's tools and tool_choice, and the calls an assistant message carries, as OpenAI's Chat Completions
API defines them (function tools only), with the checks that keep a bad one from ever reaching a worker.

A tool's `parameters` must be a JSON schema the grammar library can honour (batcher/constraints.py), since
`required`, a named tool and `auto` make the answer follow it; a `tool_choice` must name a tool of the request.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rqbatcher import constraints

MAX_TOOLS = 128  # OpenAI's limit
MAX_TOOL_NAME_CHARS = 64
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_-]+$"  # OpenAI's rule for function names
MAX_TOOL_CALLS_PER_MESSAGE = 128
MAX_CALL_ID_CHARS = 256
NO_PARAMETERS = {"type": "object", "properties": {}}  # what OpenAI assumes when a function omits `parameters`

ToolChoiceMode = Literal["none", "auto", "required"]


class _Strict(BaseModel):
    """Part of a request: unknown fields and values of another type are errors (rqbatcher.schema says why)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=MAX_TOOL_NAME_CHARS, pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    parameters: dict | None = Field(None, description="a JSON schema of the arguments object; None: no arguments")
    strict: bool | None = Field(None, description="accepted: arguments always follow the schema when a call is made")

    @field_validator("parameters")
    @classmethod
    def _schema_honoured(cls, value: dict | None) -> dict | None:
        if value is not None:
            try:
                constraints.json_schema_grammar(value)
            except constraints.InvalidConstraint as exc:
                raise ValueError(f"parameters: {exc}") from None
        return value

    @property
    def arguments_schema(self) -> dict:
        return NO_PARAMETERS if self.parameters is None else self.parameters


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """`{"type": "function", "function": {"name": ...}}`: this tool must be called."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = ToolChoiceMode | NamedToolChoice


class CalledFunction(_Strict):
    name: str = Field(min_length=1, max_length=MAX_TOOL_NAME_CHARS)
    arguments: str = Field(description="the arguments object as JSON text, as the model wrote it")

    @field_validator("arguments")
    @classmethod
    def _arguments_are_json(cls, value: str) -> str:
        try:
            json.loads(value)
        except ValueError:
            raise ValueError("a tool call's arguments must be JSON text") from None
        return value


class ToolCall(_Strict):
    """A call an assistant message made; a later `tool` message answers it by `id`."""

    id: str = Field(min_length=1, max_length=MAX_CALL_ID_CHARS)
    type: Literal["function"] = "function"
    function: CalledFunction


def choice_problem(tools: list[Tool] | None, choice: ToolChoice | None) -> str | None:
    """Why a tool_choice cannot go with these tools, or None."""
    if choice is None or choice == "none":
        return None
    if not tools:
        return "tool_choice needs tools"
    if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in tools}:
        names = ", ".join(t.function.name for t in tools)
        return f"tool_choice names the function {choice.function.name!r}, which is not among the tools ({names})"
    return None


def duplicate_name(tools: list[Tool]) -> str | None:
    names = [t.function.name for t in tools]
    return next((n for n in names if names.count(n) > 1), None)


def effective_choice(tools: list[Tool] | None, choice: ToolChoice | None) -> ToolChoice:
    """OpenAI's default: `auto` when there are tools, `none` otherwise."""
    if choice is not None:
        return choice
    return "auto" if tools else "none"
