"""Per-tenant limits on the real Redis: two gateway apps (two uvicorn servers in this process, as two `batcher serve`
would be) count one tenant's requests together, and the official `openai` SDK raises RateLimitError on the 429 and,
when allowed to retry, waits the Retry-After it was given; a stream holds its concurrency slot until its client
leaves. The worker is in-process, on the fake engine."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest
import uvicorn
from openai import OpenAI
from redis import Redis

from rqbatcher.gateway.app import GatewayConfig, create_app
from rqbatcher.gateway.auth import ApiKeys, tenant_of
from rqbatcher.gateway.tenant_limits import Limits
from rqbatcher.jobs import keys
from rqbatcher.jobs.connection import connect_async
from rqbatcher.jobs.worker_stats import WorkerStats
from rqbatcher.workers.job_worker.worker import JobWorker
from tests.fake_engine import FakeEngine
from tests.jobs_support import keep_signal_handlers_fixture, wait_for  # noqa: F401
from tests.reliability.support import free_port

pytestmark = [pytest.mark.usefixtures("keep_signal_handlers"), pytest.mark.timeout(120)]
QUEUE = "limits"
MODEL = "fake-model"
KEY_A, KEY_B = "sk-limited-a", "sk-limited-b"
SERVER_READY_S = 20


@contextmanager
def gateway(url: str, limits: Limits) -> Iterator[str]:
    """A gateway app with keys KEY_A and KEY_B under uvicorn in a thread, on the real Redis: its base URL."""
    config = GatewayConfig(queue=QUEUE, api_keys=ApiKeys([KEY_A, KEY_B]), default_limits=limits)
    app = create_app(config, Redis.from_url(url), connect_async(url))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, SERVER_READY_S, "the gateway to listen")
        yield f"http://127.0.0.1:{server.config.port}/v1"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture
def worker(redis_url):
    running = JobWorker(keys.priority_queue_names([QUEUE], model=MODEL), FakeEngine(), connection=Redis.from_url(
        redis_url), model_name=MODEL, lease_s=2)
    thread = threading.Thread(target=running.work, daemon=True)
    thread.start()
    wait_for(lambda: running.connection.exists(keys.worker_stats_key(running.name)), 10, "the worker's stats")
    yield running
    running.request_stop(None, None)
    thread.join(10)


def ask(base: str, key: str = KEY_A, max_retries: int = 0):
    client = OpenAI(base_url=base, api_key=key, max_retries=max_retries)
    return client.completions.create(model=MODEL, prompt="hi", max_tokens=2)


def test_two_gateways_share_a_tenants_limits_and_the_sdk_raises_then_honours_retry_after(redis_url, worker):
    per_minute = 12  # one request every 5 s once the bucket is empty
    with gateway(redis_url, Limits(requests_per_minute=per_minute)) as first, \
            gateway(redis_url, Limits(requests_per_minute=per_minute)) as second:
        for i in range(per_minute):  # the bucket, emptied through both gateways in turn
            ask((first, second)[i % 2])
        jobs = Redis.from_url(redis_url).dbsize()
        for base in (first, second):
            with pytest.raises(openai.RateLimitError) as refused:
                ask(base)
            headers = refused.value.response.headers
            assert headers["retry-after"] in ("4", "5") and headers["x-ratelimit-limit-requests"] == str(per_minute)
            assert refused.value.body["type"] == "requests" and refused.value.code == "rate_limit_exceeded"
        assert Redis.from_url(redis_url).dbsize() == jobs  # no job (and no key) was added for a refused request
        ask(second, KEY_B)  # another tenant's bucket is full
        started = time.monotonic()
        answer = ask(first, max_retries=1)  # refused, then retried after the Retry-After (its own backoff: < 1 s)
        assert answer.choices[0].text and time.monotonic() - started >= 3
    tenant = tenant_of(KEY_A)
    assert Redis.from_url(redis_url).zcard(keys.tenant_slots_key(tenant)) == 0


def pretend_worker(connection: Redis) -> None:
    """A live worker serving MODEL on QUEUE that takes no job: a stream stays open until its client leaves."""
    stats = WorkerStats(name="idle", host="h", pid=1, queues=QUEUE, model=MODEL, state="idle", in_flight=0,
                        free_slots=1, kv_usage=0.0, tokens_per_s=0.0, last_heartbeat=0.0)
    connection.hset(keys.worker_stats_key("idle"), mapping=stats.to_dict())
    connection.sadd(keys.WORKERS_SET, "idle")


def test_a_stream_holds_its_concurrency_slot_until_its_client_leaves(redis_url):
    connection = Redis.from_url(redis_url)
    pretend_worker(connection)
    slots = keys.tenant_slots_key(tenant_of(KEY_A))
    body = {"model": MODEL, "prompt": "hi", "stream": True}
    with gateway(redis_url, Limits(max_concurrent_requests=1)) as base, httpx.Client(timeout=10) as http:
        auth = {"Authorization": f"Bearer {KEY_A}"}
        with http.stream("POST", f"{base}/completions", headers=auth, json=body) as streaming:
            assert streaming.status_code == 200 and connection.zcard(slots) == 1
            with pytest.raises(openai.RateLimitError):
                ask(base)
        wait_for(lambda: connection.zcard(slots) == 0, 10, "the slot of the stream whose client left")
        with http.stream("POST", f"{base}/completions", headers=auth, json=body) as streaming:
            assert streaming.status_code == 200
