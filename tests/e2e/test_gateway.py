"""End to end through the official `openai` SDK (a client we did not write): a real `batcher serve` process, a real
`batcher worker` on a tiny model, and the real Redis.

One worker serves `tiny-gw` on queue `gw`; one gateway serves it with two API keys (two tenants) and a small
file limit, so that a 413 is cheap to provoke. The crash test adds a second worker and SIGKILLs whichever runs
its job; the survivor serves whatever runs after it."""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys

import httpx
import openai
import pytest
from openai import OpenAI

from rqbatcher.client import Client
from rqbatcher.jobs.admin import list_workers
from tests.e2e.test_batches import batch_jobs_running
from tests.e2e.test_workers import start_worker, stop, wait_ready
from tests.jobs_support import wait_for
from tests.reliability.support import free_port

pytestmark = pytest.mark.timeout(300)
QUEUE = "gw"
MODEL = "tiny-gw"
KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"
MAX_FILE_BYTES = 20_000
LONG = 450  # tokens: a job that runs for hundreds of steps (the tiny models have 512 positions)
BATCH_END_S = 120


def chat_line(i: int, tokens: int, **body) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"request number {i}"}], "max_tokens": tokens,
            "ignore_eos": True, **body}
    return json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})


@pytest.fixture(scope="module")
def workers() -> dict[str, subprocess.Popen]:
    """The module's worker processes by name; a test may add one (all are stopped at the end)."""
    running: dict[str, subprocess.Popen] = {}
    yield running
    for process in running.values():
        stop(process)


def add_worker(workers, url: str, connection, model_dir, log) -> str:
    """Start a worker and wait until the gateway can see it: listed with its stats, as the model check reads
    them (a killed worker of an earlier module stays listed for two leases, and serves nothing)."""
    name, process = start_worker(url, model_dir, QUEUE, log, 8, "--served-model-name", MODEL)
    workers[name] = process
    wait_ready(connection, name, process)
    wait_for(lambda: name in [w.name for w in list_workers(connection)], 30, f"worker {name} to publish its stats")
    return name


@pytest.fixture(scope="module")
def gateway(e2e_redis, tiny_model_dir, tmp_path_factory, workers):
    """A worker and a gateway: (base url, Redis url, Redis connection)."""
    url, connection = e2e_redis
    logs = tmp_path_factory.mktemp("gw")
    port = free_port()
    env = {**os.environ, "BATCHER_API_KEYS": f"{KEY_A},{KEY_B}"}
    server = subprocess.Popen([sys.executable, "-m", "rqbatcher", "serve", "--port", str(port), "--redis-url", url,
                               "--queue", QUEUE, "--max-file-bytes", str(MAX_FILE_BYTES)],
                              env=env, stdout=subprocess.DEVNULL, stderr=(logs / "gateway.log").open("w"))
    base = f"http://127.0.0.1:{port}"
    try:
        add_worker(workers, url, connection, tiny_model_dir("llama"), logs / "worker.log")

        def serving() -> bool:
            assert server.poll() is None, (logs / "gateway.log").read_text()
            try:
                return MODEL in [m.id for m in sdk(base, KEY_A).models.list()]
            except openai.APIConnectionError:
                return False

        wait_for(serving, 60, "the gateway to list the worker's model")
        yield base, url, connection
    finally:
        stop(server)


def sdk(base: str, key: str) -> OpenAI:
    return OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)


def wait_for_batch(client: OpenAI, batch_id: str, statuses: tuple[str, ...]):
    return wait_for(lambda: (b := client.batches.retrieve(batch_id)).status in statuses and b, BATCH_END_S,
                    f"batch {batch_id} to be {' or '.join(statuses)}")


def test_a_batch_file_runs_to_completed_and_its_files_have_one_line_per_input(gateway):
    base, _, _ = gateway
    a, b = sdk(base, KEY_A), sdk(base, KEY_B)
    bad = {2: "not json", 5: chat_line(5, 3, temperature="hot")}
    lines = [bad.get(i, chat_line(i, 2 + i % 4)) for i in range(8)]
    uploaded = a.files.create(file=("requests.jsonl", "\n".join(lines).encode()), purpose="batch")
    assert (uploaded.purpose, uploaded.bytes) == ("batch", len("\n".join(lines)))
    created = a.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h",
                               metadata={"run": "e2e"})
    assert created.input_file_id == uploaded.id and created.metadata == {"run": "e2e"}
    done = wait_for_batch(a, created.id, ("completed", "failed", "expired", "cancelled"))
    assert done.status == "completed" and done.completed_at >= done.in_progress_at >= done.created_at
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (8, 6, 2)

    output = [json.loads(x) for x in a.files.content(done.output_file_id).text.splitlines()]
    errors = [json.loads(x) for x in a.files.content(done.error_file_id).text.splitlines()]
    assert [o["custom_id"] for o in output] == [f"c{i}" for i in range(8) if i not in bad]
    assert [e["custom_id"] for e in errors] == [None, "c5"]  # an unparsable line has no custom_id to keep
    assert len(output) + len(errors) == counts.total
    for line in output:
        body = openai.types.chat.ChatCompletion.model_validate(line["response"]["body"])
        assert line["response"]["status_code"] == 200 and line["error"] is None
        assert body.usage.completion_tokens == 2 + int(line["custom_id"][1:]) % 4 and body.model == MODEL
    assert all(e["response"] is None and e["error"]["message"] for e in errors)
    assert a.files.retrieve(done.output_file_id).purpose == "batch_output"

    # another tenant sees none of it
    for call in (lambda: b.batches.retrieve(created.id), lambda: b.files.content(done.output_file_id),
                 lambda: b.files.retrieve(uploaded.id), lambda: b.batches.cancel(created.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert created.id not in [x.id for x in b.batches.list()]
    assert created.id in [x.id for x in a.batches.list()]


def test_a_chat_stream_yields_the_text_of_the_jobs_result(gateway):
    base, url, _ = gateway
    a = sdk(base, KEY_A)
    stream = a.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me about queues"}],
                                       max_tokens=24, stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    job_id = chunks[0].id.removeprefix("chatcmpl-")
    result = Client(url, queue=QUEUE).result(job_id, timeout=30)
    assert text == result.text and result.usage.completion_tokens == 24
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 24
    answer = a.completions.create(model=MODEL, prompt="Tell me about queues", max_tokens=5)
    assert answer.choices[0].text == Client(url, queue=QUEUE).result(answer.id.removeprefix("cmpl-")).text


def test_the_sdks_modern_request_shapes_are_understood(gateway):
    """What clients send today: the developer role, content as typed text parts, explicit nulls for defaults,
    fields that mean nothing here (store, user...), and stream options beyond include_usage."""
    base, url, _ = gateway
    a = sdk(base, KEY_A)
    messages = [{"role": "developer", "content": [{"type": "text", "text": "Answer briefly."}]},
                {"role": "user", "content": [{"type": "text", "text": "Tell me"},
                                             {"type": "text", "text": "about queues"}]}]
    common = dict(model=MODEL, messages=messages, max_tokens=6, stop=None, temperature=None, top_p=None, seed=None,
                  store=False, user="someone", extra_body={"ignore_eos": True})
    answer = a.chat.completions.create(**common)
    assert answer.usage.completion_tokens == 6 and answer.choices[0].finish_reason == "length"
    chunks = list(a.chat.completions.create(**common, stream=True, stream_options={"include_usage": True,
                                                                                    "include_obfuscation": False}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 6  # greedy: the same text as the answer above
    with pytest.raises(openai.BadRequestError, match="only text parts") as refused:
        a.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    assert refused.value.body["param"] == "messages"


def test_cancelling_a_batch_stops_its_running_jobs(gateway):
    base, _, connection = gateway
    a = sdk(base, KEY_A)
    lines = [chat_line(i, LONG) for i in range(12)]
    file_id = a.files.create(file=("long.jsonl", "\n".join(lines).encode()), purpose="batch").id
    created = a.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(lambda: batch_jobs_running(connection, created.id, 12), 60, "the batch's jobs to run")
    cancelled = a.batches.cancel(created.id)
    assert cancelled.status in ("cancelling", "cancelled")
    ended = wait_for_batch(a, created.id, ("cancelled",))
    wait_for(lambda: not batch_jobs_running(connection, created.id, 12), 10, "no job of the batch running")
    counts = ended.request_counts
    assert counts.total == 12 and counts.completed + counts.failed == 12 and counts.failed > 0
    codes = {json.loads(x)["error"]["code"] for x in a.files.content(ended.error_file_id).text.splitlines()}
    assert codes <= {"batch_cancelled", "cancelled"}


def test_faults_come_back_as_the_sdks_typed_exceptions(gateway):
    base, _, _ = gateway
    a = sdk(base, KEY_A)
    with pytest.raises(openai.AuthenticationError):
        sdk(base, "sk-wrong").models.list()
    with pytest.raises(openai.NotFoundError):
        a.batches.retrieve("batch_0123456789abcdef")
    with pytest.raises(openai.NotFoundError) as unknown_model:
        a.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
    assert unknown_model.value.code == "model_not_found"
    with pytest.raises(openai.APIStatusError) as too_large:
        a.files.create(file=("big.jsonl", b"x" * (MAX_FILE_BYTES + 1)), purpose="batch")
    assert too_large.value.status_code == 413 and too_large.value.code == "file_too_large"
    with pytest.raises(openai.BadRequestError):
        a.batches.create(input_file_id="file-nope", endpoint="/v1/moderations", completion_window="24h")


def test_a_client_that_leaves_cancels_its_job_streaming_or_waiting(gateway):
    base, url, connection = gateway
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": LONG, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY_A}"},
                      timeout=60) as response:
        lines = response.iter_lines()
        job_id = json.loads(next(lines).removeprefix("data: "))["id"].removeprefix("chatcmpl-")
        next(line for line in lines if '"content": "' in line and '"content": ""' not in line)  # a token arrived
    client = Client(url, queue=QUEUE)
    wait_for(lambda: client.status(job_id).status in ("stopped", "canceled"), 20, "the abandoned job to stop")

    streams = set(connection.keys("batcher:stream:*"))

    def started() -> set[bytes]:
        return set(connection.keys("batcher:stream:*")) - streams

    # the client waiting for a whole answer leaves once its job has begun (its first tokens): a fixed wait would race
    # the job itself, whose LONG tokens take a quarter of a second on a fast CPU
    post_and_leave(base, {**body, "stream": False}, KEY_A, started)
    (waited,) = {k.decode().removeprefix("batcher:stream:") for k in started()}
    wait_for(lambda: client.status(waited).status in ("stopped", "canceled"), 20, "the abandoned job to stop")


def post_and_leave(base: str, body: dict, api_key: str, until) -> None:
    """POST `body` to the chat endpoint over a plain socket, and close the connection, unanswered, once `until()`
    holds."""
    url, payload = httpx.URL(base), json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.host}:{url.port}\r\nAuthorization: Bearer {api_key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n")
    with socket.create_connection((url.host, url.port)) as client_socket:
        client_socket.sendall(head.encode() + payload)
        wait_for(until, 20, "the job to begin", interval=0.001)


def test_a_stream_goes_on_seamlessly_when_its_worker_dies(gateway, workers, tiny_model_dir, tmp_path):
    """The job goes on on another worker from the tokens its stream holds: one answer, equal to the job's result,
    and no `restart` in its stream."""
    base, url, connection = gateway
    add_worker(workers, url, connection, tiny_model_dir("llama"), tmp_path / "second.log")
    client = Client(url, queue=QUEUE)
    stream = sdk(base, KEY_A).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=LONG, stream=True,
        extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)
    job_id = first.id.removeprefix("chatcmpl-")
    text = [c.choices[0].delta.content or "" for c in itertools.islice(chunks, 5)]  # tokens are flowing
    running_on = client.status(job_id).worker
    workers[running_on].send_signal(signal.SIGKILL)
    text += [c.choices[0].delta.content or "" for c in chunks if c.choices]
    result = client.result(job_id, timeout=60)
    assert result.worker != running_on and result.usage.completion_tokens == LONG
    assert "".join(text) == result.text
    assert "restart" not in [e.type for e in client.stream(job_id, timeout=10)]
