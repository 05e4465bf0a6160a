"""JobWorker's whole RQ lifecycle on fakeredis, with a fake engine: admission, executions, streams,
results, failures, stop-job, timeouts, drain, requeue, leases and recovery."""

from __future__ import annotations

import json
import threading
from datetime import datetime, timedelta, timezone

import pytest
from rq import Queue
from rq.command import send_stop_job_command
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.results import Result
from rq.serializers import JSONSerializer
from rq.suspension import resume, suspend

from rqbatcher.client import Client, JobFailed
from rqbatcher.jobs import admin, keys
from rqbatcher.jobs.contract import JOB_FUNCTION
from rqbatcher.jobs.life import PICKLED_JOB_REASON
from rqbatcher.schema import GenerationRequest, StreamEvent
from rqbatcher.workers.job_worker.worker import JobWorker
from tests.fake_engine import FakeEngine, expected_text
from tests.jobs_support import continued_text, fake_redis_fixture, keep_signal_handlers_fixture, wait_for  # noqa: F401

pytestmark = pytest.mark.usefixtures("keep_signal_handlers")
Q = "w"


def make_worker(connection, engine=None, **kwargs) -> JobWorker:
    return JobWorker(keys.priority_queue_names([Q]), engine or FakeEngine(), connection=connection, **kwargs)


def events(connection, job_id) -> list[StreamEvent]:
    return [StreamEvent.from_fields(f) for _, f in connection.xrange(keys.stream_key(job_id))]


def fetch(connection, job_id) -> Job:
    return Job.fetch(job_id, connection=connection, serializer=JSONSerializer)


def request(prompt="hi", max_tokens=3, **fields) -> dict:
    return {"prompt": prompt, "sampling": {"max_tokens": max_tokens}, **fields}


def expire_leases(connection) -> None:
    """What the passing of time does to a dead worker's leases: the keys expire, the index entries fall due."""
    for key in connection.keys("batcher:lease:*"):
        connection.delete(key)
    for index in connection.keys("batcher:leases:*"):
        connection.zadd(index, {member: 0 for member in connection.zrange(index, 0, -1)})


def test_jobs_run_as_rq_jobs_with_results_registries_and_streams(fake_redis):
    client = Client(fake_redis, queue=Q, result_ttl=600)
    ids = client.submit_many([request(max_tokens=2), request(max_tokens=5), request(max_tokens=3, priority=4)])
    worker = make_worker(fake_redis)
    assert worker.work(burst=True)
    for job_id, n in zip(ids, (2, 5, 3)):
        job = fetch(fake_redis, job_id)
        assert job.get_status() == JobStatus.FINISHED
        result = client.result(job_id, timeout=30)
        assert (result.text, result.finish_reason, result.usage.completion_tokens) == (expected_text(n), "length", n)
        assert (result.worker, result.model) == (worker.name, "fake-model")
        assert result.timings.queue_s >= 0 and 0 <= result.timings.ttft_s <= result.timings.total_s
        assert job.return_value() == result.model_dump(mode="json")
        assert job.latest_result().type == Result.Type.SUCCESSFUL
        assert job_id in FinishedJobRegistry(job.origin, connection=fake_redis)
        assert job.meta == {}
        stream = events(fake_redis, job_id)
        tokens = [e for e in stream if e.type == "token"]  # consecutive tokens may share an event
        assert stream == [stream[0], *tokens, stream[-1]] and (stream[0].type, stream[-1].type) == ("start", "done")
        assert {e.execution_id for e in stream} == {job.latest_result().execution_id}
        assert [t for e in tokens for t in e.token_ids] == result.token_ids
        assert [e.index for e in tokens] == [sum(len(e.token_ids) for e in tokens[:i]) for i in range(len(tokens))]
        assert "".join(e.text for e in stream) == expected_text(n)
        assert 0 < fake_redis.ttl(keys.stream_key(job_id)) <= 600  # expires with the result
    assert all(StartedJobRegistry(q, connection=fake_redis).count == 0 for q in (Q, f"{Q}.p4"))
    assert not fake_redis.keys("rq:execution:*")


def test_waiting_jobs_are_admitted_most_urgent_queue_first(fake_redis):
    client = Client(fake_redis, queue=Q)
    low = client.submit(request(priority=7))
    high = client.submit_many([request(), request(priority=1)])
    engine = FakeEngine(max_num_seqs=1)
    make_worker(fake_redis, engine).work(burst=True)
    assert engine.added == [fetch(fake_redis, job_id).latest_result().execution_id for job_id in [*high, low]]


class Tripwire:
    """Unpickling this calls `trip`: the test fails if the worker ever unpickles job data."""

    def __reduce__(self):
        return (trip, ())


TRIPPED: list[bool] = []


def trip():
    TRIPPED.append(True)
    return "tripped"


def test_every_bad_job_fails_alone_with_a_readable_reason(fake_redis):
    client = Client(fake_redis, queue=Q)
    json_queue = Queue(Q, connection=fake_redis, serializer=JSONSerializer)
    past = (datetime.now(timezone.utc) - timedelta(seconds=1)).isoformat()
    bad = {
        Queue(Q, connection=fake_redis).enqueue(JOB_FUNCTION, {"prompt": Tripwire()}).id: PICKLED_JOB_REASON,
        json_queue.enqueue("os.system", "echo hi").id: "runs only rqbatcher.jobs.generate",
        json_queue.enqueue(JOB_FUNCTION, "just a prompt").id: "one positional argument",
        json_queue.enqueue(JOB_FUNCTION, {"prompt": "hi", "sampling": {"top_p": 2}}).id:
            "invalid request: sampling.top_p",
        client.submit(request(prompt="too long")): "this model's context is 512",
        client.submit(request(deadline=past)): "passed while the job was queued",
        client.submit(request(prompt="boom")): "generation failed: RuntimeError: boom",
    }
    good = client.submit(request(max_tokens=4))
    make_worker(fake_redis).work(burst=True)
    assert not TRIPPED
    assert client.result(good, timeout=30).text == expected_text(4)
    failed = FailedJobRegistry(Q, connection=fake_redis, serializer=JSONSerializer)
    for job_id, reason in bad.items():
        assert job_id in failed
        with pytest.raises(JobFailed) as info:
            client.result(job_id, timeout=30)
        assert reason in info.value.reason and info.value.status == "failed"
        last = events(fake_redis, job_id)[-1]
        assert last.type == "error" and reason in last.error
        assert fetch(fake_redis, job_id).retries_left in (0, None)  # failed for good: no retry


def test_stop_job_aborts_a_running_job_within_one_step(fake_redis):
    client = Client(fake_redis, queue=Q)
    victim, other = client.submit_many([request(max_tokens=50), request(max_tokens=6)])
    at_stop, heard = {}, threading.Event()

    def on_step(worker, outputs):
        if worker.engine.step_index == 2:
            send_stop_job_command(fake_redis, victim, serializer=JSONSerializer)
            wait_for(heard.is_set, 5, "the stop-job command to arrive")
            at_stop["tokens"] = worker.engine.step_index

    worker = make_worker(fake_redis, on_step=on_step)
    request_stop = worker.jobs.request_stop
    worker.jobs.request_stop = lambda job_id: (request_stop(job_id), heard.set())  # what RQ's command thread calls
    worker.work(burst=True)
    job = fetch(fake_redis, victim)
    assert job.get_status() == JobStatus.STOPPED
    assert victim in FailedJobRegistry(Q, connection=fake_redis)
    stream = events(fake_redis, victim)
    assert (stream[-1].type, stream[-1].finish_reason) == ("done", "cancelled")
    assert stream[-1].usage.completion_tokens == at_stop["tokens"]  # no step ran for it after the command
    with pytest.raises(JobFailed, match="stopped: cancelled"):
        client.result(victim, timeout=30)
    assert client.result(other, timeout=30).text == expected_text(6)


def test_a_running_timeout_ends_the_job_with_its_partial_text(fake_redis):
    import time

    client = Client(fake_redis, queue=Q)
    job_id = client.submit(request(max_tokens=100, timeout_s=0.05))

    def on_step(worker, outputs):
        if worker.engine.step_index == 2:
            time.sleep(0.06)  # let the timeout pass: the next iteration must end the job

    make_worker(fake_redis, on_step=on_step).work(burst=True)
    result = client.result(job_id, timeout=30)
    assert (result.finish_reason, result.text) == ("timeout", expected_text(2))
    assert events(fake_redis, job_id)[-1].finish_reason == "timeout"


def test_first_signal_drains_second_requeues_at_the_front(fake_redis):
    client = Client(fake_redis, queue=Q)
    ids = client.submit_many([request(max_tokens=4) for _ in range(4)])

    def drain(worker, outputs):
        if worker.engine.step_index == 1:
            worker.request_stop(None, None)

    make_worker(fake_redis, FakeEngine(max_num_seqs=2), on_step=drain).work()
    assert [fetch(fake_redis, i).get_status() for i in ids] == [JobStatus.FINISHED] * 2 + [JobStatus.QUEUED] * 2

    more = client.submit_many([request(max_tokens=4)])

    def force(worker, outputs):
        if worker.engine.step_index == 1:
            worker.request_stop(None, None)
            worker.request_force_stop(None, None)

    make_worker(fake_redis, FakeEngine(max_num_seqs=2), on_step=force).work()
    assert Queue(Q, connection=fake_redis).job_ids == ids[2:] + more  # back at the front, in order
    for job_id in ids[2:]:
        job = fetch(fake_redis, job_id)
        assert job.get_status() == JobStatus.QUEUED
        assert int(fake_redis.get(keys.attempts_key(job_id))) == 0  # a requeue is not an attempt
        assert not fake_redis.exists(keys.lease_key(job_id))
        assert job.latest_result() is None
    assert StartedJobRegistry(Q, connection=fake_redis).count == 0
    assert not fake_redis.keys("rq:execution:*")

    engine = FakeEngine()
    make_worker(fake_redis, engine).work(burst=True)
    for job_id in ids[2:]:  # each goes on from the tokens the force-stopped worker wrote before it left
        assert client.result(job_id, timeout=10).text == expected_text(4)
        assert continued_text(events(fake_redis, job_id)) == expected_text(4)
        assert [r.type for r in fetch(fake_redis, job_id).results()] == [Result.Type.SUCCESSFUL]
    assert sorted(engine.resumed.values()) == [1, 1]  # the token of its one step


def test_a_job_whose_lease_was_lost_is_not_recorded(fake_redis):
    client = Client(fake_redis, queue=Q)
    taken, kept = client.submit_many([request(max_tokens=5), request(max_tokens=5)])
    ends = []

    def on_step(worker, outputs):
        if worker.engine.step_index == 2:  # the lease expired and another worker took the job over
            fake_redis.set(keys.lease_key(taken), "another-execution")

    make_worker(fake_redis, on_step=on_step, on_job_end=lambda w, end: ends.append(end)).work(burst=True)
    assert {e.job_id: e.status for e in ends} == {taken: "lost", kept: "finished"}
    assert fetch(fake_redis, taken).latest_result() is None
    assert "done" not in [e.type for e in events(fake_redis, taken)]
    assert client.result(kept, timeout=30).text == expected_text(5)


def test_a_dead_workers_jobs_are_retried_once_and_go_on_from_their_streams(fake_redis):
    client = Client(fake_redis, queue=Q)
    ids = client.submit_many([request(max_tokens=6) for _ in range(3)])

    class Killed(BaseException):
        pass

    def die(worker, outputs):
        if worker.engine.step_index == 2:
            raise Killed  # the process is gone: nothing recorded, leases left to run out

    with pytest.raises(Killed):
        make_worker(fake_redis, on_step=die).work()
    registry = StartedJobRegistry(Q, connection=fake_redis)
    dead = dict(registry.get_job_and_execution_ids(cleanup=False))
    assert sorted(dead) == sorted(ids)
    expire_leases(fake_redis)

    engine = FakeEngine()
    make_worker(fake_redis, engine).work(burst=True)
    for job_id in ids:
        job = fetch(fake_redis, job_id)
        assert client.result(job_id, timeout=10).text == expected_text(6)
        assert [r.type for r in job.results()] == [Result.Type.SUCCESSFUL]
        assert job.latest_result().execution_id != dead[job_id]
        stream = events(fake_redis, job_id)
        assert {e.execution_id for e in stream} == {dead[job_id], job.latest_result().execution_id}
        assert continued_text(stream) == expected_text(6)  # the lost attempt's tokens are kept, not made again
        assert engine.resumed[job.latest_result().execution_id] == len(
            [t for e in stream if e.execution_id == dead[job_id] for t in e.token_ids])
    assert registry.count == 0 and not fake_redis.keys("batcher:lease*") and not fake_redis.keys("batcher:attempts:*")


def test_suspend_stops_admission_until_resume(fake_redis):
    suspend(fake_redis)
    client = Client(fake_redis, queue=Q)
    job_id = client.submit(request())
    worker = make_worker(fake_redis)
    thread = threading.Thread(target=worker.work)
    thread.start()
    try:
        wait_for(lambda: fake_redis.hget(worker.key, "state") == b"suspended", 10, "the worker to suspend")
        assert fetch(fake_redis, job_id).get_status() == JobStatus.QUEUED
        resume(fake_redis)
        assert client.result(job_id, timeout=10).text == expected_text(3)
    finally:
        worker.request_stop(None, None)
        thread.join(10)
    assert not thread.is_alive()


def test_lease_keeper_extends_leases_while_the_engine_is_busy(fake_redis):
    """The keeper thread renews leases on its own clock, even during one long engine step."""
    client = Client(fake_redis, queue=Q)
    job_id = client.submit(request(max_tokens=2))
    registry = StartedJobRegistry(Q, connection=fake_redis)
    scores = []

    def slow_step(worker, outputs):
        if worker.engine.step_index == 1:
            first = fake_redis.zrange(registry.key, 0, -1, withscores=True)[0][1]
            wait_for(lambda: fake_redis.zrange(registry.key, 0, -1, withscores=True)[0][1] > first, 10,
                     "a heartbeat during a blocked step")
            scores.append(first)

    make_worker(fake_redis, lease_s=3, on_step=slow_step).work(burst=True)
    assert scores and client.result(job_id, timeout=10).text == expected_text(2)


def test_hooks_give_an_ops_layer_every_step_and_end(fake_redis):
    ids = Client(fake_redis, queue=Q).submit_many([request(max_tokens=3), request(max_tokens=1),
                                                  request(prompt="too long")])
    engine, steps, ends = FakeEngine(), [], []
    make_worker(fake_redis, engine,
                on_step=lambda w, outs: steps.append((w.num_in_flight, len(outs), dict(w.queue_depths))),
                on_job_end=lambda w, end: ends.append(end)).work(burst=True)
    assert len(engine.added) == 2  # the one too long is refused by the engine
    assert [s[:2] for s in steps] == [(1, 2), (1, 1), (0, 1)]
    assert steps[0][2] == {name: 3 if name == Q else 0 for name in keys.priority_queue_names([Q])}  # as read
    assert [(e.job_id, e.status) for e in ends] == [(ids[2], "failed"), (ids[1], "finished"), (ids[0], "finished")]
    assert all(e.execution_id == fetch(fake_redis, e.job_id).latest_result().execution_id for e in ends)


def test_requests_are_checked_by_pydantic_before_the_engine_sees_them(fake_redis):
    engine = FakeEngine()
    Queue(Q, connection=fake_redis, serializer=JSONSerializer).enqueue(
        JOB_FUNCTION, GenerationRequest(prompt="ok").model_dump(mode="json") | {"extra": 1})
    make_worker(fake_redis, engine).work(burst=True)
    assert engine.added == []


def test_job_ids_without_a_readable_job_are_dropped_and_the_worker_goes_on(fake_redis):
    client = Client(fake_redis, queue=Q)
    broken = client.submit(request())
    fake_redis.hset(f"rq:job:{broken}", "status", "no-such-status")  # RQ cannot load this hash
    queue = Queue(Q, connection=fake_redis)
    queue.push_job_id("deleted-job")  # an id whose job is gone
    good = client.submit(request(max_tokens=2))
    make_worker(fake_redis).work(burst=True)
    assert client.result(good, timeout=10).text == expected_text(2)
    assert queue.job_ids == [] and fake_redis.llen(queue.intermediate_queue_key) == 0


def test_a_batch_and_the_feed_are_written_in_the_transaction_that_records_each_result(fake_redis):
    client = Client(fake_redis, queue=Q)
    lines = [f'{{"custom_id": "c{i}", "method": "POST", "url": "/v1/completions", '
             f'"body": {{"prompt": "p{i}", "max_tokens": {2 + i}}}}}' for i in range(3)] + ["not json"]
    batch = client.create_batch(lines)
    plain = client.submit(request(max_tokens=2))
    make_worker(fake_redis).work(burst=True)
    done = client.batch(batch.id)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 3, 1)
    out = [line for line in client.batch_output(batch.id)]
    assert ([json.loads(o)["response"]["body"]["choices"][0]["text"] for o in out]
            == [expected_text(n) for n in (2, 3, 4)])
    feed = [c.job_id for c in client.completions("g", "c", timeout=0.1)]
    assert sorted(feed) == sorted([plain, *(keys.batch_job_id(batch.id, i) for i in range(4))])


def test_a_worker_takes_jobs_for_its_model_and_jobs_for_any_model_but_not_another_models(fake_redis):
    client = Client(fake_redis, queue=Q)
    mine, anyone, other = client.submit_many([request(model="m1"), request(), request(model="m2")])
    worker = JobWorker(keys.priority_queue_names([Q], model="m1"), FakeEngine(), connection=fake_redis,
                         model_name="m1")
    worker.work(burst=True)
    assert client.result(mine, timeout=5).model == "m1" and client.result(anyone, timeout=5).model == "m1"
    assert fetch(fake_redis, other).get_status() == JobStatus.QUEUED


def test_a_starting_worker_is_listed_before_its_first_heartbeat_interval(fake_redis):
    """The gateway serves a model only while a live worker lists it: a worker that already takes jobs must be
    listed at once, not one heartbeat interval (here 10 s) later."""
    Client(fake_redis, queue=Q).submit(request(max_tokens=2))
    listed = []

    def first_step(worker, outputs):
        if not listed:
            listed.append(wait_for(lambda: [w.name for w in admin.list_workers(fake_redis)], 5, "the worker listed"))

    worker = make_worker(fake_redis, lease_s=30, on_step=first_step)
    worker.work(burst=True)
    assert listed == [[worker.name]]


def test_heartbeat_publishes_the_workers_figures(fake_redis):
    engine = FakeEngine(max_num_seqs=4)
    engine.prefix_cache_stats.queries, engine.prefix_cache_stats.hits = 800, 600
    worker = make_worker(fake_redis, engine)
    worker.keeper.tick()
    (stats,) = admin.list_workers(fake_redis)
    assert (stats.name, stats.state, stats.free_slots, stats.model) == (worker.name, "idle", 4, "fake-model")
    assert stats.prefix_cache_hit_rate == 0.75


def test_a_scan_of_empty_queues_runs_no_pick_and_the_next_job_is_picked(fake_redis, monkeypatch):
    """The pick is a script over every queue's keys: where no queue holds a job (one EXISTS says so), a scan skips
    it and reports the queues empty; a job queued then is picked and started by the next scan."""
    worker = make_worker(fake_redis)
    worker.bootstrap()
    classes, picks = worker.admission.classes, []
    pick = classes.pick
    monkeypatch.setattr(classes, "pick", lambda *args, **kwargs: picks.append(args) or pick(*args, **kwargs))
    assert worker.admission.admit(block=False) == [] and picks == []
    depths = worker.admission.queue_depths
    assert Q in depths and not any(depths.values()) and worker.admission.queues_empty
    job_id = Client(fake_redis, queue=Q).submit(request())
    assert [f.job.id for f in worker.admission.admit(block=False)] == [job_id] and len(picks) == 1
    assert worker.admission.queue_depths[Q] == 1  # as the pick read it, before taking
