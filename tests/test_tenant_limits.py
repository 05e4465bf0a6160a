"""Per-tenant limits in the gateway (batcher/gateway/tenant_limits.py, tenant_admission.py), in-process on fakeredis:
the keys file's options, 429s in OpenAI's shape with nothing enqueued, the headers of answers, token reservations
settled to the usage, concurrency slots freed at the answer's end or by their lease, batch lines, the metrics and
`batcher tenants`."""

from __future__ import annotations

import json
import threading

import pytest
from click.testing import CliRunner
from fakeredis import aioredis
from starlette.testclient import TestClient

import rqbatcher.client
from rqbatcher.cli import main
from rqbatcher.client import Client
from rqbatcher.errors import BatcherError
from rqbatcher.gateway import tenant_admission
from rqbatcher.gateway.app import GatewayConfig, create_app
from rqbatcher.gateway.auth import ApiKeys, tenant_of
from rqbatcher.gateway.tenant_admission import SLOT_LEASE_S, reset_text
from rqbatcher.gateway.tenant_limits import OPEN_TENANT, Limits, parse_limit_options, reserved_tokens
from rqbatcher.jobs import keys
from rqbatcher.jobs.worker_stats import WorkerStats
from rqbatcher.schema import ChatMessage, GenerationRequest, SamplingParams
from tests.jobs_support import fake_redis_fixture, keep_signal_handlers_fixture, wait_for  # noqa: F401
from tests.test_gateway import worker_fixture  # noqa: F401  (a worker thread serving MODEL with a fake engine)

A, B = {"Authorization": "Bearer key-of-a"}, {"Authorization": "Bearer key-of-b"}
TENANT_A = tenant_of("key-of-a")
MODEL = "fake-model"
NOW = 1_000_000.0


@pytest.fixture
def clock(monkeypatch):
    """The gateway's clock, stopped at NOW: buckets refill only when a test moves it (`clock[0] += seconds`)."""
    now = [NOW]
    monkeypatch.setattr(tenant_admission, "clock", lambda: now[0])
    return now


@pytest.fixture
def make_gateway(fake_redis, clock):
    """A function of (default limits, {key: its own limits}) that opens a gateway with keys `key-of-a` and
    `key-of-b` on the test's fakeredis; every gateway it opened is closed at the end."""
    opened = []

    def make(defaults: Limits = Limits(), overrides: dict[str, Limits] | None = None,
             open_gateway: bool = False) -> TestClient:
        aconnection = aioredis.FakeRedis(server=fake_redis.connection_pool.connection_kwargs["server"])
        api_keys = ApiKeys() if open_gateway else ApiKeys(["key-of-a", "key-of-b"], overrides)
        config = GatewayConfig(api_keys=api_keys, default_limits=defaults)
        http = TestClient(create_app(config, fake_redis, aconnection))
        opened.append(http.__enter__())
        return http

    yield make
    for http in opened:
        http.__exit__(None, None, None)


def pretend_worker(connection) -> None:
    """A live worker serving MODEL that takes no job: requests queue up behind it."""
    stats = WorkerStats(name="idle", host="h", pid=1, queues=keys.DEFAULT_QUEUE, model=MODEL, state="idle",
                        in_flight=0, free_slots=1, kv_usage=0.0, tokens_per_s=0.0, last_heartbeat=0.0)
    connection.hset(keys.worker_stats_key("idle"), mapping=stats.to_dict())
    connection.sadd(keys.WORKERS_SET, "idle")


def completion(http, headers=A, prompt: str = "hello", max_tokens: int = 3, **body):
    return http.post("/v1/completions", headers=headers,
                     json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **body})


def refused(response, kind: str) -> dict:
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == (kind, "rate_limit_exceeded") and error["message"]
    return error


def queued_jobs(connection) -> int:
    return sum(1 for _ in connection.scan_iter(match="rq:job:*"))


# ----- configuration -----
def test_the_keys_file_gives_a_key_its_own_limits_and_a_bad_option_names_its_line_not_the_key(tmp_path):
    keyfile = tmp_path / "keys"
    keyfile.write_text("# team\nsk-abc  requests-per-minute=60 max-queued-batch-lines=1000  # ops\n\nsk-def\n")
    api_keys = ApiKeys.load("sk-env", keyfile)
    assert api_keys.tenants == [tenant_of(k) for k in ("sk-env", "sk-abc", "sk-def")]
    assert api_keys.limit_overrides[tenant_of("sk-abc")] == Limits(requests_per_minute=60,
                                                                   max_queued_batch_lines=1000)
    assert api_keys.limit_overrides[tenant_of("sk-def")] == Limits()
    for bad in ("sk-secret-key requests-per-minute=0", "sk-secret-key requests-per-minute", "sk-secret-key rpm=5",
                "sk-secret-key tokens_per_minute=5", "sk-secret-key max-concurrent-requests=four",
                "requests-per-minute=5 sk-secret-key", "sk-fine sk-secret-key"):  # a key misplaced after another
        keyfile.write_text(f"sk-fine\n{bad}\n")
        with pytest.raises(BatcherError) as error:
            ApiKeys.load(None, keyfile)
        assert "line 2" in str(error.value) and "sk-secret-key" not in str(error.value)
    assert parse_limit_options(["tokens-per-minute=20000", "max-concurrent-requests=4"]) == Limits(
        tokens_per_minute=20000, max_concurrent_requests=4)


def test_serve_reads_every_tenants_default_limits_from_flags_and_the_environment():
    shown = CliRunner().invoke(main, ["serve", "--help"], terminal_width=10_000).output
    for name in ("requests-per-minute", "tokens-per-minute", "max-concurrent-requests", "max-queued-batch-lines"):
        assert f"--{name}" in shown and f"BATCHER_{name.upper().replace('-', '_')}" in shown


def test_a_request_reserves_its_prompts_estimate_plus_what_it_may_generate():
    sampling = SamplingParams(max_tokens=10)
    assert reserved_tokens(GenerationRequest(prompt="x" * 9, sampling=sampling)) == 3 + 10  # characters / 4, up
    assert reserved_tokens(GenerationRequest(prompt_token_ids=[1] * 7, sampling=sampling)) == 7 + 10
    assert reserved_tokens(GenerationRequest(messages=[ChatMessage(role="user", content="abcd"),
                                                       ChatMessage(role="assistant", content="e")],
                                             sampling=SamplingParams(max_tokens=10, n=2))) == 2 + 20
    assert reserved_tokens(GenerationRequest(embed=["abcdefgh", [1, 2, 3]])) == 2 + 3
    assert [reset_text(s) for s in (0, 0.12, 1, 8.64, 360, 61.5)] == ["0s", "120ms", "1s", "8.64s", "6m0s", "1m1.5s"]


# ----- requests per minute -----
def test_past_its_requests_per_minute_a_tenant_gets_429_with_openais_headers_and_nothing_is_enqueued(
        make_gateway, worker, fake_redis, clock):
    http = make_gateway(Limits(requests_per_minute=2))
    answers = [completion(http) for _ in range(2)]
    assert [a.status_code for a in answers] == [200, 200]
    assert [a.headers["x-ratelimit-remaining-requests"] for a in answers] == ["1", "0"]
    assert answers[0].headers["x-ratelimit-limit-requests"] == "2"
    assert "x-ratelimit-limit-tokens" not in answers[0].headers  # only the limits that are set
    jobs = queued_jobs(fake_redis)
    over = completion(http)
    assert "requests per minute" in refused(over, "requests")["message"]
    assert over.headers["retry-after"] == "30" and over.headers["x-ratelimit-reset-requests"] == "1m0s"
    assert over.headers["x-ratelimit-remaining-requests"] == "0"
    assert queued_jobs(fake_redis) == jobs  # nothing was enqueued
    assert completion(http, headers=B).status_code == 200  # the other tenant has its own bucket
    clock[0] += 30  # half a minute refills one request
    assert completion(http).status_code == 200
    refused(completion(http), "requests")
    for route in ("/v1/chat/completions", "/v1/embeddings", "/v1/responses"):
        body = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]}, "/v1/embeddings":
                {"input": "hi"}, "/v1/responses": {"input": "hi"}}[route]
        refused(http.post(route, headers=A, json={"model": MODEL, **body}), "requests")
    metrics = http.get("/metrics").text
    assert f'batcher_gateway_rate_limited_total{{limit="requests",tenant="{TENANT_A}"}} 5.0' in metrics
    assert f'batcher_gateway_tenant_limit{{limit="requests_per_minute",tenant="{TENANT_A}"}} 2.0' in metrics


def test_a_keys_own_limits_override_the_defaults_and_a_gateway_without_limits_sends_no_headers(
        make_gateway, worker):
    http = make_gateway(Limits(requests_per_minute=1), {"key-of-b": Limits(requests_per_minute=3)})
    assert [completion(http, headers=B).status_code for _ in range(4)] == [200, 200, 200, 429]
    assert [completion(http).status_code for _ in range(2)] == [200, 429]
    free = make_gateway()
    answer = completion(free, headers=B)
    assert answer.status_code == 200 and not [h for h in answer.headers if h.startswith("x-ratelimit")]


def test_an_open_gateways_one_tenant_gets_the_default_limits(make_gateway, worker, fake_redis):
    http = make_gateway(Limits(requests_per_minute=1), open_gateway=True)
    assert completion(http, headers={}).status_code == 200
    refused(completion(http, headers={}), "requests")
    assert json.loads(fake_redis.hget(keys.TENANT_LIMITS, OPEN_TENANT))["requests_per_minute"] == 1


# ----- tokens per minute -----
def test_tokens_are_reserved_up_front_and_settled_to_the_jobs_usage(make_gateway, worker, fake_redis):
    http = make_gateway(Limits(tokens_per_minute=100))
    first = completion(http, prompt="x" * 8, max_tokens=30)  # reserves 2 + 30; the job uses 8 + 30
    assert first.status_code == 200 and first.headers["x-ratelimit-remaining-tokens"] == "68"
    wait_for(lambda: float(fake_redis.hget(keys.tenant_buckets_key(TENANT_A), "t")) == 62, 5, "the settlement")
    streamed = completion(http, prompt="x" * 4, max_tokens=10, stream=True)  # reserves 1 + 10, uses 4 + 10
    assert streamed.status_code == 200 and streamed.headers["x-ratelimit-remaining-tokens"] == "51"
    wait_for(lambda: float(fake_redis.hget(keys.tenant_buckets_key(TENANT_A), "t")) == 48, 5, "the settlement")
    over = completion(http, prompt="x", max_tokens=60)
    assert "tokens per minute" in refused(over, "tokens")["message"]
    assert int(over.headers["retry-after"]) == 8 and over.headers["x-ratelimit-remaining-tokens"] == "48"
    too_large = completion(http, prompt="x", max_tokens=200)  # more than a whole minute's tokens: never passes
    assert "too large" in refused(too_large, "tokens")["message"]
    assert too_large.headers["x-should-retry"] == "false" and "retry-after" not in too_large.headers


# ----- concurrent requests -----
def held(http, headers=A) -> threading.Thread:
    """A completion, in a thread, that waits for a job no worker takes: it holds its slot until the job ends."""
    thread = threading.Thread(target=completion, args=(http, headers), daemon=True)
    thread.start()
    return thread


def test_a_request_holds_its_slot_renewed_until_its_answer_ends(make_gateway, fake_redis, clock):
    pretend_worker(fake_redis)  # the jobs stay queued: the requests wait
    http = make_gateway(Limits(max_concurrent_requests=1))
    slots = keys.tenant_slots_key(TENANT_A)
    waiting = [held(http), held(http, B)]  # another tenant's slots are its own
    wait_for(lambda: fake_redis.zcard(slots) == fake_redis.zcard(keys.tenant_slots_key(tenant_of("key-of-b"))) == 1,
             5, "each tenant's request to hold a slot")
    over = completion(http)
    assert "concurrent" in refused(over, "requests")["message"] and over.headers["retry-after"] == "1"
    clock[0] += SLOT_LEASE_S - 1
    http.portal.call(http.app.state.admission.renew)  # what the gateway does every SLOT_RENEW_S
    assert fake_redis.zrange(slots, 0, -1, withscores=True)[0][1] == clock[0] + SLOT_LEASE_S
    clock[0] += 2  # past the first lease: the renewed one holds
    refused(completion(http), "requests")
    for key in fake_redis.scan_iter(match="rq:job:*"):  # the jobs end (cancelled): so do their requests
        Client(fake_redis).cancel(key.decode().removeprefix("rq:job:"))
    for thread in waiting:
        thread.join(10)
    assert fake_redis.zcard(slots) == 0


def test_a_dead_gateways_slots_are_freed_once_their_lease_ends(make_gateway, worker, fake_redis, clock):
    http = make_gateway(Limits(max_concurrent_requests=1))
    slots = keys.tenant_slots_key(TENANT_A)
    fake_redis.zadd(slots, {"of-a-killed-gateway": NOW + SLOT_LEASE_S})
    refused(completion(http), "requests")
    clock[0] += SLOT_LEASE_S + 1
    assert completion(http).status_code == 200
    assert fake_redis.zcard(slots) == 0


# ----- batch lines -----
def batch_file(http, lines: int, headers=A, model: str = MODEL) -> str:
    text = "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                               "body": {"model": model, "prompt": "hi"}}) + "\n" for i in range(lines))
    uploaded = http.post("/v1/files", headers=headers, files={"file": ("in.jsonl", text.encode())},
                         data={"purpose": "batch"})
    assert uploaded.status_code == 200, uploaded.text
    return uploaded.json()["id"]


def create_batch(http, file_id: str, headers=A):
    return http.post("/v1/batches", headers=headers, json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                                           "completion_window": "24h"})


def test_a_batch_that_would_pass_the_queued_batch_lines_is_refused_whole(make_gateway, fake_redis):
    http = make_gateway(Limits(max_queued_batch_lines=5, requests_per_minute=1))
    assert create_batch(http, batch_file(http, 3)).status_code == 200  # batch lines count on their own limit
    jobs = queued_jobs(fake_redis)
    over = create_batch(http, batch_file(http, 3))
    assert "max-queued-batch-lines" in refused(over, "requests")["message"] and over.headers["retry-after"] == "60"
    assert queued_jobs(fake_redis) == jobs
    assert create_batch(http, batch_file(http, 2)).status_code == 200  # exactly the limit
    assert create_batch(http, batch_file(http, 5, B), B).status_code == 200  # the other tenant's lines are its own
    alone = create_batch(http, batch_file(http, 6, B), B)
    assert refused(alone, "requests") and alone.headers["x-should-retry"] == "false"
    assert completion(http).status_code != 429  # nor do batches count against requests per minute
    assert fake_redis.zcard(keys.tenant_batch_reservations_key(TENANT_A)) == 0  # reservations end with creation


# ----- what an operator sees -----
def test_batcher_tenants_shows_each_tenants_limits_and_usage(make_gateway, worker, fake_redis, monkeypatch, clock):
    monkeypatch.setattr(rqbatcher.client, "connect", lambda url=None: fake_redis)
    http = make_gateway(Limits(requests_per_minute=10, tokens_per_minute=1000, max_queued_batch_lines=50))
    assert completion(http, prompt="x" * 4, max_tokens=3).status_code == 200
    create_batch(http, batch_file(http, 4, model="unserved"))  # its lines stay queued
    monkeypatch.setattr("time.time", lambda: clock[0])  # the bucket is read at the gateway's time
    result = CliRunner().invoke(main, ["tenants", "--json"])
    assert result.exit_code == 0, result.output
    shown = {row["tenant"]: row for row in json.loads(result.output)}
    assert set(shown) == {TENANT_A, tenant_of("key-of-b")}
    a = shown[TENANT_A]
    assert a["limits"] == {"requests_per_minute": 10, "tokens_per_minute": 1000, "max_concurrent_requests": None,
                           "max_queued_batch_lines": 50}
    assert (a["requests"], a["tokens"], a["concurrent"], a["queued_batch_lines"]) == (1, 4 + 3, 0, 4)
    table = CliRunner().invoke(main, ["tenants"]).output
    assert "REQUESTS/MIN" in table and "1/10" in table and "4/50" in table
