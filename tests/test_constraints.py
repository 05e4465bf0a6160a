"""Constraints where requests are made (no torch): the request model, OpenAI bodies and batch lines, and the
client all refuse an invalid or unsupported schema, regex or choice list before anything is enqueued."""

from __future__ import annotations

import copy
import json

import llguidance
import pytest
from pydantic import ValidationError

from rqbatcher.client import Client
from rqbatcher.constraints import (
    INT_MAX,
    INT_MIN,
    JSON_OPTIONS,
    NUMBER_DECIMALS,
    NUMBER_DIGITS,
    InvalidConstraint,
    bounded_schema,
    checked,
    json_schema_grammar,
)
from rqbatcher.openai.batch_lines import BatchLineError, parse_batch_line
from rqbatcher.openai.generation_body import CHAT_URL, BodyError, parse_body
from rqbatcher.schema import GenerationRequest
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

    from rqbatcher.cli import main, options

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



class ByteTokens:
    """A tokenizer with one token per byte, and EOS: a grammar's language, token for byte."""

    eos_token_id, bos_token_id, special_token_ids = 256, None, [256]
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]

    def __call__(self, text):
        return list(text.encode() if isinstance(text, str) else text)


BYTES = llguidance.LLTokenizer(llguidance.TokenizerWrapper(ByteTokens()))
INT_TOO_LONG = [str(INT_MAX + 1), str(INT_MIN - 1), "1" * 20]
LONGEST_NUMBERS = ["12345678901234567", "-1234567.0123456789", "12345678.012345678", "-0.0000000001", "0.5"]
NUMBERS_TOO_LONG = ["123456789012345678", "1.23456789012345678", "0.00000000001", "1e5", "1.0E-300"]


def accepts(grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(BYTES, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.try_consume_tokens(list(text.encode())) == len(text.encode()) and matcher.is_accepting()


def test_an_integer_is_bounded_by_int64_and_keeps_its_own_tighter_bounds():
    grammar = json_schema_grammar({"type": "integer"})
    assert all(accepts(grammar, n) for n in (str(INT_MAX), str(INT_MIN), "0", "-7"))
    assert not any(accepts(grammar, n) for n in INT_TOO_LONG)
    assert INT_MAX == 2**63 - 1 and INT_MIN == -(2**63) + 1024  # llguidance cannot take -2**63 itself (its doc)
    natural = json_schema_grammar({"type": "integer", "minimum": 0})
    assert accepts(natural, str(INT_MAX)) and not accepts(natural, "-1") and not accepts(natural, str(INT_MAX + 1))
    assert bounded_schema({"type": "integer", "minimum": 0})["maximum"] == INT_MAX
    int64 = json_schema_grammar({"type": "integer", "minimum": -(2**63), "maximum": 2**64})  # looser: clamped
    assert accepts(int64, str(INT_MIN)) and not accepts(int64, str(INT_MAX + 1))
    small = json_schema_grammar({"type": "integer", "exclusiveMinimum": -3, "maximum": 5, "multipleOf": 2})
    assert [n for n in range(-9, 9) if accepts(small, str(n))] == [-2, 0, 2, 4]


def test_a_number_has_at_most_17_significant_digits_and_no_exponent():
    assert (NUMBER_DIGITS, NUMBER_DECIMALS) == (17, 10)
    grammar = json_schema_grammar({"type": "number"})
    assert all(accepts(grammar, n) for n in LONGEST_NUMBERS)
    assert not any(accepts(grammar, n) for n in NUMBERS_TOO_LONG)
    unit = json_schema_grammar({"type": "number", "minimum": 0, "exclusiveMaximum": 1})
    assert accepts(unit, "0.0123456789") and accepts(unit, "0")
    assert not any(accepts(unit, n) for n in ("1", "-0.5", "0.01234567891"))
    assert accepts(json_schema_grammar({"type": "number", "multipleOf": 0.5}), "-2.5")
    assert not accepts(json_schema_grammar({"type": "number", "multipleOf": 0.5}), "2.25")


@pytest.mark.parametrize("schema,template", [
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
      "additionalProperties": False}, '{"a":%s}'),
    ({"type": "array", "items": {"type": "number"}, "maxItems": 1}, "[%s]"),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": False}, "[%s]"),
    ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, "%s"),
    ({"type": ["integer", "null"]}, "%s"),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "%s"),
    ({"allOf": [{"type": "integer"}, {"minimum": -5}]}, "%s"),
    ({"$ref": "#/$defs/n", "$defs": {"n": {"type": "integer"}}}, "%s"),
    ({"$ref": "#/definitions/n", "definitions": {"n": {"type": "number"}}}, "%s"),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 1}, '{"k":%s}'),
    ({"type": "object", "properties": {"a": {"type": "string"}}}, '{"a":"x","b":[{"c":%s}]}'),
    ({"type": "object"}, '{"b":%s}'),
    ({}, "%s"),
    ({"description": "any value"}, "[%s]"),
])
def test_nested_and_free_values_are_bounded_too(schema, template):
    grammar = json_schema_grammar(schema)
    assert accepts(grammar, template % "1234")
    assert not accepts(grammar, template % ("9" * 20))


def test_bounding_leaves_the_callers_schema_and_finite_keywords_alone():
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}, "x": {"type": "number"},
                                               "e": {"enum": [1e300, "a"]}, "c": {"const": 10**18}},
              "$defs": {"d": {"type": "integer"}}, "x-guidance": {"whitespace_flexible": False}}
    before = copy.deepcopy(schema)
    bounded = bounded_schema(schema)
    assert schema == before and bounded is not schema
    assert bounded["properties"]["e"] == {"enum": [1e300, "a"]} and bounded["properties"]["c"] == {"const": 10**18}
    assert bounded["x-guidance"] == schema["x-guidance"] and "d" in bounded["$defs"]
    assert accepts(json_schema_grammar({"const": 10**18}), str(10**18))
    assert bounded_schema({"type": "string", "maxLength": 3}) == {"type": "string", "maxLength": 3}


def test_a_bounded_schema_embedded_as_json_in_lark_keeps_its_bounds():
    embedded = json.dumps({**bounded_schema({"type": "object", "properties": {"n": {"type": "integer"}},
                                             "required": ["n"], "additionalProperties": False}),
                           "x-guidance": JSON_OPTIONS})
    grammar = checked(llguidance.LLMatcher.grammar_from_lark(f'start: "<call>" %json {embedded} "</call>"'), "lark")
    assert accepts(grammar, f'<call>{{"n":{INT_MIN}}}</call>')
    assert not accepts(grammar, f'<call>{{"n":{INT_MIN - 1}}}</call>')
