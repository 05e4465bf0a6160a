"""The gateway in-process (Starlette's TestClient) on fakeredis: keys and tenants, limits, error objects,
files, batches, and completions answered and streamed by a worker thread with a fake engine."""

from __future__ import annotations

import hmac
import json
import re
import threading

import pytest
from click.testing import CliRunner
from fakeredis import aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from starlette.testclient import TestClient

from rqbatcher.batches import file_store as core_files
from rqbatcher.batches.file_store import FileLimits
from rqbatcher.cli import main
from rqbatcher.client import Client
from rqbatcher.gateway import job_service
from rqbatcher.gateway import job_streams as gateway_jobs
from rqbatcher.gateway.app import ROUTES, GatewayConfig, create_app
from rqbatcher.gateway.auth import ApiKeys, UnsafeBind, check_bind, tenant_of
from rqbatcher.gateway.body import MAX_JSON_DEPTH, nesting_depth
from rqbatcher.gateway.job_streams import AttemptDiverged, TextRelay
from rqbatcher.jobs import keys
from rqbatcher.jobs.durability import NotReplicated
from rqbatcher.jobs.worker_stats import WorkerStats
from rqbatcher.openai.generation_answer import response_body
from rqbatcher.schema import GenerationRequest, GenerationResult, StreamEvent, Usage
from rqbatcher.workers.job_worker.worker import JobWorker
from tests.fake_engine import FakeEngine, expected_text
from tests.jobs_support import fake_redis_fixture, keep_signal_handlers_fixture, wait_for  # noqa: F401

A, B = {"Authorization": "Bearer key-of-a"}, {"Authorization": "Bearer key-of-b"}
MODEL = "fake-model"
LIMITS = FileLimits(max_bytes=4096, max_lines=20)
MAX_REQUEST_BYTES = 2048
MAX_QUEUE = 6


def line(i: int, url: str = "/v1/chat/completions", **body) -> str:
    body = {"model": MODEL, "max_tokens": 3, **body}
    if url.endswith("chat/completions"):
        body.setdefault("messages", [{"role": "user", "content": f"hello {i}"}])
    else:
        body.setdefault("prompt", f"hello {i}")
    return json.dumps({"custom_id": f"c{i}", "method": "POST", "url": url, "body": body})


@pytest.fixture
def gateway(fake_redis):
    aconnection = aioredis.FakeRedis(server=fake_redis.connection_pool.connection_kwargs["server"])
    config = GatewayConfig(api_keys=ApiKeys(["key-of-a", "key-of-b"]), file_limits=LIMITS,
                           max_request_bytes=MAX_REQUEST_BYTES, max_queue_length=MAX_QUEUE)
    with TestClient(create_app(config, fake_redis, aconnection)) as http:
        yield http


@pytest.fixture(name="worker")
def worker_fixture(fake_redis, keep_signal_handlers):
    """A worker serving MODEL on the default queue, with a fake engine, in a thread."""
    yield from worker_serving(fake_redis, FakeEngine())


def worker_serving(fake_redis, engine):
    """A worker serving MODEL on the default queue with `engine`, in a thread, while the generator is suspended."""
    running = JobWorker(keys.priority_queue_names([keys.DEFAULT_QUEUE], model=MODEL), engine,
                        connection=fake_redis, model_name=MODEL, lease_s=1)
    thread = threading.Thread(target=running.work, daemon=True)
    thread.start()
    wait_for(lambda: fake_redis.exists(keys.worker_stats_key(running.name)), 10, "the worker's stats")
    yield running
    running.request_stop(None, None)
    thread.join(10)


def pretend_worker(connection, model: str = MODEL) -> None:
    """Stats of a live worker serving `model` that takes no job: requests queue up behind it."""
    stats = WorkerStats(name="idle", host="h", pid=1, queues=keys.DEFAULT_QUEUE, model=model, state="idle",
                        in_flight=0, free_slots=1, kv_usage=0.0, tokens_per_s=0.0, last_heartbeat=0.0)
    connection.hset(keys.worker_stats_key("idle"), mapping=stats.to_dict())
    connection.sadd(keys.WORKERS_SET, "idle")


def upload(http, text: str | bytes, headers=A, purpose: str = "batch"):
    data = text.encode() if isinstance(text, str) else text
    return http.post("/v1/files", headers=headers, files={"file": ("in.jsonl", data)}, data={"purpose": purpose})


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def sse(response) -> list:
    """The data of each server-sent event ([DONE] as the string)."""
    events = [part[len("data: "):] for part in response.text.split("\n\n") if part]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


# ----- keys -----
def test_each_key_is_a_tenant_and_every_key_is_compared(tmp_path, monkeypatch):
    keyfile = tmp_path / "keys"
    keyfile.write_text("# team keys\nkey-three  # ops\n\n")
    api_keys = ApiKeys.load("key-one, key-two,", keyfile)
    assert len(api_keys) == 3 and api_keys.tenants == [tenant_of(k) for k in ("key-one", "key-two", "key-three")]
    assert tenant_of("key-two").startswith("key-") and "key-two" not in tenant_of("key-two")
    compared = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: compared.append(1) or real(a, b))
    assert api_keys.tenant("key-one") == tenant_of("key-one") and len(compared) == 3  # no early exit on a match
    assert api_keys.tenant("key-on") is None and api_keys.tenant("") is None


def test_an_open_gateway_listens_only_on_loopback():
    for host in ("127.0.0.1", "::1"):
        check_bind(host, ApiKeys())
    for host in ("0.0.0.0", "10.1.2.3", "localhost", "::"):
        with pytest.raises(UnsafeBind):
            check_bind(host, ApiKeys())
    check_bind("0.0.0.0", ApiKeys(["k"]))
    result = CliRunner(env={"BATCHER_API_KEYS": ""}).invoke(main, ["serve", "--host", "0.0.0.0"])
    assert result.exit_code == 1 and result.output.count("\n") == 1 and "only listens on 127.0.0.1" in result.output


def test_without_a_valid_key_v1_answers_401_and_probes_stay_open(gateway):
    assert error_of(gateway.get("/v1/models"), 401)["code"] == "missing_api_key"
    assert (error_of(gateway.get("/v1/batches", headers={"Authorization": "Bearer nope"}), 401)["code"]
            == "invalid_api_key")
    assert error_of(gateway.get("/v1/models", headers={"Authorization": "Basic a2V5"}), 401)
    assert gateway.get("/health").json() == {"status": "ok"}
    assert 'route="/v1/batches",status="401"' in gateway.get("/metrics").text


# ----- files -----
def test_a_file_round_trips_and_belongs_to_its_tenant(gateway, fake_redis):
    text = "\n".join(line(i) for i in range(3)) + "\n"
    created = upload(gateway, text)
    assert created.status_code == 200, created.text
    file = created.json()
    assert set(file) == {"id", "object", "bytes", "created_at", "expires_at", "filename", "purpose", "status"}
    assert ((file["object"], file["bytes"], file["filename"], file["purpose"])
            == ("file", len(text), "in.jsonl", "batch"))
    assert file["expires_at"] - file["created_at"] == core_files.DEFAULT_FILE_RETENTION_S
    assert gateway.get(f"/v1/files/{file['id']}", headers=A).json() == file
    assert gateway.get(f"/v1/files/{file['id']}/content", headers=A).text == text
    for method, path in (("GET", ""), ("GET", "/content"), ("DELETE", "")):
        assert error_of(gateway.request(method, f"/v1/files/{file['id']}{path}", headers=B), 404)["param"] == "file_id"
    assert error_of(gateway.post("/v1/batches", headers=B, json={"input_file_id": file["id"],
                                                                 "endpoint": "/v1/chat/completions"}), 404)
    assert gateway.delete(f"/v1/files/{file['id']}", headers=A).json() == {"id": file["id"], "object": "file",
                                                                          "deleted": True}
    assert error_of(gateway.get(f"/v1/files/{file['id']}", headers=A), 404)
    assert not fake_redis.keys("batcher:file:*")


def test_an_upload_is_stored_in_chunks_and_can_set_its_expiry(gateway, fake_redis, monkeypatch):
    monkeypatch.setattr(core_files, "CHUNK_BYTES", 1000)
    text = "\n".join(line(i) for i in range(15))  # no final line break: the last line still counts
    created = gateway.post("/v1/files", headers=A, files={"file": ("x.jsonl", text.encode())},
                           data={"purpose": "batch", "expires_after[anchor]": "created_at",
                                 "expires_after[seconds]": "3600"}).json()
    assert created["expires_at"] - created["created_at"] == 3600
    assert fake_redis.llen(keys.file_chunks_key(created["id"])) >= 2
    assert 3500 < fake_redis.ttl(keys.file_key(created["id"])) <= 3600
    assert gateway.get(f"/v1/files/{created['id']}/content", headers=A).text == text


def test_uploads_past_a_limit_answer_413_and_leave_nothing(gateway, fake_redis):
    big = upload(gateway, "x" * (LIMITS.max_bytes + 1))
    assert error_of(big, 413)["code"] == "file_too_large"
    many = upload(gateway, "{}\n" * (LIMITS.max_lines + 1))
    assert error_of(many, 413)["code"] == "too_many_lines"
    assert not fake_redis.keys("batcher:file:*")
    body = {"model": MODEL, "prompt": "x" * MAX_REQUEST_BYTES}
    assert error_of(gateway.post("/v1/completions", headers=A, json=body), 413)["code"] == "request_too_large"


@pytest.mark.parametrize("fields,param", [
    ({"purpose": "fine-tune"}, "purpose"),
    ({"purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": "60"}, "expires_after"),
])
def test_bad_uploads_answer_400(gateway, fields, param):
    response = gateway.post("/v1/files", headers=A, files={"file": ("x", b"{}\n")}, data=fields)
    assert error_of(response, 400)["param"] == param
    assert error_of(gateway.post("/v1/files", headers=A, json={"purpose": "batch"}), 400)


# ----- batches -----
def test_batches_from_a_file_list_by_tenant_and_cancel(gateway):
    text = "\n".join([line(0), "not json", line(2, url="/v1/completions"), line(3)])
    file_id = upload(gateway, text).json()["id"]
    created = []
    for _ in range(3):
        response = gateway.post("/v1/batches", headers=A, json={
            "input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h",
            "metadata": {"team": "a"}})
        assert response.status_code == 200, response.text
        created.append(response.json())
    batch = created[0]
    assert (batch["object"], batch["status"], batch["input_file_id"], batch["metadata"]) == (
        "batch", "in_progress", file_id, {"team": "a"})
    assert batch["request_counts"] == {"total": 4, "completed": 0, "failed": 2}
    assert "owner" not in batch and "queue" not in batch
    page = gateway.get("/v1/batches?limit=2", headers=A).json()
    assert [b["id"] for b in page["data"]] == [created[2]["id"], created[1]["id"]] and page["has_more"]
    rest = gateway.get(f"/v1/batches?limit=2&after={page['last_id']}", headers=A).json()
    assert [b["id"] for b in rest["data"]] == [batch["id"]] and not rest["has_more"]
    assert gateway.get("/v1/batches", headers=B).json()["data"] == []
    assert error_of(gateway.get(f"/v1/batches/{batch['id']}", headers=B), 404)["param"] == "batch_id"
    assert error_of(gateway.post(f"/v1/batches/{batch['id']}/cancel", headers=B), 404)
    assert gateway.post(f"/v1/batches/{batch['id']}/cancel", headers=A).json()["status"] == "cancelled"
    ended = gateway.get(f"/v1/batches/{batch['id']}", headers=A).json()
    assert ended["error_file_id"] == f"{batch['id']}_errors" and ended["output_file_id"] is None
    errors = [json.loads(x)
              for x in gateway.get(f"/v1/files/{ended['error_file_id']}/content", headers=A).text.splitlines()]
    assert [e["custom_id"] for e in errors] == ["c0", None, "c2", "c3"]
    assert [e["error"]["code"] for e in errors] == ["batch_cancelled", "invalid_request", "invalid_request",
                                                    "batch_cancelled"]
    info = gateway.get(f"/v1/files/{ended['error_file_id']}", headers=A).json()
    assert (info["purpose"], info["bytes"]) == ("batch_output", sum(len(json.dumps(e)) + 1 for e in errors))
    assert error_of(gateway.get(f"/v1/files/{ended['error_file_id']}", headers=B), 404)
    assert error_of(gateway.delete(f"/v1/files/{ended['error_file_id']}", headers=A), 400)


@pytest.mark.parametrize("body,param", [
    ({"endpoint": "/v1/chat/completions"}, "input_file_id"),
    ({"input_file_id": "file-x", "endpoint": "/v1/moderations"}, "endpoint"),
    ({"input_file_id": "file-x", "endpoint": "/v1/completions", "priority": 1}, "priority"),
])
def test_bad_batch_requests_answer_400(gateway, body, param):
    assert error_of(gateway.post("/v1/batches", headers=A, json=body), 400)["param"] == param
    assert error_of(gateway.get("/v1/batches?limit=0", headers=A), 400)["param"] == "limit"
    assert error_of(gateway.get("/v1/batches?after=batch_nope", headers=A), 404)


# ----- completions -----
def test_completions_are_answered_in_the_batch_lines_format(gateway, worker, fake_redis):
    assert gateway.get("/v1/models", headers=A).json()["data"][0]["id"] == MODEL
    assert gateway.get(f"/v1/models/{MODEL}", headers=A).json()["id"] == MODEL
    answer = gateway.post("/v1/completions", headers=A, json={"model": MODEL, "prompt": "hi", "max_tokens": 4})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    job_id = body["id"].removeprefix("cmpl-")
    result = Client(fake_redis).result(job_id, timeout=5)
    assert body == {**response_body(result, "/v1/completions", request_id=job_id, created=body["created"]),
                    "service_tier": "default"}  # OpenAI's echo of the tier it ran in
    assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == (expected_text(4), "length")
    chat = gateway.post("/v1/chat/completions", headers=A, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2}).json()
    assert (chat["object"], chat["choices"][0]["message"]) == ("chat.completion", {
        "role": "assistant", "content": expected_text(2), "refusal": None})
    assert chat["usage"]["completion_tokens"] == 2


def test_an_answer_is_read_from_the_done_event_without_reading_the_stored_result(gateway, worker, monkeypatch):
    def stored_result(*args, **kwargs):
        raise AssertionError("the answer was read a second time")

    monkeypatch.setattr(gateway.app.state.client, "result", stored_result)
    chat = gateway.post("/v1/chat/completions", headers=A, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] == expected_text(3)
    embedded = gateway.post("/v1/embeddings", headers=A, json={"model": MODEL, "input": ["a", "bc"]})
    assert embedded.status_code == 200, embedded.text
    assert len(embedded.json()["data"]) == 2


def test_the_live_workers_are_read_at_most_once_a_ttl(gateway, fake_redis, monkeypatch):
    pretend_worker(fake_redis)
    reads = []
    real = job_service.list_workers
    monkeypatch.setattr(job_service, "list_workers", lambda connection: reads.append(1) or real(connection))
    for _ in range(3):
        assert gateway.get("/v1/models", headers=A).json()["data"][0]["id"] == MODEL
    assert len(reads) <= 1
    monkeypatch.setattr(job_service, "LIVE_WORKERS_TTL_S", 0.0)
    before = len(reads)
    for _ in range(2):
        gateway.get("/v1/models", headers=A)
    assert len(reads) == before + 2



def test_a_model_missing_from_the_cached_view_is_looked_up_again_before_the_404(gateway, fake_redis):
    pretend_worker(fake_redis, model="other-model")
    assert [m["id"] for m in gateway.get("/v1/models", headers=A).json()["data"]] == ["other-model"]
    connection = fake_redis
    stats = WorkerStats(name="new", host="h", pid=2, queues=keys.DEFAULT_QUEUE, model=MODEL, state="idle",
                        in_flight=0, free_slots=1, kv_usage=0.0, tokens_per_s=0.0, last_heartbeat=0.0)
    connection.hset(keys.worker_stats_key("new"), mapping=stats.to_dict())
    connection.sadd(keys.WORKERS_SET, "new")  # started within the TTL of the gateway's view
    jobs = gateway.app.state.jobs
    assert jobs.served_model(GenerationRequest(prompt="hi", model=MODEL)) == MODEL
    unknown = gateway.post("/v1/embeddings", headers=A, json={"model": "nobody-serves-this", "input": "a"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"

def test_serve_help_names_every_endpoint():
    def shape(path: str) -> str:  # a path parameter's name is the help's own
        return re.sub(r"\{[^}]*\}", "{}", path)

    shown = shape(CliRunner().invoke(main, ["serve", "--help"]).output)
    assert [route.path for route in ROUTES if shape(route.path) not in shown] == []


def test_a_chat_stream_relays_the_job_as_openai_chunks(gateway, worker, fake_redis):
    response = gateway.post("/v1/chat/completions", headers=A, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True,
        "stream_options": {"include_usage": True}})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = sse(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    job_id = chunks[0]["id"].removeprefix("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] and c["model"] == MODEL
               for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == Client(fake_redis).result(job_id, timeout=5).text == expected_text(5)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # no prefix cache in the fake engine
    plain = sse(gateway.post("/v1/completions", headers=A, json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                                 "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in plain[:-1]) == expected_text(2)
    assert all("usage" not in c for c in plain[:-1])
    assert gateway.get("/metrics").text.count("batcher_gateway_streams 0.0") == 1


def test_failures_answer_openai_errors(gateway, worker):
    failed = gateway.post("/v1/completions", headers=A, json={"model": MODEL, "prompt": "too long"})
    assert error_of(failed, 400)["code"] == "generation_failed" and "context" in failed.json()["error"]["message"]
    streamed = sse(gateway.post("/v1/completions", headers=A, json={"model": MODEL, "prompt": "boom", "stream": True}))
    assert streamed[0]["error"]["code"] == "generation_failed" and streamed[-1] == "[DONE]"
    unknown = gateway.post("/v1/chat/completions", headers=A, json={"model": "gpt-4o", "messages": [
        {"role": "user", "content": "hi"}]})
    error = error_of(unknown, 404)
    assert (error["code"], error["param"]) == ("model_not_found", "model") and MODEL in error["message"]
    assert error_of(gateway.get("/v1/models/gpt-4o", headers=A), 404)["code"] == "model_not_found"
    for body, param in (({"model": MODEL, "prompt": "x", "n": 17}, "n"),
                        ({"model": MODEL, "prompt": "x", "logprobs": 6}, "logprobs"),
                        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
                        ({"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options")):
        assert error_of(gateway.post("/v1/completions", headers=A, json=body), 400)["param"] == param
    assert error_of(gateway.post("/v1/completions", headers=A, content=b"[1]"), 400)
    assert error_of(gateway.get("/v1/nothing", headers=A), 404)["message"] == "Invalid URL (GET /v1/nothing)"


def test_a_full_queue_answers_429(gateway, fake_redis):
    pretend_worker(fake_redis)
    for _ in range(MAX_QUEUE):
        Client(fake_redis).submit({"prompt": "x", "model": MODEL})
    full = gateway.post("/v1/completions", headers=A, json={"model": MODEL, "prompt": "x"})
    assert error_of(full, 429)["code"] == "queue_full"


def test_losing_redis_while_waiting_answers_503_and_cancels_the_job(gateway, fake_redis, monkeypatch):
    pretend_worker(fake_redis)

    async def unreachable(*args, **kwargs):
        raise RedisConnectionError("Connection refused")

    monkeypatch.setattr(gateway.app.state.aconnection, "xread", unreachable)
    monkeypatch.setattr(gateway_jobs, "OUTAGE_WAIT_S", 0.1)  # how long an outage is waited out (30 s: a failover)
    response = gateway.post("/v1/completions", headers=A, json={"model": MODEL, "prompt": "x"})
    assert error_of(response, 503)["code"] == "redis_unreachable"
    (job_id,) = [k.decode().removeprefix("rq:job:") for k in fake_redis.keys("rq:job:*")]
    assert Client(fake_redis).status(job_id).status == "canceled"


def test_an_enqueue_no_replica_confirmed_answers_503_not_replicated(gateway, fake_redis, monkeypatch):
    pretend_worker(fake_redis)

    def unconfirmed(request, **_):
        raise NotReplicated("0 of 1 replicas confirmed the enqueue of 1 jobs within 1000 ms")

    monkeypatch.setattr(gateway.app.state.client, "submit", unconfirmed)
    response = gateway.post("/v1/completions", headers=A, json={"model": MODEL, "prompt": "x"})
    assert error_of(response, 503)["code"] == "not_replicated"


def test_a_restarted_job_streams_on_seamlessly_or_says_it_diverged():
    def token(ids: list[int], text: str) -> StreamEvent:
        return StreamEvent(type="token", token_ids=ids, text=text)

    relay = TextRelay()
    assert [relay.delta(token([1], "a")), relay.delta(token([2], "b"))] == ["a", "b"]
    relay.restart()  # the new attempt repeats [1, 2], in other event boundaries, then goes on
    assert [relay.delta(token([1, 2], "ab")), relay.delta(token([3], "c")),
            relay.delta(token([4], "d"))] == ["", "c", "d"]
    relay.check_end()
    relay.restart()
    with pytest.raises(AttemptDiverged):
        relay.delta(token([1, 9], "ax"))
    short = TextRelay()
    short.delta(token([1, 2], "ab"))
    short.restart()
    short.delta(token([1], "a"))
    with pytest.raises(AttemptDiverged):
        short.check_end()


def test_a_timeout_finishes_as_length():
    result = GenerationResult(text="ab", token_ids=[1, 2], finish_reason="timeout",
                              usage=Usage(prompt_tokens=1, completion_tokens=2))
    assert response_body(result, "/v1/chat/completions", request_id="j")["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings",
                                  "/v1/batches"])
@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 1020])  # past our bound; past Python's recursion limit
def test_a_body_nested_too_deep_is_a_400_and_enqueues_nothing(gateway, fake_redis, path, depth):
    before = sorted(fake_redis.keys("rq:queue:*"))
    body = '{"m":' + "[" * depth + "]" * depth + "}"
    assert len(body) <= MAX_REQUEST_BYTES  # a 400 for its depth, not a 413 for its size
    error = error_of(gateway.post(path, headers={**A, "Content-Type": "application/json"}, content=body), 400)
    assert f"deeper than {MAX_JSON_DEPTH} levels" in error["message"]
    assert sorted(fake_redis.keys("rq:queue:*")) == before


def test_nesting_depth_counts_lists_and_objects():
    assert nesting_depth({"a": [{"b": []}], "c": 1}) == 4 and nesting_depth({}) == 1
