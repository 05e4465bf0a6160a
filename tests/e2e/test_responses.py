"""OpenAI's Responses API through the official `openai` SDK: a real `batcher serve` with two API keys (two tenants),
a real `batcher worker` on a tiny random Llama whose template reads tools, and the real Redis.

The model's answers are noise; grammars make them well formed where it matters (a call's arguments, JSON text). A
long answer comes from a schema whose one string has a fixed length: the grammar allows no end before it. The
crash test adds a second worker and SIGKILLs whichever runs the background response."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import jsonschema
import openai
import pytest
from openai import OpenAI

from rqbatcher.client import Client
from rqbatcher.jobs.admin import list_workers
from rqbatcher.jobs.keys import stream_key
from rqbatcher.schema import StreamEvent
from tests.e2e.test_workers import start_worker, stop, wait_ready
from tests.jobs_support import wait_for
from tests.reliability.support import free_port
from tests.tiny_models import build_tool_model

pytestmark = pytest.mark.timeout(300)
QUEUE = "resp"
MODEL = "tiny-resp"
KEY_A, KEY_B = "sk-resp-tenant-a", "sk-resp-tenant-b"
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The forecast", "parameters": WEATHER}]
SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
LONG_CHARS = 300  # a job that runs for a few hundred steps


def long_format(chars: int = LONG_CHARS) -> dict:
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": chars, "maxLength": chars}},
              "required": ["s"], "additionalProperties": False}
    return {"format": {"type": "json_schema", "name": "long", "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def workers() -> dict[str, subprocess.Popen]:
    running: dict[str, subprocess.Popen] = {}
    yield running
    for process in running.values():
        stop(process)


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    return build_tool_model(tmp_path_factory.mktemp("resp-model"))


def add_worker(workers, url: str, connection, model_dir, log) -> str:
    name, process = start_worker(url, model_dir, QUEUE, log, 8, "--served-model-name", MODEL)
    workers[name] = process
    wait_ready(connection, name, process)
    wait_for(lambda: name in [w.name for w in list_workers(connection)], 30, f"worker {name} to publish its stats")
    return name


@pytest.fixture(scope="module")
def gateway(e2e_redis, tool_model, tmp_path_factory, workers):
    """(tenant A's SDK, tenant B's SDK, Redis url, Redis connection)."""
    url, connection = e2e_redis
    logs = tmp_path_factory.mktemp("resp")
    port = free_port()
    env = {**os.environ, "BATCHER_API_KEYS": f"{KEY_A},{KEY_B}"}
    server = subprocess.Popen([sys.executable, "-m", "rqbatcher", "serve", "--port", str(port), "--redis-url", url,
                               "--queue", QUEUE], env=env, stdout=subprocess.DEVNULL,
                              stderr=(logs / "gateway.log").open("w"))
    a, b = (OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0) for key in (KEY_A, KEY_B))
    try:
        add_worker(workers, url, connection, tool_model, logs / "worker.log")

        def serving() -> bool:
            assert server.poll() is None, (logs / "gateway.log").read_text()
            try:
                return MODEL in [m.id for m in a.models.list()]
            except openai.APIConnectionError:
                return False

        wait_for(serving, 60, "the gateway to list the worker's model")
        yield a, b, url, connection
    finally:
        stop(server)


def finished(client: OpenAI, response_id: str, timeout: float = 90):
    return wait_for(lambda: (r := client.responses.retrieve(response_id)).status not in ("queued", "in_progress")
                    and r, timeout, f"response {response_id} to end", interval=0.2)


def check_sequence(events) -> None:
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_response_its_instructions_and_its_stored_copy(gateway):
    a, _, _, _ = gateway
    response = a.responses.create(model=MODEL, input="hi", instructions="Answer briefly.", max_output_tokens=8,
                                  metadata={"k": "v"})
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status in ("completed", "incomplete") and response.instructions == "Answer briefly."
    assert response.output_text == response.output[0].content[0].text and response.output[0].role == "assistant"
    assert response.usage.output_tokens <= 8 and response.usage.total_tokens > response.usage.output_tokens
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    stored = a.responses.retrieve(response.id)
    assert stored.model_dump(exclude={"created_at"}) == response.model_dump(exclude={"created_at"})
    items = a.responses.input_items.list(response.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "hi")]
    three = a.responses.create(model=MODEL, max_output_tokens=2, input=[
        {"role": "user", "content": text} for text in ("one", "two", "three")])
    page = a.responses.input_items.list(three.id, order="asc", limit=2)
    assert [i.content[0].text for i in page.data] == ["one", "two"] and page.has_more
    rest = a.responses.input_items.list(three.id, order="asc", after=page.last_id)
    assert [i.content[0].text for i in rest.data] == ["three"] and not rest.has_more
    newest = a.responses.input_items.list(three.id, limit=1)  # OpenAI's default order: newest first
    assert newest.first_id == newest.last_id == rest.last_id
    a.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(response.id)


def test_text_format_json_schema_answers_json_that_validates(gateway):
    a, _, _, _ = gateway
    text = {"format": {"type": "json_schema", "name": "answer", "schema": SMALL, "strict": True}}
    response = a.responses.create(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text",
                                                                                     "text": "ok?"}]}],
                                  text=text, max_output_tokens=40)
    assert response.status == "completed" and response.text.format.type == "json_schema"
    jsonschema.validate(json.loads(response.output_text), SMALL)


def test_a_function_call_and_its_output_continue_the_conversation(gateway):
    a, b, _, _ = gateway
    called = a.responses.create(model=MODEL, input="Weather in Oslo?", tools=TOOLS, tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=60)
    (call,) = called.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    follow_up = a.responses.create(model=MODEL, previous_response_id=called.id, tools=TOOLS, tool_choice="none",
                                   input=[{"type": "function_call_output", "call_id": call.call_id,
                                           "output": "sunny"}], max_output_tokens=8)
    assert follow_up.previous_response_id == called.id and follow_up.output[0].type == "message"
    stateless = a.responses.create(model=MODEL, tools=TOOLS, max_output_tokens=8, input=[
        {"role": "user", "content": "Weather in Oslo?"}, call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert stateless.status in ("completed", "incomplete")
    with pytest.raises(openai.NotFoundError):  # another tenant's response
        b.responses.create(model=MODEL, previous_response_id=called.id, input="and now?")
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(called.id)
    with pytest.raises(openai.NotFoundError) as unknown:
        a.responses.create(model=MODEL, previous_response_id="resp_unknown0", input="and now?")
    assert unknown.value.body["param"] == "previous_response_id"


def test_an_image_part_is_refused_naming_input(gateway):
    a, _, _, _ = gateway
    with pytest.raises(openai.BadRequestError) as refused:
        a.responses.create(model=MODEL, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "https://example.com/x.png", "detail": "auto"}]}])
    assert refused.value.body["param"] == "input"


def test_a_stream_sends_its_events_in_order_numbered_from_zero(gateway):
    a, _, _, _ = gateway
    events = list(a.responses.create(model=MODEL, input="hi", max_output_tokens=12, stream=True))
    check_sequence(events)
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete") and len(deltas) == kinds.count(
        "response.output_text.delta") == len(kinds) - 8
    assert events[-1].response.output_text == "".join(deltas) == events[-4].text
    assert a.responses.retrieve(events[0].response.id).output_text == "".join(deltas)


def test_a_background_response_polls_to_completed_and_its_stream_resumes(gateway):
    a, _, _, _ = gateway
    queued = a.responses.create(model=MODEL, input="hi", background=True, text=long_format(60),
                                max_output_tokens=200)
    assert queued.status == "queued" and queued.background
    done = finished(a, queued.id)
    assert done.status == "completed" and len(json.loads(done.output_text)["s"]) == 60
    full = list(a.responses.retrieve(queued.id, stream=True))
    check_sequence(full)
    assert full[-1].type == "response.completed" and full[-1].response.output_text == done.output_text
    middle = len(full) // 2
    tail = list(a.responses.retrieve(queued.id, stream=True, starting_after=middle))
    assert [e.model_dump() for e in tail] == [e.model_dump() for e in full[middle + 1:]]


def test_cancelling_a_background_response(gateway):
    a, _, url, _ = gateway
    queued = a.responses.create(model=MODEL, input="hi", background=True, text=long_format(2000),
                                max_output_tokens=3000)
    cancelled = a.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    wait_for(lambda: Client(url, queue=QUEUE).status(queued.id.removeprefix("resp_")).status in ("stopped",
                                                                                                  "canceled"),
             20, "the job to stop")
    assert a.responses.retrieve(queued.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):  # only background responses can be cancelled
        a.responses.cancel(a.responses.create(model=MODEL, input="hi", max_output_tokens=2).id)


def test_a_background_response_survives_its_worker_and_its_stream_has_no_gap_and_no_repeat(
        gateway, workers, tool_model, tmp_path):
    a, _, url, connection = gateway
    add_worker(workers, url, connection, tool_model, tmp_path / "second.log")
    client = Client(url, queue=QUEUE)
    queued = a.responses.create(model=MODEL, input="hi", background=True, text=long_format(), max_output_tokens=600)
    job_id = queued.id.removeprefix("resp_")

    def frozen_mid_answer() -> str | None:
        """The worker running the job, stopped (SIGSTOP) at its first tokens: a tiny model answers in under a
        second, and its stream writer sends many tokens a flush, so it is frozen before it can finish, and killed
        only once the test knows it had not."""
        if connection.xlen(stream_key(job_id)) < 2:  # its `start`, then its first tokens
            return None
        running_on = client.status(job_id).worker
        workers[running_on].send_signal(signal.SIGSTOP)
        return running_on

    running_on = wait_for(frozen_mid_answer, 60, "tokens to flow", interval=0.005)
    streamed = [StreamEvent.from_fields(fields).type for _, fields in connection.xrange(stream_key(job_id))]
    assert "done" not in streamed, "the job ended before its worker was stopped"
    workers[running_on].send_signal(signal.SIGKILL)
    done = finished(a, queued.id, timeout=120)
    result = client.result(job_id, timeout=10)
    assert done.status == "completed" and result.worker != running_on
    raw = [StreamEvent.from_fields(fields) for _, fields in connection.xrange(stream_key(job_id))]
    kinds = [e.type for e in raw]
    assert kinds.count("start") == 2 and kinds.count("done") == 1 and "restart" not in kinds  # resumed, ended once
    assert len(json.loads(done.output_text)["s"]) == LONG_CHARS and done.output_text == result.text
    full = list(a.responses.retrieve(queued.id, stream=True))
    check_sequence(full)
    assert "".join(e.delta for e in full if e.type == "response.output_text.delta") == result.text
    tail = list(a.responses.retrieve(queued.id, stream=True, starting_after=10))
    assert [e.model_dump() for e in tail] == [e.model_dump() for e in full[11:]]
