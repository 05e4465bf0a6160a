"""The refusals issue 44 found missing or malformed, one test each: a value of another type is not coerced, OpenAI's
ranges and enumerations hold, every refusal names the field as the client sent it, and a message quotes at most a
short prefix of what was sent. Each refused request enqueues nothing (the gateway of tests/test_gateway_fuzz.py:
a pretend worker publishes its vocabulary, and an accepted job ends at once)."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest

from rqbatcher.errors import MAX_QUOTED_CHARS
from rqbatcher.gateway.error_objects import MAX_MESSAGE_CHARS
from rqbatcher.openai.batch_endpoints import parse_line
from rqbatcher.openai.batch_lines import BatchLineError
from rqbatcher.schema import GenerationRequest
from tests.jobs_support import fake_redis_fixture  # noqa: F401
from tests.test_gateway_fuzz import (
    CHAT,
    COMPLETION,
    HEADERS,
    MODEL,
    RESPONSE,
    VOCAB_SIZE,
    fuzz_fixture,  # noqa: F401
    stored,
)

LONG_ID = "x" * 60_000  # a URL holds no more than 64 KiB (httpx's limit)


def refusal(fuzz, url: str, body: dict, status: int = 400) -> dict:
    """The error of a refused POST, checked to have enqueued nothing and to be short."""
    http, connection = fuzz
    before = stored(connection)
    response = http.post(url, headers=HEADERS, json=body)
    assert response.status_code == status, response.text[:500]
    assert stored(connection) == before
    error = response.json()["error"]
    assert len(error["message"]) <= MAX_MESSAGE_CHARS
    return error


@pytest.mark.parametrize("field, value", [("max_tokens", "4"), ("n", "2"), ("max_tokens", 4.0), ("seed", True),
                                          ("temperature", "1")])
def test_a_value_of_another_type_is_refused_not_coerced(fuzz, field, value):
    error = refusal(fuzz, "/v1/chat/completions", {**CHAT, field: value})
    assert error["param"] == field and field in error["message"]


@pytest.mark.parametrize("url, body, field", [
    ("/v1/chat/completions", {**CHAT, "temperature": 3}, "temperature"),
    ("/v1/completions", {**COMPLETION, "temperature": 2.5}, "temperature"),
    ("/v1/responses", {**RESPONSE, "temperature": 3}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/chat/completions", {**CHAT, "reasoning_effort": "extreme"}, "reasoning_effort"),
    ("/v1/chat/completions", {**CHAT, "verbosity": "loud"}, "verbosity"),
    ("/v1/responses", {**RESPONSE, "include": ["bogus"]}, "include"),
    ("/v1/responses", {**RESPONSE, "reasoning": "x"}, "reasoning"),
    ("/v1/responses", {**RESPONSE, "reasoning": {"effort": "extreme"}}, "reasoning"),
    ("/v1/responses", {**RESPONSE, "truncation": "sometimes"}, "truncation"),
    ("/v1/responses", {**RESPONSE, "top_logprobs": 21}, "top_logprobs"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_openais_ranges_and_enumerations_hold(fuzz, url, body, field):
    error = refusal(fuzz, url, body)
    assert error["param"] == field and field in error["message"]


def test_what_openai_allows_is_still_taken(fuzz):
    """The other side of the line: strictness refuses nothing OpenAI takes."""
    http, _ = fuzz
    for url, body in [("/v1/chat/completions", {**CHAT, "temperature": 2, "stop": ["a"] * 4, "logit_bias": {"5": 1},
                                                "reasoning_effort": "low", "verbosity": "high"}),
                      ("/v1/responses", {**RESPONSE, "include": ["reasoning.encrypted_content"], "truncation": "auto",
                                         "reasoning": {"effort": "minimal", "summary": "concise"}})]:
        assert http.post(url, headers=HEADERS, json=body).status_code == 200


def test_a_refusal_names_max_completion_tokens_as_sent(fuzz):
    error = refusal(fuzz, "/v1/chat/completions", {**CHAT, "max_completion_tokens": 0})
    assert error["param"] == "max_completion_tokens"
    assert error["message"].startswith("max_completion_tokens:") and "sampling" not in error["message"]


def test_a_prompt_token_outside_the_vocabulary_names_prompt(fuzz):
    error = refusal(fuzz, "/v1/completions", {**COMPLETION, "prompt": [1, VOCAB_SIZE]})
    assert error["param"] == "prompt" and f"token id {VOCAB_SIZE}" in error["message"]
    error = refusal(fuzz, "/v1/embeddings", {"model": MODEL, "input": [[1], [VOCAB_SIZE + 3]]})
    assert error["param"] == "input" and f"token id {VOCAB_SIZE + 3}" in error["message"]


def test_a_long_previous_response_id_is_quoted_by_a_short_prefix(fuzz):
    error = refusal(fuzz, "/v1/responses", {**RESPONSE, "previous_response_id": "x" * 100_000}, status=404)
    assert error["param"] == "previous_response_id" and len(error["message"]) < 200


@pytest.mark.parametrize("path", ["/v1/responses/{}", "/v1/files/{}", "/v1/batches/{}", "/v1/models/{}",
                                  "/v1/batches?after={}"])
def test_a_long_id_in_the_url_is_quoted_by_a_short_prefix(fuzz, path):
    http, _ = fuzz
    response = http.get(path.format(LONG_ID), headers=HEADERS)
    assert response.status_code == 404
    assert "x" * (MAX_QUOTED_CHARS + 1) not in response.json()["error"]["message"]


def test_unknown_fields_are_named_by_a_short_prefix(fuzz):
    error = refusal(fuzz, "/v1/chat/completions", {**CHAT, **{f"{i}{'y' * 10_000}": 1 for i in range(50)}})
    assert len(error["message"]) < 400 and error["param"] in error["message"]


@pytest.mark.parametrize("content", [b'{"model": "fuzz-model", "\\ud800": 1}', b'{"temperature": NaN}',
                                     b'{"max_tokens": -Infinity}'])
def test_json_no_answer_could_hold_is_a_400(fuzz, content):
    http, connection = fuzz
    before = stored(connection)
    response = http.post("/v1/chat/completions", headers={**HEADERS, "Content-Type": "application/json"},
                         content=content)
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    assert stored(connection) == before


@pytest.mark.parametrize("query", ["limit=" + "9" * 5000, "limit=²"])
def test_a_number_in_the_query_is_ascii_digits_of_a_sane_length(fuzz, query):
    http, _ = fuzz
    response = http.get(f"/v1/batches?{query}", headers=HEADERS)
    assert response.status_code == 400 and response.json()["error"]["param"] == "limit"


def test_a_batch_line_is_as_strict_as_a_request():
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {**CHAT, "n": "2"}}
    with pytest.raises(BatchLineError, match="^n: Input should be a valid integer"):
        parse_line(json.dumps(line))


def test_a_job_read_back_from_redis_validates_as_it_was_sent():
    """Strict types hold for a job's round trip through JSON: a datetime is text there, and logit_bias keys too."""
    request = GenerationRequest(prompt="x", deadline=datetime(2030, 1, 1, tzinfo=timezone.utc),
                                sampling={"logit_bias": {5: -100, "7": 2.5}, "temperature": 1})
    stored_json = json.loads(json.dumps(request.model_dump(mode="json")))
    assert GenerationRequest.model_validate(stored_json) == request
    assert GenerationRequest.model_validate_json(request.model_dump_json()) == request
