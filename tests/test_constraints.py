"""Constraints where requests are made (no torch): the request model, OpenAI bodies and batch lines, and the
client all refuse an invalid or unsupported schema, regex or choice list before anything is enqueued."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from batcher.client import Client
from batcher.constraints import InvalidConstraint
from batcher.openai.batch_lines import (
    CHAT_URL,
    BatchLineError,
    BodyError,
    parse_batch_line,
    parse_body,
)
from batcher.schema import GenerationRequest
from tests.jobs_support import claim_database, release_database

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
BAD_SCHEMAS = {
    "unimplemented keyword": ({"type": "string", "not": {"const": "x"}}, "not"),
    "dangling $ref": ({"$ref": "#/$defs/missing"}, "missing"),
    "unsatisfiable": ({"type": "integer", "minimum": 5, "maximum": 1}, "nsatisfiable"),
    "bad pattern": ({"type": "string", "pattern": "(["}, "regex"),
    "not a schema": ({"type": "banana"}, "banana"),
}
MESSAGES = [{"role": "user", "content": "hi"}]


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_a_constrained_request_survives_the_wire_and_names_its_grammar():
    request = GenerationRequest(prompt="x", response_format=schema_format(SCHEMA))
    wire = request.model_dump(mode="json")
    assert wire["response_format"]["json_schema"]["schema"] == SCHEMA
    again = GenerationRequest.model_validate(json.loads(json.dumps(wire)))
    assert again == request and again.grammar() == request.grammar() and "json_schema" in again.grammar()
    assert GenerationRequest(prompt="x", response_format={"type": "text"}).grammar() is None
    assert GenerationRequest(prompt="x").grammar() is None
    assert (GenerationRequest(prompt="x", regex="[0-9]+").grammar()
            != GenerationRequest(prompt="x", choice=["1"]).grammar())


@pytest.mark.parametrize("case", sorted(BAD_SCHEMAS))
def test_an_invalid_or_unsupported_schema_is_refused_naming_response_format(case):
    schema, reason = BAD_SCHEMAS[case]
    with pytest.raises(ValidationError) as caught:
        GenerationRequest(prompt="x", response_format=schema_format(schema))
    (error,) = caught.value.errors()
    assert error["loc"] == ("response_format",) and reason in error["msg"]
    assert isinstance(error["ctx"]["error"], InvalidConstraint)
    with pytest.raises(BodyError) as body_error:
        parse_body({"messages": MESSAGES, "response_format": schema_format(schema)}, CHAT_URL)
    assert body_error.value.param == "response_format" and reason in str(body_error.value)


@pytest.mark.parametrize("fields,param", [
    ({"regex": "(unclosed"}, "regex"),
    ({"choice": []}, "choice"),
    ({"choice": ["ok", ""]}, "choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "regex": "a"}, None),
    ({"regex": "a", "ignore_eos": True}, None),
])
def test_bad_constraints_in_a_body_are_400s_with_a_reason(fields, param):
    with pytest.raises(BodyError) as caught:
        parse_body({"messages": MESSAGES, **fields}, CHAT_URL)
    assert caught.value.param == param and str(caught.value)


def test_a_batch_line_with_a_bad_schema_is_that_lines_error_and_a_good_one_parses():
    good = {"messages": MESSAGES, "response_format": schema_format(SCHEMA)}
    _, request = parse_batch_line(json.dumps({"custom_id": "ok", "url": CHAT_URL, "body": good}))
    assert request.response_format.json_schema.schema_ == SCHEMA
    bad = {"messages": MESSAGES, "response_format": schema_format({"$ref": "#/nowhere"})}
    with pytest.raises(BatchLineError) as caught:
        parse_batch_line(json.dumps({"custom_id": "bad", "url": CHAT_URL, "body": bad}))
    assert caught.value.custom_id == "bad" and "response_format" in str(caught.value)


def test_the_client_refuses_a_bad_schema_before_enqueueing_anything():
    url, connection = claim_database()
    try:
        client = Client(url, queue="constraints")
        before = set(connection.keys("*"))
        with pytest.raises(ValidationError, match="response_format"):
            client.submit({"prompt": "x", "response_format": schema_format({"type": "string", "not": {}})})
        assert set(connection.keys("*")) == before
        job_id = client.submit({"prompt": "x", "choice": ["a", "b"]})
        assert client.status(job_id).status == "queued"
    finally:
        release_database(connection)


def test_cli_submit_takes_a_json_schema_file_or_a_regex_and_refuses_a_bad_one(tmp_path, monkeypatch):
    from click.testing import CliRunner
    from rq import Queue
    from rq.job import Job
    from rq.serializers import JSONSerializer

    from batcher.cli import main, options

    url, connection = claim_database()
    try:
        monkeypatch.setattr(options, "make_client", lambda _, queue="batcher": Client(url, queue=queue))
        good, bad = tmp_path / "good.json", tmp_path / "bad.json"
        good.write_text(json.dumps(SCHEMA))
        bad.write_text(json.dumps({"$ref": "#/nowhere"}))
        result = CliRunner().invoke(main, ["submit", "--queue", "cli", "hi", "--json-schema", str(good)])
        assert result.exit_code == 0, result.output
        job = Job.fetch(result.stdout.strip(), connection=connection, serializer=JSONSerializer)
        assert job.args[0]["response_format"]["json_schema"]["schema"] == SCHEMA
        result = CliRunner().invoke(main, ["submit", "--queue", "cli", "hi", "--regex", "[0-9]{3}"])
        assert Job.fetch(result.stdout.strip(), connection=connection, serializer=JSONSerializer).args[0]["regex"]
        for args in (["--json-schema", str(bad)], ["--regex", "("], ["--regex", "a", "--json-schema", str(good)]):
            refused = CliRunner().invoke(main, ["submit", "--queue", "cli", "hi", *args])
            assert refused.exit_code == 2, refused.output
        assert "response_format" in CliRunner().invoke(main, ["submit", "hi", "--json-schema", str(bad)]).output
        assert len(Queue("cli", connection=connection)) == 2
    finally:
        release_database(connection)

