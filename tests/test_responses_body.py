"""Responses API bodies in, response objects and stream events out (batcher/openai/responses/responses_body.py,
batcher/openai/responses/response_items.py, batcher/gateway/response_events.py), and the stored records
(batcher/gateway/response_records.py, on fakeredis): no worker."""

from __future__ import annotations

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from rqbatcher.gateway.response_events import ResponseEvents
from rqbatcher.gateway.response_records import ResponseNotFound, ResponseRecord, ResponseRecords
from rqbatcher.openai.generation_body import BodyError
from rqbatcher.openai.responses.response_items import answer_messages, input_items
from rqbatcher.openai.responses.responses_body import echo_fields, parse_responses_body, response_object
from rqbatcher.schema import ChatMessage, GenerationResult, StreamEvent, Usage
from rqbatcher.tools.calls import call_id
from tests.jobs_support import fake_redis_fixture  # noqa: F401

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}}, "required": ["city"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The forecast", "parameters": WEATHER}]
JOB = "0123456789abcdef"
RESPONSE_ID = "resp_" + JOB
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
EVENTS = TypeAdapter(ResponseStreamEvent)


def result(text: str, finish_reason: str = "stop") -> GenerationResult:
    return GenerationResult(text=text, token_ids=list(range(len(text))), finish_reason=finish_reason,
                            usage=Usage(prompt_tokens=5, completion_tokens=len(text), cached_tokens=2), model="m")


def rendered(body: dict, answer: GenerationResult | None, status: str = "completed") -> Response:
    request = parse_responses_body(body)
    return Response.model_validate(response_object(request, answer, response_id=RESPONSE_ID, created_at=1,
                                                   status=status, **echo_fields(body)))


# ----- bodies in -----
def test_input_and_instructions_become_messages_instructions_first():
    request = parse_responses_body({"model": "m", "instructions": "Be brief.", "input": [
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "ok", "annotations": []}], "id": "msg_1",
         "status": "completed"}]})
    assert [(m.role, m.content) for m in request.messages] == [("system", "Be brief."), ("system", "Rules."),
                                                               ("user", "a\nb"), ("assistant", "ok")]
    assert parse_responses_body({"input": "hi"}).messages == [ChatMessage(role="user", content="hi")]


def test_function_call_items_become_tool_calls_and_their_outputs_tool_messages():
    request = parse_responses_body({"input": [
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Lima"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]}],
        "tools": TOOLS})
    assistant = request.messages[1]
    assert [c.id for c in assistant.tool_calls] == ["call_1", "call_2"] and assistant.content is None
    assert [(m.role, m.tool_call_id, m.content) for m in request.messages[2:]] == [("tool", "call_1", "sunny"),
                                                                                 ("tool", "call_2", "rain")]


def test_sampling_tools_text_format_and_echoed_fields_are_honoured():
    request = parse_responses_body({"input": "x", "max_output_tokens": 30, "temperature": 0.5, "top_p": 0.9,
                                    "tools": TOOLS, "tool_choice": {"type": "function", "name": "get_weather"},
                                    "parallel_tool_calls": False, "metadata": {"k": "v"}, "user": "u",
                                    "service_tier": "flex"})
    assert (request.sampling.max_tokens, request.sampling.temperature, request.sampling.top_p) == (30, 0.5, 0.9)
    assert request.tools[0].function.name == "get_weather" and request.tool_choice.function.name == "get_weather"
    assert (request.parallel_tool_calls, request.metadata, request.user, request.service_class) == (
        False, {"k": "v"}, "u", "batch")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    formatted = parse_responses_body({"input": "x", "text": {"format": {"type": "json_schema", "name": "a",
                                                                        "schema": schema, "strict": True}}})
    assert formatted.response_format.json_schema.schema_ == schema
    assert parse_responses_body({"input": "x", "text": {"format": {"type": "json_object"}}}).response_format.type \
        == "json_object"


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": []}, "input"),
    ({"input": "x", "frobnicate": 1}, "frobnicate"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "prompt": {"id": "p"}}, "prompt"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "x", "background": True, "store": False}, "background"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text"),
    ({"input": "x", "service_tier": "fast"}, "service_tier"),
])
def test_bad_bodies_are_refused_naming_the_field(body, param):
    with pytest.raises(BodyError) as refused:
        parse_responses_body(body)
    assert refused.value.param == param


def test_ignored_fields_and_nulls_are_accepted():
    request = parse_responses_body({"input": "x", "reasoning": {"effort": "low"}, "truncation": "auto",
                                    "include": ["reasoning.encrypted_content"], "prompt_cache_key": "k",
                                    "safety_identifier": "s", "top_logprobs": 3, "max_tool_calls": 2,
                                    "temperature": None, "tools": None, "store": None, "text": {"verbosity": "low"}})
    assert request.sampling.temperature == 0.0 and request.tools is None


def test_a_batch_line_refuses_what_only_a_gateway_can_do():
    for field, value in (("previous_response_id", "resp_1"), ("background", True), ("stream", True)):
        with pytest.raises(BodyError) as refused:
            parse_responses_body({"input": "x", field: value}, batch_line=True)
        assert refused.value.param == field
    assert parse_responses_body({"input": "x", "stream": False, "background": False}, batch_line=True)


def test_a_previous_conversation_goes_between_the_instructions_and_the_input():
    earlier = parse_responses_body({"input": "weather?", "tools": TOOLS})
    before = earlier.messages + answer_messages(earlier, result(CALL_TEXT), JOB)
    request = parse_responses_body({"instructions": "New rules.", "tools": TOOLS, "input": [
        {"type": "function_call_output", "call_id": call_id(JOB, 0, 0), "output": "sunny"}]}, conversation=before)
    assert [m.role for m in request.messages] == ["system", "user", "assistant", "tool"]


def test_input_items_are_listed_with_ids_and_content_parts():
    items = input_items("hi", JOB)
    assert items[0]["content"] == [{"type": "input_text", "text": "hi"}] and items[0]["id"].startswith("msg_")
    assert input_items("hi", JOB) == items  # ids derive from the job


# ----- response objects out -----
def test_a_text_answer_is_one_message_and_the_sdks_output_text_works():
    response = rendered({"input": "hi", "instructions": "Be brief.", "metadata": {"k": "v"}}, result("Hello"))
    assert response.output_text == "Hello" and response.output[0].content[0].annotations == []
    assert (response.instructions, response.metadata, response.status, response.store) == ("Be brief.", {"k": "v"},
                                                                                           "completed", True)
    assert (response.usage.input_tokens, response.usage.input_tokens_details.cached_tokens,
            response.usage.output_tokens, response.usage.total_tokens) == (5, 2, 5, 10)


def test_a_call_answer_is_function_call_items_and_a_cut_one_is_incomplete():
    response = rendered({"input": "weather?", "tools": TOOLS}, result(CALL_TEXT))
    (call,) = response.output
    assert (call.type, call.name, call.arguments, call.call_id) == ("function_call", "get_weather",
                                                                    '{"city": "Oslo"}', call_id(JOB, 0, 0))
    assert response.tools[0].name == "get_weather" and response.tool_choice == "auto"
    cut = rendered({"input": "hi"}, result("Hel", "length"), status="incomplete")
    assert cut.incomplete_details.reason == "max_output_tokens" and cut.output[0].status == "incomplete"
    queued = rendered({"input": "hi", "background": True}, None, status="queued")
    assert (queued.output, queued.usage, queued.background) == ([], None, True)


# ----- stream events -----
def tokens(execution: str, pieces: list[str], start: int = 0) -> list[StreamEvent]:
    return [StreamEvent(type="token", execution_id=execution, text=piece, token_ids=[start + i], index=start + i)
            for i, piece in enumerate(pieces)]


def events_of(body: dict, stream: list[StreamEvent]) -> list[dict]:
    builder = ResponseEvents(parse_responses_body(body), response_id=RESPONSE_ID, created_at=1, **echo_fields(body))
    events = builder.opening()
    for event in stream:
        events += builder.feed(event)
    for event in events:
        EVENTS.validate_python(event)  # the SDK's own shapes
    return events


DONE = StreamEvent(type="done", execution_id="e2", finish_reason="stop", usage=Usage(prompt_tokens=3,
                                                                                     completion_tokens=4))


def test_a_resumed_job_streams_its_text_once_and_a_replay_numbers_the_same():
    """A crash after two tokens: the rerun's `start` continues from the stream's tokens (index 2 on)."""
    stream = [StreamEvent(type="start", execution_id="e1"), *tokens("e1", ["He", "ll"]),
              StreamEvent(type="start", execution_id="e2"), *tokens("e2", ["o ", "you"], start=2), DONE]
    events = events_of({"input": "hi"}, stream)
    assert events == events_of({"input": "hi"}, stream)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * 4, "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert "".join(e["delta"] for e in events if "delta" in e) == "Hello you" == events[-1]["response"]["output"][0][
        "content"][0]["text"]


def test_a_restarted_attempt_holds_back_the_tokens_already_sent():
    stream = [StreamEvent(type="start", execution_id="e1"), *tokens("e1", ["He", "ll"]),
              StreamEvent(type="restart", execution_id="e2"), *tokens("e2", ["He", "ll", "o"]), DONE]
    events = events_of({"input": "hi"}, stream)
    assert [e["delta"] for e in events if "delta" in e] == ["He", "ll", "o"]


def test_calls_stream_as_function_call_items_and_a_background_one_starts_queued():
    pieces = [CALL_TEXT[:20], CALL_TEXT[20:50], CALL_TEXT[50:]]
    events = events_of({"input": "weather?", "tools": TOOLS, "background": True},
                       [StreamEvent(type="start", execution_id="e2"), *tokens("e2", pieces), DONE])
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.queued", "response.in_progress", "response.output_item.added"]
    assert events[0]["response"]["status"] == "queued" and events[3]["item"]["type"] == "function_call"
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert arguments == events[-3]["arguments"] == '{"city": "Oslo"}'


def test_a_cancelled_or_failed_job_ends_the_stream_with_response_failed():
    cancelled = events_of({"input": "hi"}, [StreamEvent(type="done", execution_id="e1", finish_reason="cancelled")])
    assert cancelled[-1]["type"] == "response.failed" and cancelled[-1]["response"]["status"] == "cancelled"
    failed = events_of({"input": "hi"}, [StreamEvent(type="error", execution_id="e1", error="too long")])
    assert failed[-1]["response"]["error"]["message"] == "too long"


# ----- stored records -----
def test_a_record_is_its_tenants_only_and_expires_with_its_retention(fake_redis):
    body = {"input": "hi", "instructions": "Be brief."}
    records = ResponseRecords(fake_redis, retention_s=60)
    record = ResponseRecord(id=RESPONSE_ID, tenant="key-a", created_at=1, model="m",
                            request=parse_responses_body(body), echo=echo_fields(body), input_items=[])
    records.save(record)
    assert records.get(RESPONSE_ID, "key-a") == record and 0 < fake_redis.ttl(f"batcher:response:{RESPONSE_ID}") <= 60
    assert record.job_id == JOB and record.conversation == [ChatMessage(role="user", content="hi")]
    for response_id, tenant in ((RESPONSE_ID, "key-b"), (RESPONSE_ID, None), ("resp_nope", "key-a"),
                                ("not-a-response", "key-a")):
        with pytest.raises(ResponseNotFound):
            records.get(response_id, tenant)
    records.delete(RESPONSE_ID, "key-a")
    with pytest.raises(ResponseNotFound):
        records.get(RESPONSE_ID, "key-a")
