"""OpenAI's `response_format`: free text, any JSON object, or JSON that follows a schema (batcher/constraints.py
makes each a grammar)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rqbatcher import constraints

MAX_SCHEMA_NAME_CHARS = 64


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`. Answers always follow the schema: `strict` is accepted and
    changes nothing (a schema the grammar library cannot honour exactly is refused instead)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, populate_by_name=True, serialize_by_alias=True)

    name: str = Field(min_length=1, max_length=MAX_SCHEMA_NAME_CHARS, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema", description="None: any JSON value")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: free `text`, any JSON object (`json_object`), or JSON that follows a schema. Values
    of another type are errors, as in every part of a request (rqbatcher.schema)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type json_schema, and only then")
        return self

    def grammar(self) -> str | None:
        """The llguidance grammar of the format (None for text); InvalidConstraint if it cannot be honoured."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return constraints.json_schema_grammar(constraints.ANY_JSON_OBJECT)
        schema = self.json_schema.schema_
        return constraints.json_schema_grammar({} if schema is None else schema)
