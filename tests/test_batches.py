"""Batches, the completion feed and model routing in the core, on fakeredis (with Lua).

A "worker" here records a job's outcome (`record_outcome_on`) inside a MULTI pipeline, as
`rqbatcher.jobs.ends.record_end` does for the real worker."""

from __future__ import annotations

import json
import time

import pytest
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from rqbatcher.batches.batch_object import BatchInputError, BatchNotFound
from rqbatcher.batches.lines import record_outcome_on
from rqbatcher.client import Client
from rqbatcher.jobs import keys
from rqbatcher.jobs.life import decode_request
from rqbatcher.jobs.queues import class_queue
from rqbatcher.jobs.worker_stats import WorkerStats
from rqbatcher.schema import GenerationResult, Usage
from rqbatcher.service_class import BATCH
from tests.jobs_support import fake_redis_fixture  # noqa: F401


def line(i: int, url: str = "/v1/completions", **body) -> str:
    body = body or {"prompt": f"prompt {i}", "max_tokens": 3}
    return json.dumps({"custom_id": f"c{i}", "method": "POST", "url": url, "body": body})


def batch_lines(n: int, bad: tuple[int, ...] = ()) -> list[str]:
    return ["{broken" if i in bad else line(i) for i in range(n)]


def result(text: str = "ok") -> GenerationResult:
    return GenerationResult(text=text, token_ids=[1, 2], finish_reason="length", usage=Usage(prompt_tokens=3,
                                                                                            completion_tokens=2))


def finish(client: Client, job_id: str, status: str = "finished", reason: str | None = None) -> None:
    """What the worker does when a job ends: record it in one transaction."""
    job = Job.fetch(job_id, connection=client.connection, serializer=JSONSerializer)
    request = decode_request(job)
    with client.connection.pipeline() as pipe:
        pipe.multi()
        record_outcome_on(pipe, job_id=job_id, queue=job.origin, status=status, request=request,
                       result=result(f"text of {job_id}") if status != "failed" else None, reason=reason)
        pipe.execute()


def queued_ids(client: Client, queue: str = keys.DEFAULT_QUEUE) -> list[str]:
    return [i.decode() for i in client.connection.lrange(f"rq:queue:{queue}", 0, -1)]


def test_a_batch_counts_each_job_once_and_renders_its_files_in_input_order(fake_redis):
    client = Client(fake_redis)
    batch = client.create_batch(batch_lines(10, bad=(3, 7)), metadata={"team": "a"})
    assert (batch.status, batch.endpoint, batch.metadata) == ("in_progress", "/v1/completions", {"team": "a"})
    assert batch.request_counts.model_dump() == {"total": 10, "completed": 0, "failed": 2}
    job_ids = queued_ids(client, class_queue(keys.DEFAULT_QUEUE, BATCH, 0))  # a batch's lines run in the batch class
    assert job_ids == [keys.batch_job_id(batch.id, i) for i in range(10) if i not in (3, 7)]
    request = decode_request(Job.fetch(job_ids[0], connection=fake_redis, serializer=JSONSerializer))
    assert (request.batch.index, request.batch.custom_id, int(request.deadline.timestamp())) == (0, "c0",
                                                                                                 batch.expires_at)
    for job_id in reversed(job_ids[1:]):  # out of order, as workers finish them
        finish(client, job_id)
    finish(client, job_ids[4], "finished")  # recorded twice (a retry): counted once
    assert client.batch(batch.id).request_counts.model_dump() == {"total": 10, "completed": 7, "failed": 2}
    finish(client, job_ids[0], "failed", reason="generation failed: boom")
    done = client.batch(batch.id)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 7, 3)
    assert done.completed_at and done.output_file_id and done.error_file_id
    out = [json.loads(x) for x in client.batch_output(batch.id)]
    errors = [json.loads(x) for x in client.batch_output(batch.id, errors=True)]
    assert [o["custom_id"] for o in out] == [f"c{i}" for i in (1, 2, 4, 5, 6, 8, 9)]
    assert out[0]["response"]["body"]["choices"][0]["text"] == f"text of {job_ids[1]}"
    assert out[0]["response"]["body"]["object"] == "text_completion"
    assert {o["response"]["body"]["service_tier"] for o in out} == {"flex"}  # the tier batch lines run in
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        ("c0", "generation_failed"), (None, "invalid_request"), (None, "invalid_request")]
    assert "line 4: not valid JSON" in errors[1]["error"]["message"]


def test_chat_lines_give_chat_completion_objects_and_models_route_to_their_queue(fake_redis):
    client = Client(fake_redis)
    chat = {"model": "org/Tiny.v1", "messages": [{"role": "user", "content": "hi"}]}
    batch = client.create_batch([line(0, "/v1/chat/completions", **chat), line(1)])
    assert (batch.endpoint, batch.request_counts.failed, batch.model) == ("/v1/chat/completions", 1, "org/Tiny.v1")
    model_queue = keys.model_queue(keys.DEFAULT_QUEUE, "org/Tiny.v1")
    assert queued_ids(client, class_queue(model_queue, BATCH, 0)) == [keys.batch_job_id(batch.id, 0)]
    finish(client, keys.batch_job_id(batch.id, 0))
    out = json.loads(next(client.batch_output(batch.id)))
    assert out["response"]["body"]["object"] == "chat.completion"
    assert out["response"]["body"]["choices"][0]["message"]["content"].startswith("text of")


def test_cancel_takes_queued_jobs_out_and_keeps_what_finished(fake_redis):
    client = Client(fake_redis)
    other = client.submit("not in the batch")
    batch = client.create_batch(batch_lines(6))
    for i in (0, 1):
        finish(client, keys.batch_job_id(batch.id, i))
    cancelled = client.cancel_batch(batch.id)
    assert cancelled.status == "cancelled" and cancelled.cancelling_at and cancelled.cancelled_at
    assert cancelled.request_counts.model_dump() == {"total": 6, "completed": 2, "failed": 4}
    assert queued_ids(client) == [other] and queued_ids(client, class_queue(keys.DEFAULT_QUEUE, BATCH, 0)) == []
    assert not fake_redis.exists(keys.due_key(class_queue(keys.DEFAULT_QUEUE, BATCH, 0))), "no stale deadline"
    assert Job.fetch(keys.batch_job_id(batch.id, 5), connection=fake_redis,
                     serializer=JSONSerializer).get_status() == JobStatus.CANCELED
    finish(client, keys.batch_job_id(batch.id, 2))  # a late end (stopped after the cancel) changes nothing
    assert client.batch(batch.id).request_counts.completed == 2
    errors = [json.loads(x) for x in client.batch_output(batch.id, errors=True)]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [(f"c{i}", "batch_cancelled") for i in range(2, 6)]
    assert len(list(client.batch_output(batch.id))) == 2
    assert client.cancel_batch(batch.id).status == "cancelled"  # twice: nothing more happens


def test_a_batch_past_its_window_expires_when_observed_and_late_failures_say_expired(fake_redis):
    client = Client(fake_redis)
    batch = client.create_batch(batch_lines(4), completion_window="1s")
    finish(client, keys.batch_job_id(batch.id, 0))
    time.sleep(1.1)
    finish(client, keys.batch_job_id(batch.id, 1), "failed", reason="the deadline passed while the job was queued")
    expired = client.batch(batch.id)
    assert expired.status == "expired" and expired.expired_at
    assert expired.request_counts.model_dump() == {"total": 4, "completed": 1, "failed": 3}
    errors = [json.loads(x) for x in client.batch_output(batch.id, errors=True)]
    assert [e["error"]["code"] for e in errors] == ["batch_expired"] * 3
    assert queued_ids(client) == []


def test_listing_is_newest_first_per_owner_with_pages(fake_redis):
    client = Client(fake_redis)
    mine = [client.create_batch(batch_lines(1), owner="tenant-a").id for _ in range(3)]
    theirs = client.create_batch(batch_lines(1), owner="tenant-b").id
    assert [b.id for b in client.batches(owner="tenant-a")] == mine[::-1]
    assert [b.id for b in client.batches(owner="tenant-a", after=mine[2], limit=1)] == [mine[1]]
    assert [b.id for b in client.batches()][0] == theirs
    with pytest.raises(BatchNotFound):
        client.batch(theirs, owner="tenant-a")
    with pytest.raises(BatchNotFound):
        client.cancel_batch(theirs, owner="tenant-a")
    fake_redis.delete(keys.batch_key(mine[0]))  # past its retention
    assert [b.id for b in client.batches(owner="tenant-a")] == mine[:0:-1]


def test_bad_batches_get_clear_errors(fake_redis):
    client = Client(fake_redis)
    with pytest.raises(BatchInputError, match="completion_window"):
        client.create_batch(batch_lines(1), completion_window="soon")
    with pytest.raises(BatchInputError, match="metadata"):
        client.create_batch(batch_lines(1), metadata={"k": 3})
    empty = client.create_batch([" \n"])
    assert empty.status == "failed" and empty.errors.data[0].code == "empty_file"
    with pytest.raises(BatchNotFound, match="no batch batch_0"):
        client.batch("batch_0")
    with pytest.raises(BatchNotFound):
        client.batch("../etc")


def record_plain_jobs(client: Client, n: int) -> list[str]:
    job_ids = client.submit_many([f"p{i}" for i in range(n)])
    for job_id in job_ids:
        with client.connection.pipeline() as pipe:
            pipe.multi()
            record_outcome_on(pipe, job_id=job_id, queue=keys.DEFAULT_QUEUE, status="finished", request=None,
                           result=result())
            pipe.execute()
    return job_ids


def test_two_consumers_share_the_feed_and_each_completion_is_handled_once(fake_redis):
    client = Client(fake_redis)
    job_ids = record_plain_jobs(client, 6)
    consumers = {name: client.completions("backend", name, timeout=0.2) for name in ("a", "b")}
    handled = []
    while consumers:
        for name, completions in list(consumers.items()):
            completion = next(completions, None)
            if completion is None:
                del consumers[name]
            else:
                handled.append((name, completion.job_id, completion.status))
    assert sorted(j for _, j, _ in handled) == sorted(job_ids)
    assert {name for name, _, _ in handled} == {"a", "b"} and {s for _, _, s in handled} == {"finished"}
    assert fake_redis.xpending(keys.queue_feed_key(keys.DEFAULT_QUEUE), "backend")["pending"] == 0


def test_an_entry_a_consumer_took_but_never_acknowledged_is_delivered_to_another(fake_redis):
    client = Client(fake_redis)
    job_ids = record_plain_jobs(client, 3)
    dying = client.completions("backend", "dying")
    lost = next(dying)  # the consumer is killed while handling it: never acknowledged
    too_early = [c.job_id for c in client.completions("backend", "other", claim_idle_s=30, timeout=0.1)]
    assert fake_redis.xpending(keys.queue_feed_key(keys.DEFAULT_QUEUE), "backend")["pending"] == 1
    assert lost.job_id not in too_early and len(too_early) == 2
    time.sleep(0.3)
    redelivered = [c.job_id for c in client.completions("backend", "other", claim_idle_s=0.2, timeout=0.1)]
    assert redelivered == [lost.job_id] and sorted(too_early + redelivered) == sorted(job_ids)


def test_a_request_with_a_model_goes_to_the_models_queue_which_its_workers_poll_first(fake_redis):
    client = Client(fake_redis)
    job_id = client.submit({"prompt": "x", "model": "HuggingFaceTB/SmolLM2-135M-Instruct", "priority": 2})
    routed = keys.model_queue(keys.DEFAULT_QUEUE, "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert routed.startswith("batcher__SmolLM2-135M-Instruct-")
    assert queued_ids(client, keys.queue_name(routed, 2)) == [job_id]
    assert fake_redis.hget(keys.MODEL_QUEUES, routed) == b"HuggingFaceTB/SmolLM2-135M-Instruct"
    assert keys.model_queue("q", "a/b") != keys.model_queue("q", "a.b")
    assert keys.base_queue(keys.queue_name(routed, 2)) == keys.DEFAULT_QUEUE
    polled = keys.priority_queue_names(["batcher"], model="HuggingFaceTB/SmolLM2-135M-Instruct")
    assert polled[:3] == [routed, "batcher", f"{routed}.p1"] and len(polled) == 2 * keys.NUM_PRIORITIES


def test_the_batch_commands(fake_redis, monkeypatch, tmp_path):
    from click.testing import CliRunner

    from rqbatcher.cli import main, options

    monkeypatch.setattr(options, "make_client", lambda url, queue="batcher": Client(fake_redis, queue=queue))
    path = tmp_path / "in.jsonl"
    path.write_bytes("\n".join(batch_lines(3, bad=(1,))).encode() + b"\n\xff\xfe\n")
    run = CliRunner().invoke
    created = run(main, ["batch", "create", str(path), "--metadata", "owner=me", "--window", "1h"])
    assert created.exit_code == 0, created.output
    batch_id = created.stdout.strip()
    finish(Client(fake_redis), keys.batch_job_id(batch_id, 0))
    status = run(main, ["batch", "status", batch_id])
    assert "status: in_progress" in status.output and "1 completed, 2 failed of 4" in status.output
    assert json.loads(run(main, ["batch", "status", batch_id, "--json"]).output)["metadata"] == {"owner": "me"}
    assert batch_id in run(main, ["batch", "list"]).output
    assert [json.loads(x)["custom_id"] for x in run(main, ["batch", "output", batch_id]).output.splitlines()] == ["c0"]
    errors = [json.loads(x) for x in run(main, ["batch", "output", batch_id, "--errors"]).output.splitlines()]
    assert "not UTF-8 text" in errors[-1]["error"]["message"]
    assert run(main, ["batch", "cancel", batch_id]).output.strip() == f"{batch_id}: cancelled"
    unknown = run(main, ["batch", "status", "batch_nope"])
    assert unknown.exit_code == 1 and "Error: no batch batch_nope" in unknown.output
    bad_window = run(main, ["batch", "create", str(path), "--window", "soon"])
    assert bad_window.exit_code == 1 and "completion_window" in bad_window.output
    missing = run(main, ["batch", "create", str(tmp_path / "nope.jsonl")])
    assert missing.exit_code == 2 and "No such file" in missing.output


def test_a_batch_whose_last_jobs_workers_expired_ends_expired_without_a_reader(fake_redis):
    client = Client(fake_redis)
    batch = client.create_batch(batch_lines(2), completion_window="1s")
    finish(client, keys.batch_job_id(batch.id, 0))
    time.sleep(1.1)
    finish(client, keys.batch_job_id(batch.id, 1), "failed", reason="the deadline passed while the job was queued")
    raw = fake_redis.hgetall(keys.batch_key(batch.id))
    assert raw[b"status"] == b"expired" and raw[b"expired_at"]


def test_a_job_that_only_claims_to_be_in_a_batch_changes_nothing_in_it(fake_redis):
    client = Client(fake_redis)
    batch = client.create_batch(batch_lines(2))
    forged = client.submit({"prompt": "x", "batch": {"id": batch.id, "index": 1, "custom_id": "c1"}})
    finish(client, forged)
    assert client.batch(batch.id).request_counts.completed == 0
    assert fake_redis.xlen(keys.queue_feed_key(keys.DEFAULT_QUEUE)) == 1  # it is still a finished job of the queue


def test_queues_report_the_model_each_routes_to_and_whether_a_live_worker_serves_it(fake_redis):
    from rqbatcher.jobs.admin import queue_overview

    client = Client(fake_redis)
    client.submit_many([{"prompt": "x", "model": "m1"}, {"prompt": "y", "model": "m2"}, "z"])
    stats = WorkerStats(name="w1", host="h", pid=1, queues="batcher", model="m1", state="idle", in_flight=0,
                        free_slots=8, kv_usage=0, tokens_per_s=0, last_heartbeat=time.time())
    fake_redis.hset(keys.worker_stats_key("w1"), mapping=stats.to_dict())
    fake_redis.sadd(keys.WORKERS_SET, "w1")
    rows = {r.model: r for r in queue_overview(fake_redis, keys.DEFAULT_QUEUE) if r.queued}
    assert {m: (r.queued, r.served) for m, r in rows.items()} == {None: (1, True), "m1": (1, True), "m2": (1, False)}
    assert client.models() == ["m1"]
