"""Structured outputs end to end through the official `openai` SDK: a real `batcher serve`, a real worker on a tiny
random model (which writes JSON only because its grammar forces it to) and the real Redis."""

from __future__ import annotations

import json
from typing import Annotated

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e import test_gateway
from tests.e2e.test_gateway import KEY_A, MODEL, sdk, wait_for_batch

gateway, workers = test_gateway.gateway, test_gateway.workers  # the module's own worker and gateway

pytestmark = pytest.mark.timeout(300)
TICKET = {"type": "object", "additionalProperties": False, "required": ["title", "priority", "tags"],
          "properties": {"title": {"type": "string", "maxLength": 12},
                         "priority": {"enum": ["low", "high"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
                         "estimate": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 40}, {"type": "null"}]}}}
MESSAGES = [{"role": "user", "content": "File a ticket about the queue"}]


class Summary(BaseModel):
    title: str = Field(max_length=16)
    bullets: list[Annotated[str, Field(max_length=12)]] = Field(max_length=2)
    label: bool


def schema_format(schema: dict, name: str = "ticket") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_parse_with_a_pydantic_model_gives_an_instance(gateway):
    base, _, _ = gateway
    completion = sdk(base, KEY_A).chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Summary,
                                                         max_tokens=200, temperature=0.0)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Summary)
    assert Summary.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_schema_and_json_object_answers_parse_streamed_or_not(gateway):
    base, _, _ = gateway
    client = sdk(base, KEY_A)
    answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=schema_format(TICKET),
                                            max_tokens=200, temperature=1.0, seed=3)
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), TICKET)
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=schema_format(TICKET),
                                            max_tokens=200, temperature=1.0, seed=3, stream=True)
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer.choices[0].message.content
    as_object = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=300,
                                               response_format={"type": "json_object"})
    text = as_object.choices[0].message.content
    assert text.startswith("{")
    if as_object.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    regex = client.completions.create(model=MODEL, prompt="Code:", max_tokens=20,
                                      extra_body={"regex": "[A-Z]{3}-[0-9]{2}"})
    assert regex.choices[0].finish_reason == "stop" and len(regex.choices[0].text) == 6


@pytest.mark.parametrize("response_format", [
    schema_format({"type": "string", "not": {"const": "x"}}),
    schema_format({"$ref": "#/$defs/missing"}),
    {"type": "json_schema"},
    {"type": "yaml"},
])
def test_an_invalid_or_unsupported_schema_answers_400_naming_response_format(gateway, response_format):
    base, _, _ = gateway
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(base, KEY_A).chat.completions.create(model=MODEL, messages=MESSAGES, response_format=response_format)
    assert caught.value.param == "response_format" and "response_format" in caught.value.message


def test_a_batch_whose_lines_carry_schemas_answers_json_and_a_bad_schema_is_an_error_line(gateway):
    base, _, _ = gateway
    client = sdk(base, KEY_A)
    schemas = [TICKET, {**Summary.model_json_schema(), "additionalProperties": False}, {"type": "string", "not": {}},
               {"enum": ["yes", "no"]}]
    lines = [json.dumps({"custom_id": f"s{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": MODEL, "messages": MESSAGES, "max_tokens": 200, "temperature": 0.7,
                                  "seed": i, "response_format": schema_format(schema, f"s{i}")}})
             for i, schema in enumerate(schemas)]
    uploaded = client.files.create(file=("schemas.jsonl", "\n".join(lines).encode()), purpose="batch")
    created = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                    completion_window="24h")
    done = wait_for_batch(client, created.id, ("completed", "failed", "expired", "cancelled"))
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (3, 1)
    output = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    for line in output:
        choice = line["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "stop", line
        jsonschema.validate(json.loads(choice["message"]["content"]), schemas[int(line["custom_id"][1:])])
    (error,) = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert error["custom_id"] == "s2" and "response_format" in error["error"]["message"]


def test_logprobs_name_the_greedy_token_first_streamed_or_not_and_in_batch_lines(gateway):
    base, _, _ = gateway
    client = sdk(base, KEY_A)
    answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0.0,
                                            logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens == 8
    for token in content:
        assert len(token.top_logprobs) == 3 and token.top_logprobs[0].token == token.token
        assert token.top_logprobs[0].logprob == token.logprob <= 0
        assert token.logprob >= token.top_logprobs[1].logprob >= token.top_logprobs[2].logprob
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0.0,
                                            logprobs=True, top_logprobs=3, stream=True,
                                            extra_body={"ignore_eos": True})
    streamed = [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]  # (a cached prompt may move a last digit)
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-4)

    legacy = client.completions.create(model=MODEL, prompt="Tell me", max_tokens=5, logprobs=2,
                                       extra_body={"ignore_eos": True})
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(top) <= 2 and max(top.values()) == chosen for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    without = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    assert without.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=21)
    assert caught.value.param == "top_logprobs"

    line = json.dumps({"custom_id": "lp", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "ignore_eos": True,
                                "logprobs": True, "top_logprobs": 3}})
    uploaded = client.files.create(file=("logprobs.jsonl", line.encode()), purpose="batch")
    done = wait_for_batch(client, client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                                        completion_window="24h").id,
                          ("completed", "failed", "expired", "cancelled"))
    (output,) = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    batch_content = output["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert [t["token"] for t in batch_content] == [t.token for t in content]
    assert [t["logprob"] for t in batch_content] == pytest.approx([t.logprob for t in content], abs=1e-4)


def test_n_choices_come_back_indexed_streamed_or_not_and_usage_counts_them_all(gateway):
    base, _, _ = gateway
    client = sdk(base, KEY_A)
    request = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "temperature": 1.0, "seed": 5,
               "extra_body": {"ignore_eos": True}}
    answer = client.chat.completions.create(n=3, **request)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert answer.usage.completion_tokens == 18 and all(c.finish_reason == "length" for c in answer.choices)
    texts = [c.message.content for c in answer.choices]
    assert len(set(texts)) > 1  # each choice draws with its own seed
    assert client.chat.completions.create(n=1, **request).choices[0].message.content == texts[0]

    streamed, finishes = {0: "", 1: "", 2: ""}, {}
    for chunk in client.chat.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **request):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
        if chunk.usage:
            assert chunk.usage.completion_tokens == 18
    assert [streamed[i] for i in range(3)] == texts and finishes == {0: "length", 1: "length", 2: "length"}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(n=17, **request)
    assert caught.value.param == "n"
