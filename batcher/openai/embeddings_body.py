"""OpenAI's embeddings request body in, its `list` of `embedding` objects out: for POST /v1/embeddings and for the
batch lines of that endpoint alike, so an HTTP answer and an output line never differ.

The fields are OpenAI's (`openai.types.EmbeddingCreateParams`): `input`, `model`, `encoding_format`, `dimensions`
and `user`; `null` means the default, and any other field is refused, naming it. The job itself is a
`GenerationRequest` with `embed` (one vector per input); the worker returns each vector as base64 of little-endian
float32, which is OpenAI's `base64` encoding as is, and is decoded here for `float`.
"""

from __future__ import annotations

import base64
import sys
from array import array
from typing import Any

from rqbatcher.errors import quoted
from rqbatcher.openai.generation_body import BodyError, unknown_fields, validated
from rqbatcher.schema import MAX_EMBED_INPUTS, GenerationRequest, GenerationResult

EMBEDDINGS_URL = "/v1/embeddings"
ENCODING_FORMATS = ("float", "base64")
DEFAULT_ENCODING_FORMAT = "float"  # OpenAI's default (its Python SDK asks for base64 itself, and decodes it)
EMBEDDINGS_FIELDS = ("input", "model", "encoding_format", "dimensions", "user")
MAX_EMBED_TOKENS = 300_000  # OpenAI's limit of tokens summed over a request's inputs (counted here for token ids)
MAX_TOKEN_ID = 1 << 31  # exclusive, as the schema bounds token ids
FLOAT32 = "f"  # array's typecode of a C float: 4 bytes wherever Python runs
INPUT_FORMS = "a non-empty string, a list of them, a list of token ids, or a list of lists of token ids"


def parse_embeddings_body(body: Any, extra_fields: tuple[str, ...] = ()) -> GenerationRequest:
    """The embedding job of one OpenAI embeddings body, a batch line's or an HTTP request's; raise BodyError with
    a readable reason and the field at fault. `extra_fields` are fields the caller reads itself."""
    if not isinstance(body, dict):
        raise BodyError("body must be a JSON object")
    unknown_fields(body, {*EMBEDDINGS_FIELDS, *extra_fields})
    body = {k: v for k, v in body.items() if v is not None and k not in extra_fields}  # null means the default
    encoding_format_of(body)
    dimensions = body.get("dimensions")
    if dimensions is not None and (not _is_int(dimensions) or dimensions < 1):
        raise BodyError(f"dimensions is a positive integer; got {quoted(dimensions)}", param="dimensions")
    for name in ("model", "user"):
        if name in body and not isinstance(body[name], str):
            raise BodyError(f"{name} is a string", param=name)
    request = {k: body[k] for k in ("model", "dimensions", "user") if k in body}
    return validated({**request, "embed": embedding_inputs(body.get("input"))}, _body_name, whole="input")


def _body_name(loc: tuple) -> str:
    """How the body names a schema location: its inputs are `input`."""
    return ".".join("input" if p == "embed" else str(p) for p in loc)


def encoding_format_of(body: dict) -> str:
    """How the body asks for its vectors: `float` (the default, and for null) or `base64`."""
    encoding = body.get("encoding_format")
    if encoding is None:
        return DEFAULT_ENCODING_FORMAT
    if encoding not in ENCODING_FORMATS:
        raise BodyError(f"encoding_format is float or base64; got {quoted(encoding)}", param="encoding_format")
    return encoding


def embedding_inputs(value: Any) -> list[str | list[int]]:
    """OpenAI's `input` as the job's list of inputs: one string, one list of token ids, or a list of either."""
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, list) and value and all(_is_int(t) for t in value):
        value = [value]
    if not isinstance(value, list) or not value:
        raise BodyError(f"input is {INPUT_FORMS}", param="input")
    if len(value) > MAX_EMBED_INPUTS:
        raise BodyError(f"input has {len(value)} items; at most {MAX_EMBED_INPUTS} are embedded in one request",
                        param="input")
    kinds = {type(item) for item in value}
    if kinds not in ({str}, {list}):
        raise BodyError(f"input is {INPUT_FORMS}, not a mix", param="input")
    for i, item in enumerate(value):
        if not item:
            raise BodyError(f"input[{i}] is empty", param="input")
        if isinstance(item, list) and not all(_is_int(t) and 0 <= t < MAX_TOKEN_ID for t in item):
            raise BodyError(f"input[{i}]: a token id is an integer in [0, 2**31)", param="input")
    tokens = sum(len(item) for item in value if isinstance(item, list))
    if tokens > MAX_EMBED_TOKENS:
        raise BodyError(f"input has {tokens} tokens; at most {MAX_EMBED_TOKENS} are embedded in one request",
                        param="input")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def embeddings_object(result: GenerationResult, request: GenerationRequest, encoding_format: str = "float") -> dict:
    """OpenAI's answer: a `list` of `embedding` objects in input order, each vector a list of floats or, for
    `base64`, the worker's base64 as is; usage counts the tokens embedded."""
    vectors = result.embeddings or []
    data = [{"object": "embedding", "index": i,
             "embedding": vector if encoding_format == "base64" else decode_vector(vector)}
            for i, vector in enumerate(vectors)]
    tokens = result.usage.prompt_tokens
    return {"object": "list", "data": data, "model": result.model or request.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def decode_vector(encoded: str) -> list[float]:
    """A vector from base64 of little-endian float32."""
    vector = array(FLOAT32, base64.b64decode(encoded))
    if sys.byteorder == "big":
        vector.byteswap()
    return vector.tolist()
