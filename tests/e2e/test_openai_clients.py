"""The clients people point at OpenAI-compatible servers, unchanged, against a real `batcher serve`, a real
`batcher worker` and the real Redis: the official `openai` SDK (the modern Chat Completions fields, tools with
every tool_choice, streamed and not, a conversation that returns a tool result, the completions extras) and
langchain-openai's ChatOpenAI (invoke, stream, batch, bind_tools, with_structured_output).

The worker serves a tiny random Llama whose chat template reads tools (tests/tiny_models.py): its answers are
noise, but the grammar makes every call it makes well formed, which is what these clients depend on."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Literal

import jsonschema
import openai
import pytest
from langchain_openai import ChatOpenAI
from openai import OpenAI
from pydantic import BaseModel

from rqbatcher.client import Client
from rqbatcher.jobs.admin import list_workers
from tests.e2e.test_workers import start_worker, stop, wait_ready
from tests.jobs_support import wait_for
from tests.reliability.support import free_port
from tests.tiny_models import VOCAB_SIZE, build_tool_model

pytestmark = pytest.mark.timeout(300)
QUEUE = "oai"
MODEL = "tiny-tools"
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}, "days": {"type": "integer",
                                                                                       "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
ZONE = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "The forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": ZONE}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": ZONE}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def server(e2e_redis, tmp_path_factory):
    """A worker serving MODEL on QUEUE and a gateway in front of it: (base url, Redis url)."""
    url, connection = e2e_redis
    logs = tmp_path_factory.mktemp("oai")
    model_dir = build_tool_model(tmp_path_factory.mktemp("tool-model"))
    name, worker = start_worker(url, model_dir, QUEUE, logs / "worker.log", 8, "--served-model-name", MODEL)
    port = free_port()
    gateway = subprocess.Popen([sys.executable, "-m", "rqbatcher", "serve", "--port", str(port), "--redis-url", url,
                                "--queue", QUEUE], stdout=subprocess.DEVNULL, stderr=(logs / "gateway.log").open("w"))
    base = f"http://127.0.0.1:{port}/v1"
    try:
        wait_ready(connection, name, worker)
        wait_for(lambda: name in [w.name for w in list_workers(connection)], 30, "the worker's stats")

        def serving() -> bool:
            assert gateway.poll() is None, (logs / "gateway.log").read_text()
            try:
                return MODEL in [m.id for m in sdk(base).models.list()]
            except openai.APIConnectionError:
                return False

        wait_for(serving, 60, "the gateway to list the worker's model")
        yield base, url
    finally:
        stop(gateway)
        stop(worker)


def sdk(base: str) -> OpenAI:
    return OpenAI(base_url=base, api_key="unused", max_retries=0)


def calls_of(message) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, each checked against its tool's schema."""
    found = []
    for call in message.tool_calls or ():
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        found.append((call.function.name, arguments))
    return found


def streamed_calls(chunks) -> tuple[str, list[tuple[str, dict]], str]:
    """Content, calls and finish reason of a streamed answer, accumulated as the SDK's docs show."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for piece in choice.delta.tool_calls or ():
                call = calls.setdefault(piece.index, {"id": piece.id, "name": "", "arguments": ""})
                call["name"] += piece.function.name or ""
                call["arguments"] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    for call in calls.values():
        assert call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    return content, [(c["name"], json.loads(c["arguments"])) for c in calls.values()], finish


# ----- the openai SDK -----
@pytest.mark.parametrize("tool_choice", ["none", "auto", "required", "named"])
def test_tools_with_each_tool_choice_answer_the_same_streamed_and_not(server, tool_choice):
    base, _ = server
    client = sdk(base)
    choice = {"type": "function", "function": {"name": "get_time"}} if tool_choice == "named" else tool_choice
    common = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=100, temperature=0,
                  parallel_tool_calls=False)
    answer = client.chat.completions.create(**common)
    message, finish = answer.choices[0].message, answer.choices[0].finish_reason
    calls = calls_of(message)
    content, streamed, streamed_finish = streamed_calls(client.chat.completions.create(**common, stream=True))
    assert (content or None, streamed, streamed_finish) == (message.content, calls, finish)
    if tool_choice in ("required", "named"):
        assert len(calls) == 1 and message.content is None and finish in ("tool_calls", "length")
        assert tool_choice == "required" or calls[0][0] == "get_time"
    if tool_choice == "none":
        assert not calls and message.content and finish in ("stop", "length")
    if tool_choice == "auto":  # text, or a call that validates (checked above), never a malformed one
        assert bool(calls) != bool(message.content) and (not calls or finish in ("tool_calls", "length"))


def test_a_conversation_returns_the_tool_result_on_the_next_turn(server):
    base, _ = server
    client = sdk(base)
    messages = list(ASK)
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                           max_tokens=100, parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    messages.append(first.choices[0].message)  # the SDK's own object, as its docs do
    messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "snow"}'})
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=8)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
    with pytest.raises(openai.BadRequestError) as refused:  # a result that answers no call
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            *ASK, {"role": "tool", "tool_call_id": "call_unknown", "content": "x"}])
    assert refused.value.body["param"] == "messages"


def test_bad_tools_and_choices_are_refused_naming_the_field(server):
    client = sdk(server[0])
    cases = [(dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]), "tools"),
             (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "missing"}}), "tool_choice"),
             (dict(logit_bias={str(VOCAB_SIZE + 5): 10}), "logit_bias")]
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, **fields)
        assert refused.value.body["param"] == param, refused.value.body


def test_the_modern_sampling_fields_are_honoured_and_metadata_and_user_stay_with_the_job(server):
    base, url = server
    client = sdk(base)
    answer = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=6, n=2, seed=3, temperature=0.8, frequency_penalty=1.5,
        presence_penalty=-0.5, logit_bias={"7": 5}, metadata={"team": "search", "run": "e2e"}, user="user-42",
        store=False, extra_body={"ignore_eos": True})
    assert [c.index for c in answer.choices] == [0, 1] and answer.usage.completion_tokens == 12
    shown = subprocess.run([sys.executable, "-m", "rqbatcher", "status", "--redis-url", url,
                            answer.id.removeprefix("chatcmpl-")], capture_output=True, text=True, check=True).stdout
    assert "user: user-42" in shown and "'team': 'search'" in shown
    banned = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, logprobs=True,
                                            extra_body={"ignore_eos": True})
    top = banned.choices[0].logprobs.content[0].token
    token_id = Client(url, queue=QUEUE).result(banned.id.removeprefix("chatcmpl-")).token_ids[0]
    rebiased = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, logprobs=True,
                                              logit_bias={str(token_id): -100}, extra_body={"ignore_eos": True})
    assert rebiased.choices[0].logprobs.content[0].token != top


def test_every_chunk_carries_the_usage_so_far_with_continuous_usage_stats(server):
    client = sdk(server[0])
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about queues"}], max_tokens=7, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"  # sent before the prompt's usage is known
    after = chunks[1:]
    assert any(c.choices and c.choices[0].delta.content for c in after)
    assert all(c.usage is not None and c.usage.prompt_tokens > 0 for c in after)
    counts = [c.usage.completion_tokens for c in after]
    assert counts == sorted(counts) and counts[0] > 0 and counts[-1] == 7


def test_completions_echo_best_of_and_a_refused_suffix(server):
    client = sdk(server[0])
    echoed = client.completions.create(model=MODEL, prompt="Queues and streams", max_tokens=4, echo=True)
    assert echoed.choices[0].text.startswith("Queues and streams") and len(echoed.choices[0].text) > 18
    best = client.completions.create(model=MODEL, prompt="Queues", max_tokens=4, n=2, best_of=4, temperature=1.0,
                                     seed=5, extra_body={"ignore_eos": True})
    assert [c.index for c in best.choices] == [0, 1] and best.usage.completion_tokens == 16  # all four are billed
    for fields, param in [(dict(suffix="end"), "suffix"), (dict(best_of=3, stream=True), "best_of")]:
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=MODEL, prompt="Queues", max_tokens=2, **fields)
        assert refused.value.body["param"] == param


class Country(BaseModel):
    capital: Literal["Oslo", "Lima"]
    population: int
    area_km2: float


def test_the_sdks_parse_finishes_on_unbounded_integers_and_numbers(server):
    """A greedy model writing digits used to run to max_tokens, and `parse` raised LengthFinishReasonError."""
    parsed = sdk(server[0]).chat.completions.parse(model=MODEL, messages=ASK, response_format=Country, max_tokens=120)
    assert parsed.choices[0].finish_reason == "stop" and isinstance(parsed.choices[0].message.parsed, Country)


# ----- langchain-openai -----
class GetWeather(BaseModel):
    """The forecast for a city."""

    city: Literal["Oslo", "Lima"]
    days: int


class Forecast(BaseModel):
    city: Literal["Oslo", "Lima"]
    snow: bool


def test_langchain_chat_openai_invokes_streams_batches_binds_tools_and_structures(server):
    llm = ChatOpenAI(base_url=server[0], api_key="unused", model=MODEL, temperature=0, max_tokens=8, max_retries=0)
    said = llm.invoke("Tell me about queues")
    assert isinstance(said.content, str) and said.response_metadata["finish_reason"] in ("stop", "length")
    assert "".join(chunk.content for chunk in llm.stream("Tell me about queues")) == said.content
    assert [m.content for m in llm.batch(["Tell me about queues", "Tell me about queues"])] == [said.content] * 2
    tooled = llm.bind_tools([GetWeather], tool_choice="GetWeather").invoke("Weather in Oslo?", max_tokens=150)
    assert [call["name"] for call in tooled.tool_calls] == ["GetWeather"]
    GetWeather.model_validate(tooled.tool_calls[0]["args"])
    structured = llm.with_structured_output(Forecast).invoke("Will it snow in Lima?", max_tokens=60)
    assert isinstance(structured, Forecast)

