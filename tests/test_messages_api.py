"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens), driven by the real `anthropic` SDK against the
gateway in-process (Starlette's TestClient as the SDK's HTTP client) on fakeredis, with a worker thread running a
fake engine: text, system prompts, turns, streams, tool_use blocks and tool results, stop sequences, counts, and the
errors in Anthropic's shape; and the stop string as vLLM's `stop_reason` on the chat endpoint (the `openai` SDK)."""

from __future__ import annotations

import json
from dataclasses import replace

import anthropic
import openai
import pytest
from fakeredis import aioredis
from starlette.testclient import TestClient

from rqbatcher.anthropic_messages.message_object import message_object
from rqbatcher.anthropic_messages.request_body import InvalidBody, parse_count_tokens_body, parse_messages_body
from rqbatcher.gateway.app import GatewayConfig, create_app
from rqbatcher.gateway.auth import ApiKeys
from rqbatcher.gateway.tenant_limits import Limits
from rqbatcher.reasoning import THINK, THINKING_SWITCH
from rqbatcher.schema import ChatFormat, GenerationResult, Usage
from rqbatcher.tools.grammar import call_text
from tests.fake_engine import FakeEngine, expected_text
from tests.jobs_support import fake_redis_fixture, keep_signal_handlers_fixture, wait_for  # noqa: F401
from tests.letter_engine import letter_prompt_ids
from tests.test_gateway import MODEL, gateway, worker_fixture, worker_serving  # noqa: F401

KEY = "key-of-a"
BOOM = "boom"
SAY = "say:"  # a last message starting so is answered with the rest of its text (ScriptedEngine)
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


class ScriptedEngine(FakeEngine):
    """The fake engine, but a chat whose last message starts with SAY is answered with the rest of that message,
    a character a token (a tool call's exact text, say), ending `stop` (`length` at max_tokens), or where the earliest
    of the request's stop strings begins (naming it); one of BOOM fails in its first step."""

    def advance(self, request_id, req):
        messages = req.request.messages or []
        if messages and messages[-1].content == BOOM:
            del self.requests[request_id]
            return self.output(request_id, req, [], error="RuntimeError: boom in the forward")
        script = messages[-1].content if messages and (messages[-1].content or "").startswith(SAY) else None
        if script is None:
            return super().advance(request_id, req)
        text = script[len(SAY):]
        hits = [(text.find(s), s) for s in req.request.sampling.stop if s in text]
        at, matched = min(hits) if hits else (len(text), None)
        text = text[:at]
        new = [ord(text[len(req.generated)])] if len(req.generated) < len(text) else []
        req.generated += new
        done = len(req.generated) in (len(text), req.request.sampling.max_tokens)
        if done:
            del self.requests[request_id]
        reason = None if not done else "stop" if len(req.generated) == len(text) else "length"
        out = self.output(request_id, req, new, finish_reason=reason)
        return replace(out, stop_sequence=matched) if reason == "stop" else out


@pytest.fixture(name="scripted_worker")
def scripted_worker_fixture(fake_redis, keep_signal_handlers):
    yield from worker_serving(fake_redis, ScriptedEngine())


@pytest.fixture(name="thinking_worker")
def thinking_worker_fixture(fake_redis, keep_signal_handlers):
    """The scripted engine of a model that marks its reasoning `<think>...</think>` (Qwen3's)."""
    engine = ScriptedEngine()
    engine.chat_format = ChatFormat(reasoning=THINK)
    yield from worker_serving(fake_redis, engine)


@pytest.fixture
def client(gateway):  # noqa: F811
    return anthropic.Anthropic(base_url=str(gateway.base_url), api_key=KEY, http_client=gateway, max_retries=0)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_a_message_answers_with_text_usage_and_stop_reasons(client, worker):
    message = client.messages.create(model=MODEL, max_tokens=4, messages=ask("hi"))
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.id.startswith("msg_")
    assert [(b.type, b.text) for b in message.content] == [("text", expected_text(4))]
    assert (message.stop_reason, message.stop_sequence) == ("max_tokens", None)
    assert message.usage.output_tokens == 4 and message.usage.input_tokens >= 1
    assert message.usage.cache_read_input_tokens == 0
    system = client.messages.create(model=MODEL, max_tokens=2, system=[{"type": "text", "text": "Be brief."}],
                                    messages=[*ask("hi"), {"role": "assistant", "content": [
                                        {"type": "text", "text": "hello"}]},
                                              {"role": "user", "content": [{"type": "text", "text": "more"}]}],
                                    stop_sequences=["zz"], metadata={"user_id": "u-1"},
                                    extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 5})  # not in SDK 2's create
    assert system.content[0].text == expected_text(2)


def test_the_body_becomes_the_chat_request_it_means():
    parsed = parse_messages_body({
        "model": MODEL, "max_tokens": 9, "system": "sys", "stop_sequences": ["END"], "temperature": 0.2,
        "metadata": {"user_id": "u"}, "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        "messages": [*ask("weather?"), {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."}, {"type": "thinking", "thinking": "hm", "signature": "s"},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                {"type": "text", "text": "-3 C"}], "is_error": False}, {"type": "text", "text": "thanks"}]}]})
    generation = parsed.generation
    assert [(m.role, m.content) for m in generation.messages] == [
        ("system", "sys"), ("user", "weather?"), ("assistant", "Let me look."), ("tool", "-3 C"), ("user", "thanks")]
    call = generation.messages[2].tool_calls[0]
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == ("toolu_1", "get_weather",
                                                                                   {"city": "Oslo"})
    assert generation.messages[3].tool_call_id == "toolu_1"
    assert (generation.sampling.max_tokens, generation.sampling.stop, generation.sampling.temperature) == (
        9, ["END"], 0.2)
    assert generation.user == "u" and generation.parallel_tool_calls is False
    assert generation.tool_choice.function.name == "get_weather" and generation.tools[0].function.parameters == (
        WEATHER["input_schema"])
    assert not parsed.stream and not parsed.thinking
    for choice, ours in (({"type": "any"}, "required"), ({"type": "auto"}, "auto"), ({"type": "none"}, "none")):
        body = {"model": MODEL, "max_tokens": 2, "messages": ask("x"), "tools": [WEATHER], "tool_choice": choice}
        assert parse_messages_body(body).generation.tool_choice == ours
    failed = parse_messages_body({"model": MODEL, "max_tokens": 2, "messages": [*ask("x"), {
        "role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}]}, {
        "role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "no such city",
                                     "is_error": True}]}]})
    assert [(m.role, m.content) for m in failed.generation.messages[1:]] == [("assistant", None),
                                                                           ("tool", "Error: no such city")]


@pytest.mark.parametrize("body,param,words", [
    ({"messages": ask("x")}, "max_tokens", "max_tokens"),
    ({"max_tokens": 2, "messages": [{"role": "system", "content": "x"}]}, "messages", "messages[0].role"),
    ({"max_tokens": 2, "messages": ask("x"), "frequency_penalty": 1}, "frequency_penalty", "frequency_penalty"),
    ({"max_tokens": 0, "messages": ask("x")}, "max_tokens", "max_tokens"),
    ({"max_tokens": 2, "messages": ask("x"), "temperature": 1.5}, "temperature", "temperature"),
    ({"max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x"}}]}]}, "messages", "image blocks"),
    ({"max_tokens": 2, "messages": [*ask("x"), {"role": "assistant", "content": "The answer is"}]}, "messages",
     "prefill"),
    ({"max_tokens": 2, "messages": ask("x"), "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "tools", "server tools"),
    ({"max_tokens": 2, "messages": ask("x"), "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice", "nope"),
    ({"max_tokens": 2, "messages": ask("x"), "thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking",
     "budget_tokens"),
    ({"max_tokens": 2, "messages": ask("x"), "metadata": {"team": "a"}}, "metadata", "user_id"),
    ({"max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t9"}]}]},
     "messages", "t9"),
])
def test_a_bad_body_is_refused_naming_its_field(body, param, words):
    with pytest.raises(InvalidBody) as refused:
        parse_messages_body({"model": MODEL, **body})
    assert refused.value.param == param and words in str(refused.value)


def test_bad_requests_raise_the_sdks_errors_in_anthropics_shape(client, gateway, worker):  # noqa: F811
    with pytest.raises(anthropic.BadRequestError) as missing:
        client.post("/v1/messages", body={"model": MODEL, "messages": ask("hi")}, cast_to=anthropic.types.Message)
    assert missing.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                             "message": "max_tokens: Field required"}}
    with pytest.raises(anthropic.BadRequestError, match="role"):
        client.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "robot", "content": "hi"}])
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(model="claude-nope", max_tokens=2, messages=ask("hi"))
    assert unknown.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError) as denied:
        anthropic.Anthropic(base_url=str(gateway.base_url), api_key="wrong", http_client=gateway,
                            max_retries=0).messages.create(model=MODEL, max_tokens=2, messages=ask("hi"))
    assert denied.value.body["error"]["type"] == "authentication_error"
    failed = gateway.post("/v1/messages", headers={"x-api-key": KEY}, json={"model": MODEL, "max_tokens": 2,
                                                                            "messages": ask("hi"), "stream": "yes"})
    assert failed.status_code == 400 and failed.json()["type"] == "error"
    assert gateway.get("/v1/models", headers={"x-api-key": KEY}).status_code == 200  # x-api-key opens every path
    assert set(gateway.get("/v1/models").json()) == {"error"}  # and OpenAI's shape stays OpenAI's


def test_thinking_on_a_model_that_does_not_reason_is_refused(client, worker):
    with pytest.raises(anthropic.BadRequestError, match="thinking is not supported by this model"):
        client.messages.create(model=MODEL, max_tokens=2048, messages=ask("hi"),
                               thinking={"type": "enabled", "budget_tokens": 1024})
    with pytest.raises(anthropic.APIStatusError, match="thinking is not supported by this model"):
        with client.messages.stream(model=MODEL, max_tokens=2048, messages=ask("hi"),
                                    thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
            stream.get_final_message()
    disabled = client.messages.create(model=MODEL, max_tokens=2, messages=ask("hi"), thinking={"type": "disabled"})
    assert disabled.content[0].text == expected_text(2)


def test_a_stream_is_anthropics_event_sequence(client, gateway, worker):  # noqa: F811
    with client.messages.stream(model=MODEL, max_tokens=5, messages=ask("hi")) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == expected_text(5) == final.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == ("max_tokens", 5) and final.usage.input_tokens >= 1
    raw = gateway.post("/v1/messages", headers={"x-api-key": KEY},
                       json={"model": MODEL, "max_tokens": 2, "messages": ask("hi"), "stream": True})
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = [part.split("\n") for part in raw.text.split("\n\n") if part]
    names = [lines[0].removeprefix("event: ") for lines in events]
    assert names == ["message_start", "ping", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]
    assert all(json.loads(lines[1].removeprefix("data: "))["type"] == name for name, lines in zip(names, events))
    assert gateway.get("/metrics").text.count("batcher_gateway_streams 0.0") == 1


def test_a_tool_call_is_a_tool_use_block_and_its_result_a_next_turn(client, scripted_worker):
    called = SAY + call_text("get_weather", '{"city":"Paris"}')
    message = client.messages.create(model=MODEL, max_tokens=200, tools=[WEATHER], messages=ask(called))
    (block,) = message.content
    assert (block.type, block.name, block.input, message.stop_reason) == ("tool_use", "get_weather",
                                                                          {"city": "Paris"}, "tool_use")
    assert block.id.startswith("toolu_")
    with client.messages.stream(model=MODEL, max_tokens=200, tools=[WEATHER], messages=ask(called)) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, b.id, b.name, b.input) for b in streamed.content] == [
        ("tool_use", streamed.content[0].id, "get_weather", {"city": "Paris"})]
    assert streamed.stop_reason == "tool_use" and streamed.content[0].id.startswith("toolu_")
    answered = client.messages.create(model=MODEL, max_tokens=3, tools=[WEATHER], messages=[
        *ask("weather in Paris?"), {"role": "assistant", "content": message.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "18 C"}]}])
    assert [(b.type, b.text) for b in answered.content] == [("text", expected_text(3))]
    assert answered.stop_reason == "max_tokens"


def test_a_scripted_text_answer_ends_its_turn(client, scripted_worker):
    message = client.messages.create(model=MODEL, max_tokens=50, tools=[WEATHER], messages=ask(SAY + "Sunny."))
    assert [(b.type, b.text) for b in message.content] == [("text", "Sunny.")] and message.stop_reason == "end_turn"


def test_a_stop_sequence_ends_the_turn_naming_itself_whole_or_streamed(client, scripted_worker):
    asked = {"model": MODEL, "max_tokens": 50, "messages": ask(SAY + "Sunny. Then rain. END"),
             "stop_sequences": ["END", "Then"]}
    message = client.messages.create(**asked)
    assert [(b.type, b.text) for b in message.content] == [("text", "Sunny. ")]
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "Then")
    with client.messages.stream(**asked) as stream:
        streamed = stream.get_final_message()
    assert (streamed.content[0].text, streamed.stop_reason, streamed.stop_sequence) == (
        "Sunny. ", "stop_sequence", "Then")
    unmatched = client.messages.create(**{**asked, "stop_sequences": ["hail"]})
    assert (unmatched.stop_reason, unmatched.stop_sequence) == ("end_turn", None)


def test_the_chat_endpoint_names_the_stop_string_as_vllms_stop_reason(gateway, scripted_worker):  # noqa: F811
    sdk = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=KEY, http_client=gateway, max_retries=0)
    asked = {"model": MODEL, "max_tokens": 50, "messages": ask(SAY + "Sunny. Then rain."), "stop": ["rain", "Then"]}
    whole = sdk.chat.completions.create(**asked).choices[0]
    assert (whole.message.content, whole.finish_reason, whole.stop_reason) == ("Sunny. ", "stop", "Then")
    last = [chunk for chunk in sdk.chat.completions.create(**asked, stream=True) if chunk.choices][-1].choices[0]
    assert (last.finish_reason, last.stop_reason) == ("stop", "Then")
    plain = sdk.chat.completions.create(**{**asked, "stop": None}).choices[0]
    assert (plain.message.content, plain.stop_reason) == ("Sunny. Then rain.", None)


def test_count_tokens_counts_the_prompt_as_the_worker_renders_it(client, worker):
    body = {"model": MODEL, "system": "Be brief.", "messages": ask("hello"), "tools": [WEATHER]}
    counted = client.messages.count_tokens(**body)
    assert counted.input_tokens == len(letter_prompt_ids(parse_count_tokens_body(body))) > 0
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.messages.count_tokens(model=MODEL, messages=ask("hi"), extra_body={"max_tokens": 3})


def test_usage_leaves_cache_reads_out_of_input_tokens():
    result = GenerationResult(text="hi", token_ids=[1], finish_reason="stop",
                              usage=Usage(prompt_tokens=10, completion_tokens=1, cached_tokens=4))
    answer = message_object(result, "j", MODEL, parse_messages_body({"model": MODEL, "max_tokens": 1,
                                                                      "messages": ask("hi")}).generation)
    assert answer["usage"] == {"input_tokens": 6, "output_tokens": 1, "cache_read_input_tokens": 4,
                               "cache_creation_input_tokens": 0}
    assert answer["stop_reason"] == "end_turn" and answer["content"] == [{"type": "text", "text": "hi"}]


def test_a_tenants_rate_limit_raises_the_sdks_rate_limit_error(fake_redis, worker):
    aconnection = aioredis.FakeRedis(server=fake_redis.connection_pool.connection_kwargs["server"])
    config = GatewayConfig(api_keys=ApiKeys([KEY]), default_limits=Limits(requests_per_minute=1))
    with TestClient(create_app(config, fake_redis, aconnection)) as http:
        limited = anthropic.Anthropic(base_url=str(http.base_url), api_key=KEY, http_client=http, max_retries=0)
        assert limited.messages.create(model=MODEL, max_tokens=1, messages=ask("hi")).content
        with pytest.raises(anthropic.RateLimitError) as refused:
            limited.messages.create(model=MODEL, max_tokens=1, messages=ask("hi"))
    assert refused.value.body["error"]["type"] == "rate_limit_error"
    assert "requests per minute" in refused.value.body["error"]["message"]
    assert int(refused.value.response.headers["retry-after"]) >= 1


def test_a_reasoning_models_thinking_is_a_thinking_block(client, thinking_worker):
    thought = SAY + "<think>It is summer.</think>\n\nSunny."
    thinking = {"type": "enabled", "budget_tokens": 1024}
    message = client.messages.create(model=MODEL, max_tokens=2048, messages=ask(thought), thinking=thinking)
    assert [b.to_dict() for b in message.content] == [
        {"type": "thinking", "thinking": "It is summer.", "signature": ""}, {"type": "text", "text": "Sunny."}]
    with client.messages.stream(model=MODEL, max_tokens=2048, messages=ask(thought), thinking=thinking) as stream:
        streamed = stream.get_final_message()
    assert [b.to_dict() for b in streamed.content] == [b.to_dict() for b in message.content]
    assert streamed.stop_reason == message.stop_reason == "end_turn"
    by_default = client.messages.create(model=MODEL, max_tokens=2048, messages=ask(thought))
    assert [b.type for b in by_default.content] == ["thinking", "text"]  # the model's default: its reasoning apart
    off = parse_messages_body({"model": MODEL, "max_tokens": 2, "messages": ask("x"), "thinking": {"type": "disabled"}})
    assert off.generation.chat_template_kwargs == {THINKING_SWITCH: False} and not off.thinking


def test_a_failed_generation_raises_in_the_sdk_whole_or_streamed(client, scripted_worker):
    with pytest.raises(anthropic.BadRequestError, match="boom in the forward"):
        client.messages.create(model=MODEL, max_tokens=5, messages=ask(BOOM))
    with pytest.raises(anthropic.APIStatusError, match="boom in the forward") as streamed:
        with client.messages.stream(model=MODEL, max_tokens=5, messages=ask(BOOM)) as stream:
            stream.get_final_message()
    assert streamed.value.body["error"]["type"] == "invalid_request_error"
