"""End to end: two `batcher serve` processes on one Redis and one queue are one service (issue 44). A background
response created on one is read and streamed from the other; a stream cut by SIGKILLing its gateway resumes on
another with `starting_after`; per-tenant limits count the requests of both.

One real `batcher worker` (a tiny random Llama with a long context) and two gateways with the same API keys serve
the module; the kill test and the limits test start gateways of their own. The official `openai` SDK is the client.
A long answer comes from a schema whose one string has a fixed length: the grammar allows no end before it. Each
process logs under pytest's tmp folder, and a failing test prints the logs' tails."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI
from redis import Redis

from rqbatcher.jobs.keys import stream_key
from rqbatcher.openai.responses.responses_body import RESPONSE_ID_PREFIX
from rqbatcher.schema import StreamEvent
from tests.e2e.test_urgency import sdk
from tests.e2e.test_workers import start_worker, stop, wait_ready
from tests.jobs_support import wait_for
from tests.reliability.support import free_port
from tests.tiny_models import CHAT_TEMPLATE, build_tool_model

pytestmark = pytest.mark.timeout(300)
QUEUE = "two-gw"
MODEL = "tiny-two-gw"
KEY_A, KEY_B = "sk-two-gw-tenant-a", "sk-two-gw-tenant-b"
GATEWAY_READY_S = 60
ANSWER_S = 90
LOG_TAIL_CHARS = 4000
SHORT_CHARS, LONG_CHARS = 60, 300  # answers of a few dozen steps, and of a few hundred (the one cut mid-stream)
DELTAS_BEFORE_KILL = 3  # text has flowed: the kill lands mid-answer
REQUESTS_PER_MINUTE = 3
OPENING = ["response.created", "response.queued", "response.in_progress", "response.output_item.added",
           "response.content_part.added"]  # a background response's first events
CLOSING = ["response.output_text.done", "response.content_part.done", "response.output_item.done",
           "response.completed"]


def long_text(chars: int) -> dict:
    """`text` for an answer of exactly `chars` characters in a JSON string: it runs for that many steps or so."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": chars, "maxLength": chars}},
              "required": ["s"], "additionalProperties": False}
    return {"format": {"type": "json_schema", "name": "long", "schema": schema, "strict": True}}


@dataclass
class Gateway:
    process: subprocess.Popen
    base: str
    log: Path

    def client(self, key: str) -> OpenAI:
        return sdk(self.base, key)

    def healthy(self) -> bool:
        assert self.process.poll() is None, f"gateway exited:\n{tail(self.log)}"
        try:
            return urllib.request.urlopen(f"{self.base}/health", timeout=5).status == 200
        except OSError:
            return False


def start_gateway(url: str, logs: Path, name: str, *options: str, keys: tuple[str, ...] = (KEY_A, KEY_B)) -> Gateway:
    """A gateway on `url`'s Redis and this module's queue, once it answers /health (which no limit counts)."""
    port = free_port()
    log = logs / f"gateway-{name}.log"
    process = subprocess.Popen([sys.executable, "-m", "rqbatcher", "serve", "--port", str(port), "--redis-url", url,
                                "--queue", QUEUE, *options], env={**os.environ, "BATCHER_API_KEYS": ",".join(keys)},
                               stdout=subprocess.DEVNULL, stderr=log.open("w"))
    gateway = Gateway(process, f"http://127.0.0.1:{port}", log)
    try:
        wait_for(gateway.healthy, GATEWAY_READY_S, f"gateway {name} to answer")
    except BaseException:
        stop(process)
        raise
    return gateway


@contextmanager
def logs_on_failure(logs: Path):
    """Print the tail of every log under `logs` when the block fails: pytest shows a failed test's output."""
    try:
        yield
    except BaseException:
        for log in sorted(logs.glob("*.log")):
            print(f"----- {log.name} -----\n{tail(log)}")
        raise


@dataclass
class Service:
    url: str
    connection: Redis
    worker: subprocess.Popen
    a: Gateway
    b: Gateway
    logs: Path

    def start_gateway(self, name: str, *options: str, keys: tuple[str, ...] = (KEY_A, KEY_B)) -> Gateway:
        return start_gateway(self.url, self.logs, name, *options, keys=keys)

    def logs_on_failure(self):
        return logs_on_failure(self.logs)


def tail(log: Path) -> str:
    return log.read_text(errors="replace")[-LOG_TAIL_CHARS:]


@pytest.fixture(scope="module")
def service(e2e_redis, tmp_path_factory) -> Service:
    """One worker and gateways A and B with the same keys, on one Redis and queue; both list the worker's model."""
    url, connection = e2e_redis
    logs = tmp_path_factory.mktemp("two-gateways")
    model_dir = build_tool_model(tmp_path_factory.mktemp("two-gateways-model"), template=CHAT_TEMPLATE)
    name, worker = start_worker(url, model_dir, QUEUE, logs / "worker.log", 4, "--served-model-name", MODEL)
    gateways: list[Gateway] = []
    try:
        with logs_on_failure(logs):
            wait_ready(connection, name, worker)
            gateways += [start_gateway(url, logs, "A"), start_gateway(url, logs, "B")]
            for gateway in gateways:
                wait_for(lambda g=gateway: MODEL in [m.id for m in g.client(KEY_A).models.list()], GATEWAY_READY_S,
                         "the gateway to list the worker's model")
        yield Service(url, connection, worker, *gateways, logs)
    finally:
        for gateway in gateways:
            stop(gateway.process)
        stop(worker)


def finished(client: OpenAI, response_id: str):
    return wait_for(lambda: (r := client.responses.retrieve(response_id)).status not in ("queued", "in_progress")
                    and r, ANSWER_S, f"response {response_id} to end", interval=0.2)


def text_of(events) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def test_a_background_response_created_on_one_gateway_is_read_and_streamed_from_the_other(service):
    with service.logs_on_failure():
        on_a, on_b = service.a.client(KEY_A), service.b.client(KEY_A)
        queued = on_a.responses.create(model=MODEL, input="hi", background=True, text=long_text(SHORT_CHARS),
                                       max_output_tokens=4 * SHORT_CHARS)
        assert queued.status == "queued"
        done = finished(on_b, queued.id)
        assert done.status == "completed" and len(json.loads(done.output_text)["s"]) == SHORT_CHARS
        assert done.model_dump() == on_a.responses.retrieve(queued.id).model_dump()
        assert on_b.responses.input_items.list(queued.id).model_dump() == on_a.responses.input_items.list(
            queued.id).model_dump()

        events = list(on_b.responses.retrieve(queued.id, stream=True))
        kinds = [e.type for e in events]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert kinds[:5] == OPENING and kinds[-4:] == CLOSING
        assert set(kinds[5:-4]) == {"response.output_text.delta"}
        assert text_of(events) == events[-1].response.output_text == done.output_text
        replayed_on_a = list(on_a.responses.retrieve(queued.id, stream=True))
        assert [e.model_dump() for e in replayed_on_a] == [e.model_dump() for e in events]
        with pytest.raises(openai.NotFoundError):  # the other tenant, on either gateway
            service.b.client(KEY_B).responses.retrieve(queued.id)


def test_a_stream_cut_by_killing_its_gateway_resumes_on_the_other_without_gap_or_repeat(service):
    with service.logs_on_failure():
        doomed = service.start_gateway("doomed")
        try:
            seen, cut = read_until_killed(service, doomed)
        finally:
            stop(doomed.process)
        assert cut is not None, "the stream ended before its gateway was killed"
        assert seen[-1].type != "response.completed"
        response_id = seen[0].response.id

        on_b = service.b.client(KEY_A)
        rest = list(on_b.responses.retrieve(response_id, stream=True, starting_after=seen[-1].sequence_number))
        numbers = [e.sequence_number for e in seen + rest]
        assert numbers == list(range(len(numbers)))  # no gap, no repeat
        assert rest[-1].type == "response.completed"
        stored = on_b.responses.retrieve(response_id)
        assert stored.status == "completed" and text_of(seen + rest) == stored.output_text
        assert len(json.loads(stored.output_text)["s"]) == LONG_CHARS
        replayed = list(on_b.responses.retrieve(response_id, stream=True))
        assert [e.model_dump() for e in seen + rest] == [e.model_dump() for e in replayed]


def read_until_killed(service: Service, doomed: Gateway):
    """A background response's stream read from `doomed`, which is SIGKILLed once text has flowed: (the events
    read, the error that cut the stream). The worker is paused (SIGSTOP, well within its lease) around the kill, so
    the job is known not to have ended when its gateway died; the events already in the socket are read to the end."""
    stream = doomed.client(KEY_A).responses.create(model=MODEL, input="hi", stream=True, background=True,
                                                   text=long_text(LONG_CHARS), max_output_tokens=2 * LONG_CHARS)
    seen, cut = [], None
    try:
        for event in stream:
            seen.append(event)
            if sum(e.type == "response.output_text.delta" for e in seen) == DELTAS_BEFORE_KILL and \
                    doomed.process.poll() is None:
                job_id = seen[0].response.id.removeprefix(RESPONSE_ID_PREFIX)
                service.worker.send_signal(signal.SIGSTOP)
                try:
                    stop(doomed.process)
                    kinds = [StreamEvent.from_fields(f).type for _, f in service.connection.xrange(stream_key(job_id))]
                finally:
                    service.worker.send_signal(signal.SIGCONT)
                assert "done" not in kinds, "the job ended before its gateway was killed"
    except (httpx.HTTPError, openai.APIError) as exc:
        cut = exc
    return seen, cut


def test_a_tenants_requests_per_minute_are_counted_across_both_gateways(service):
    """Two gateways of their own with the limit (A and B serve the other tests without one). A bucket of 3 a minute
    refills one request every 20 s: the requests below take a second or two."""
    limited_keys = ("sk-two-gw-limited-a", "sk-two-gw-limited-b")  # fresh tenants: no request counted before
    with service.logs_on_failure():
        limited = [service.start_gateway(f"limited-{i}", "--requests-per-minute", str(REQUESTS_PER_MINUTE),
                                         keys=limited_keys) for i in range(2)]
        try:
            first, second = ([g.client(key) for g in limited] for key in limited_keys)
            for i in range(REQUESTS_PER_MINUTE):  # A, B, A: each sees what the others spent
                raw = first[i % 2].responses.with_raw_response.create(model=MODEL, input="hi", max_output_tokens=2)
                assert raw.parse().status in ("completed", "incomplete")
                assert int(raw.headers["x-ratelimit-remaining-requests"]) == REQUESTS_PER_MINUTE - 1 - i
            jobs_before = job_keys(service.connection)
            for client in first:  # the 4th, on either gateway
                with pytest.raises(openai.RateLimitError) as refused:
                    client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
                headers = refused.value.response.headers
                assert float(headers["retry-after"]) > 0
                assert headers["x-ratelimit-limit-requests"] == str(REQUESTS_PER_MINUTE)
                assert headers["x-ratelimit-remaining-requests"] == "0"
            assert job_keys(service.connection) <= jobs_before  # nothing was enqueued
            for client in second:  # another tenant is not affected
                assert client.responses.create(model=MODEL, input="hi", max_output_tokens=2).status in (
                    "completed", "incomplete")
        finally:
            for gateway in limited:
                stop(gateway.process)


def job_keys(connection: Redis) -> set[bytes]:
    """The RQ jobs in the database (one of another module may expire meanwhile: compare with <=)."""
    return set(connection.scan_iter(match="rq:job:*", count=1000))
