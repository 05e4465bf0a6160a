"""OpenAI's embeddings body read into an embedding job, and its answer built from the worker's base64 vectors
(batcher/openai/embeddings_body.py): no Redis, no worker."""

from __future__ import annotations

import base64
import struct

import pytest

from rqbatcher.openai.embeddings_body import (
    MAX_EMBED_TOKENS,
    decode_vector,
    embeddings_object,
    encoding_format_of,
    parse_embeddings_body,
)
from rqbatcher.openai.generation_body import BodyError
from rqbatcher.schema import MAX_EMBED_INPUTS, GenerationResult, Usage

VECTOR = [0.5, -1.25, 3.0]


def encoded(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


def refused(body, param: str) -> str:
    with pytest.raises(BodyError) as error:
        parse_embeddings_body(body)
    assert error.value.param == param, str(error.value)
    return str(error.value)


@pytest.mark.parametrize("given, inputs", [
    ("a text", ["a text"]),
    (["one", "two"], ["one", "two"]),
    ([5, 6, 7], [[5, 6, 7]]),
    ([[5, 6], [7]], [[5, 6], [7]]),
])
def test_each_form_of_input_is_a_list_of_inputs(given, inputs):
    request = parse_embeddings_body({"input": given, "model": "m"})
    assert request.embed == inputs and request.model == "m" and request.prompt is None


def test_the_other_fields_reach_the_job_and_null_means_the_default():
    request = parse_embeddings_body({"input": "x", "model": "m", "dimensions": 32, "user": "u-1",
                                     "encoding_format": "base64"})
    assert (request.dimensions, request.user) == (32, "u-1")
    bare = parse_embeddings_body({"input": "x", "model": None, "dimensions": None, "user": None,
                                  "encoding_format": None})
    assert (bare.model, bare.dimensions, bare.user) == (None, None, None)
    assert encoding_format_of({"encoding_format": None}) == "float" == encoding_format_of({})
    assert encoding_format_of({"encoding_format": "base64"}) == "base64"


@pytest.mark.parametrize("given", [None, "", [], [""], ["a", ""], [[]], [[1], []], ["a", [1]], [1, "a"], [True],
                                   [-1], [[1 << 31]], [1.5], {"text": "a"}])
def test_empty_mixed_or_malformed_input_is_refused_naming_input(given):
    body = {"model": "m"} if given is None else {"input": given, "model": "m"}
    refused(body, "input")


def test_too_many_inputs_or_tokens_are_refused():
    parse_embeddings_body({"input": ["x"] * MAX_EMBED_INPUTS})
    assert str(MAX_EMBED_INPUTS) in refused({"input": ["x"] * (MAX_EMBED_INPUTS + 1)}, "input")
    assert str(MAX_EMBED_TOKENS) in refused({"input": [[1] * 1000] * 301}, "input")


@pytest.mark.parametrize("field, value", [("dimensions", 0), ("dimensions", True), ("dimensions", "64"),
                                          ("encoding_format", "int8"), ("model", 7), ("user", ["u"]),
                                          ("model", "")])
def test_a_bad_field_is_refused_naming_it(field, value):
    refused({"input": "x", field: value}, field)


@pytest.mark.parametrize("field", ["service_tier", "metadata", "temperature", "prompt"])
def test_fields_outside_openais_embeddings_are_refused_unless_the_caller_reads_them(field):
    assert field in refused({"input": "x", field: "v"}, field)
    assert parse_embeddings_body({"input": "x", field: "v"}, extra_fields=(field,)).embed == ["x"]


def test_not_an_object_is_refused():
    with pytest.raises(BodyError):
        parse_embeddings_body(["x"])


def test_the_answer_decodes_little_endian_float32_or_passes_base64_as_is():
    request = parse_embeddings_body({"input": ["a", "b"], "model": "m"})
    result = GenerationResult(text="", token_ids=[], finish_reason="stop", usage=Usage(prompt_tokens=7,
                              completion_tokens=0), model="served", embeddings=[encoded(VECTOR), encoded([2.0])])
    floats = embeddings_object(result, request)
    assert floats == {"object": "list", "model": "served", "usage": {"prompt_tokens": 7, "total_tokens": 7},
                      "data": [{"object": "embedding", "index": 0, "embedding": VECTOR},
                               {"object": "embedding", "index": 1, "embedding": [2.0]}]}
    raw = embeddings_object(result, request, "base64")
    assert [d["embedding"] for d in raw["data"]] == result.embeddings
    assert decode_vector(raw["data"][0]["embedding"]) == VECTOR


def test_the_answer_names_the_requested_model_when_the_result_does_not():
    request = parse_embeddings_body({"input": "a", "model": "asked"})
    result = GenerationResult(text="", token_ids=[], finish_reason="stop", usage=Usage(prompt_tokens=1,
                              completion_tokens=0), embeddings=[encoded([1.0])])
    assert embeddings_object(result, request)["model"] == "asked"
