"""The job contract, the key names and the Client, on fakeredis (no worker, no torch)."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest
import redis
from click.testing import CliRunner
from fakeredis import FakeRedis
from rq import Queue, SimpleWorker
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from rqbatcher.cli import main, options
from rqbatcher.client import Client, JobFailed, JobNotFound, QueueFull
from rqbatcher.jobs import keys
from rqbatcher.jobs.contract import JOB_FUNCTION, NeedsBatcherWorker, generate
from rqbatcher.jobs.life import InvalidJob, decode_request
from rqbatcher.schema import GenerationRequest, StreamEvent
from tests.jobs_support import fake_redis_fixture  # noqa: F401


def test_keys_refuse_what_could_reach_other_keys():
    assert keys.stream_key("abc-123_X") == "batcher:stream:abc-123_X"
    for bad in ["", "a:b", "a*", "a b", "../x", "a\nb", None]:
        with pytest.raises(ValueError):
            keys.stream_key(bad)
    for bad in ["", "a.b", "a:b", "x" * 65]:
        with pytest.raises(ValueError):
            keys.check_queue(bad)


def test_priority_levels_have_one_queue_each_most_urgent_first():
    assert keys.queue_name("q", 0) == "q"
    assert keys.queue_name("q", 9) == "q.p9"
    assert keys.priority_queue_names(["a", "b"])[:2] == ["a", "a.p1"]
    assert keys.priority_queue_names(["a", "b"])[10] == "b"
    with pytest.raises(ValueError):
        keys.queue_name("q", 10)


def test_job_argument_is_validated_with_readable_reasons():
    ok = GenerationRequest(prompt="hi").model_dump(mode="json")
    assert decode_request(SimpleNamespace(func_name=JOB_FUNCTION, args=[ok], kwargs={})).prompt == "hi"
    cases = [
        ("os.system", (ok,), {}, "runs only rqbatcher.jobs.generate"),
        (JOB_FUNCTION, ("hi",), {}, "one positional argument"),
        (JOB_FUNCTION, (ok,), {"x": 1}, "one positional argument"),
        (JOB_FUNCTION, ({"prompt": "hi", "sampling": {"temperature": -1}},), {}, "sampling.temperature"),
        (JOB_FUNCTION, ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]},), {}, "exactly one of"),
    ]
    for func, args, kwargs, reason in cases:
        with pytest.raises(InvalidJob, match=reason.replace(".", r"\.")):
            decode_request(SimpleNamespace(func_name=func, args=args, kwargs=kwargs))


def test_a_plain_rq_worker_fails_the_job_and_says_to_run_batcher_worker(fake_redis):
    with pytest.raises(NeedsBatcherWorker, match="batcher worker"):
        generate({"prompt": "hi"})
    job_id = Client(fake_redis, queue="plain").submit("hi")
    SimpleWorker(["plain"], connection=fake_redis, serializer=JSONSerializer).work(burst=True)
    job = Job.fetch(job_id, connection=fake_redis, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.FAILED  # every attempt, retries included, fails the same way
    assert "batcher worker" in job.latest_result().exc_string


def test_submit_enqueues_an_rq_job_with_json_and_ttls(fake_redis):
    client = Client(fake_redis, queue="jobs", result_ttl=111, failure_ttl=222, queue_ttl=333)
    request = GenerationRequest(prompt="Hello   there\nworld " * 10, priority=2, metadata={"user": "u1"})
    job_id = client.submit(request)
    job = Job.fetch(job_id, connection=fake_redis, serializer=JSONSerializer)
    assert job.origin == "jobs.p2" and job.func_name == JOB_FUNCTION
    assert job.args == (request.model_dump(mode="json"),) or job.args == [request.model_dump(mode="json")]
    assert job.kwargs == {} and job.meta == {}
    assert (job.result_ttl, job.failure_ttl, job.ttl) == (111, 222, 333)
    assert job.retries_left is None  # crash recovery is the worker's (workers/job_worker/leases.py), not RQ's Retry
    assert job.description.startswith("generate: Hello there world") and len(job.description) < 80
    assert 0 < fake_redis.ttl(job.key) <= 333  # the queue TTL
    raw = fake_redis.hget(job.key, "data")
    assert b"cpickle" not in raw.lower()  # JSON, readable by any serializer-aware tool
    assert Queue("jobs.p2", connection=fake_redis).job_ids == [job_id]


def test_submit_many_keeps_order_across_priority_queues(fake_redis):
    client = Client(fake_redis, queue="jobs")
    ids = client.submit_many([{"prompt": "a", "priority": 5}, "b", {"prompt": "c", "priority": 5}],
                             job_ids=["j-a", "j-b", "j-c"])
    assert ids == ["j-a", "j-b", "j-c"]
    assert Queue("jobs.p5", connection=fake_redis).job_ids == ["j-a", "j-c"]
    assert Queue("jobs", connection=fake_redis).job_ids == ["j-b"]
    with pytest.raises(ValueError):
        client.submit("x", job_id="bad:id")


def test_backpressure_refuses_past_the_queue_limit(fake_redis):
    client = Client(fake_redis, queue="small", max_queue_length=3)
    client.submit_many(["a", "b"])
    with pytest.raises(QueueFull, match="holds 2 jobs"):
        client.submit_many(["c", "d"])
    client.submit("c")
    with pytest.raises(QueueFull):
        client.submit("d")
    assert len(Queue("small", connection=fake_redis)) == 3


def test_summarise_asks_for_a_summary_of_the_document(fake_redis):
    client = Client(fake_redis, queue="s")
    job = Job.fetch(client.summarise("The document.", "In one line."), connection=fake_redis,
                    serializer=JSONSerializer)
    request = GenerationRequest.model_validate(job.args[0])
    assert request.messages[0].content == "In one line.\n\nThe document."
    assert request.sampling.max_tokens > 0


def test_cancel_a_queued_job_and_readers_learn_it(fake_redis):
    client = Client(fake_redis, queue="c")
    job_id, other = client.submit_many(["a", "b"])
    info = client.status(other)
    assert (info.status, info.position) == ("queued", 1)
    assert client.cancel(job_id)
    assert Queue("c", connection=fake_redis).job_ids == [other]
    assert client.status(job_id).status == "canceled"
    with pytest.raises(JobFailed, match="cancelled"):
        client.result(job_id, timeout=5)
    events = list(client.stream(job_id, timeout=5))
    assert [(e.type, e.finish_reason) for e in events] == [("done", "cancelled")]
    assert not client.cancel(job_id)


def test_result_waits_then_times_out_and_unknown_jobs_are_reported(fake_redis):
    client = Client(fake_redis, queue="r")
    job_id = client.submit("a")
    with pytest.raises(TimeoutError, match="still queued"):
        client.result(job_id, timeout=0.2)
    with pytest.raises(JobNotFound):
        client.result("no-such-job")
    with pytest.raises(JobNotFound):
        client.status("no-such-job")


def test_a_client_that_has_reached_redis_waits_out_an_outage_at_the_start_of_a_wait(fake_redis):
    """A client waiting on many jobs meets an outage between two of them: it waits, where a client that never
    reached Redis (a wrong address, most likely) gets the error at once."""
    server = fake_redis.connection_pool.connection_kwargs["server"]
    client = Client(fake_redis, queue="o")
    job_id = client.submit("a")
    never_reached = Client(FakeRedis(server=server), queue="o")
    server.connected = False
    with pytest.raises(redis.exceptions.ConnectionError):
        never_reached.result(job_id, timeout=5)
    with pytest.raises(redis.exceptions.ConnectionError):
        next(never_reached.stream(job_id, timeout=5))

    def back_up_and_cancel():
        server.connected = True
        Client(FakeRedis(server=server), queue="o").cancel(job_id)

    threading.Timer(0.3, back_up_and_cancel).start()
    with pytest.raises(JobFailed, match="cancelled"):
        client.result(job_id, timeout=20)
    server.connected = False
    threading.Timer(0.3, lambda: setattr(server, "connected", True)).start()
    assert [e.finish_reason for e in client.stream(job_id, timeout=20)] == ["cancelled"]
    server.connected = False
    with pytest.raises(redis.exceptions.ConnectionError):  # a timeout still bounds the wait
        client.result(job_id, timeout=0.2)

    server.connected = True
    asked_first = Client(FakeRedis(server=server), queue="o")
    assert asked_first.status(job_id).status == "canceled"  # Redis answered this client: it waits from now on
    server.connected = False
    threading.Timer(0.3, lambda: setattr(server, "connected", True)).start()
    with pytest.raises(JobFailed, match="cancelled"):
        asked_first.result(job_id, timeout=20)


def test_stream_keeps_only_the_restarted_attempt(fake_redis):
    """A restart switches readers to the new execution; a lost attempt still writing is ignored."""
    client = Client(fake_redis, queue="r")
    key = keys.stream_key("j1")

    def add(**fields):
        fake_redis.xadd(key, StreamEvent(**fields).to_fields())

    add(type="start", execution_id="e1")
    add(type="token", execution_id="e1", text="ab", token_ids=[1, 2])
    add(type="restart", execution_id="e2")
    add(type="start", execution_id="e2")
    add(type="token", execution_id="e1", text="zz", token_ids=[9], index=2)  # the lost attempt, still writing
    add(type="token", execution_id="e2", text="cd", token_ids=[3, 4])
    add(type="done", execution_id="e2", finish_reason="stop", usage={"prompt_tokens": 1, "completion_tokens": 2})
    add(type="token", execution_id="e2", text="after the end")
    events = list(client.stream("j1", timeout=5))
    assert [(e.type, e.execution_id, e.text) for e in events] == [
        ("start", "e1", ""), ("token", "e1", "ab"), ("restart", "e2", ""), ("start", "e2", ""),
        ("token", "e2", "cd"), ("done", "e2", "")]


def test_cli_submit_file_creates_a_batch_whose_bad_lines_are_failed_requests(fake_redis, monkeypatch, tmp_path):
    monkeypatch.setattr(options, "make_client", lambda url, queue="batcher": Client(fake_redis, queue=queue))
    lines = [
        {"custom_id": "r1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": 4}},
        {"custom_id": "r2", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "bogus": 1}},
        {"custom_id": "r3", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "yo"}], "temperature": 0}},
        {"custom_id": "r4", "method": "POST", "url": "/v1/completions", "body": {"prompt": "there"}},
    ]
    path = tmp_path / "batch.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    result = CliRunner().invoke(main, ["submit", "--queue", "files", "--file", str(path)])
    assert result.exit_code == 0, result.output
    batch_id = result.stdout.strip()
    assert "4 requests (2 bad lines), in_progress" in result.stderr
    client = Client(fake_redis, queue="files")
    assert Queue("files.batch", connection=fake_redis).job_ids == [keys.batch_job_id(batch_id, i) for i in (0, 3)]
    job = Job.fetch(keys.batch_job_id(batch_id, 3), connection=fake_redis, serializer=JSONSerializer)
    assert job.args[0]["batch"] == {"id": batch_id, "index": 3, "custom_id": "r4", "url": "/v1/completions",
                                    "encoding_format": None}
    errors = [json.loads(line) for line in client.batch_output(batch_id, errors=True)]
    assert [e["custom_id"] for e in errors] == ["r2", "r3"]
    assert "line 2: unsupported body fields: bogus" in errors[0]["error"]["message"]
    assert "the batch's endpoint /v1/completions" in errors[1]["error"]["message"]


def test_cli_submit_takes_openais_sampling_fields_and_status_shows_metadata_and_user(fake_redis, monkeypatch):
    monkeypatch.setattr(options, "make_client", lambda url, queue="batcher": Client(fake_redis, queue=queue))
    result = CliRunner().invoke(main, ["submit", "--queue", "oai", "hi", "--frequency-penalty", "0.5",
                                       "--presence-penalty", "-1", "--logit-bias", "17=-100", "--logit-bias", "3=2.5",
                                       "--metadata", "team=search", "--user", "u-42"])
    assert result.exit_code == 0, result.output
    job_id = result.stdout.strip()
    request = GenerationRequest.model_validate(
        Job.fetch(job_id, connection=fake_redis, serializer=JSONSerializer).args[0])
    s = request.sampling
    assert (s.frequency_penalty, s.presence_penalty, s.logit_bias) == (0.5, -1.0, {17: -100.0, 3: 2.5})
    shown = CliRunner().invoke(main, ["status", job_id]).output
    assert "user: u-42" in shown and "metadata: {'team': 'search'}" in shown
    for bad in (["--logit-bias", "17"], ["--logit-bias", "17=500"], ["--frequency-penalty", "3"]):
        assert CliRunner().invoke(main, ["submit", "--queue", "oai", "hi", *bad]).exit_code == 2
    assert len(Queue("oai", connection=fake_redis)) == 1


def test_cli_submit_needs_exactly_one_input():
    result = CliRunner().invoke(main, ["submit"])
    assert result.exit_code == 2 and "either PROMPT or --file" in result.output


def test_cli_tail_status_and_cancel(fake_redis, monkeypatch):
    monkeypatch.setattr(options, "make_client", lambda url, queue="batcher": Client(fake_redis, queue=queue))
    key = keys.stream_key("j1")
    for kind, execution, text in [("start", "e1", ""), ("token", "e1", "Hel"), ("restart", "e2", ""),
                                  ("token", "e2", "Hello"), ("token", "e2", " world")]:
        fake_redis.xadd(key, StreamEvent(type=kind, execution_id=execution, text=text).to_fields())
    fake_redis.xadd(key, StreamEvent(type="done", execution_id="e2", finish_reason="length").to_fields())
    tail = CliRunner().invoke(main, ["tail", "j1"])
    assert tail.exit_code == 0
    assert tail.stdout == "HelHello world\n" and "restarted" in tail.stderr and "[length]" in tail.stderr

    job_id = Client(fake_redis).submit("a prompt")
    status = CliRunner().invoke(main, ["status", job_id])
    assert status.exit_code == 0 and "status: queued" in status.output and "position: 0" in status.output
    assert CliRunner().invoke(main, ["cancel", job_id]).exit_code == 0
    again = CliRunner().invoke(main, ["cancel", job_id])
    assert again.exit_code == 1 and "already ended" in again.output
    assert "no job" in CliRunner().invoke(main, ["status", "nope"]).output


def test_redis_urls_with_tls_and_passwords(monkeypatch):
    from redis.connection import SSLConnection

    from rqbatcher.client import REDIS_URL_ENV, connect

    pool = connect("rediss://:s3cret@redis.example:6380/2").connection_pool
    assert issubclass(pool.connection_class, SSLConnection)
    assert (pool.connection_kwargs["password"], pool.connection_kwargs["db"]) == ("s3cret", 2)
    monkeypatch.setenv(REDIS_URL_ENV, "redis://user:pw@elsewhere:6390/3")
    kwargs = connect().connection_pool.connection_kwargs
    assert (kwargs["host"], kwargs["username"], kwargs["password"], kwargs["db"]) == ("elsewhere", "user", "pw", 3)
