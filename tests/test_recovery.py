"""Recovery and fencing on fakeredis, with a fake engine: jobs of lost workers (whatever enqueued them) run
again exactly once, a poison job ends failed, a cancel always wins, RQ's own cleanup never races the
recovery, stream events are written once each, and an execution that lost its lease writes nothing."""

from __future__ import annotations

import time

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from rq import Queue
from rq.job import JobStatus
from rq.registry import FailedJobRegistry, StartedJobRegistry, clean_registries
from rq.results import Result
from rq.serializers import JSONSerializer

from rqbatcher.client import Client, JobFailed
from rqbatcher.jobs import keys
from rqbatcher.jobs.contract import JOB_FUNCTION, MAX_REASON_CHARS
from rqbatcher.workers.job_worker.admission import BUSY_RESCAN_S
from rqbatcher.workers.job_worker.leases import MAX_ATTEMPTS
from tests.fake_engine import FakeEngine, expected_text
from tests.jobs_support import continued_text, fake_redis_fixture, keep_signal_handlers_fixture  # noqa: F401
from tests.test_worker import Q, events, expire_leases, fetch, make_worker, request

pytestmark = pytest.mark.usefixtures("keep_signal_handlers")


class Killed(BaseException):
    """The worker process is gone: nothing more is recorded, its leases are left to run out."""


def run_until_killed(connection, at_step: int = 2, engine=None, **kwargs):
    def die(worker, outputs):
        if worker.engine.step_index == at_step:
            raise Killed

    with pytest.raises(Killed):
        make_worker(connection, engine, on_step=die, **kwargs).work()


def test_a_plain_rq_job_without_retry_is_recovered_after_its_worker_dies(fake_redis):
    queue = Queue(Q, connection=fake_redis, serializer=JSONSerializer)
    ids = [queue.enqueue(JOB_FUNCTION, request(max_tokens=6)).id for _ in range(3)]
    assert all(fetch(fake_redis, j).retries_left is None for j in ids)
    run_until_killed(fake_redis)
    expire_leases(fake_redis)
    make_worker(fake_redis).work(burst=True)
    for job_id in ids:
        job = fetch(fake_redis, job_id)
        assert job.get_status() == JobStatus.FINISHED
        assert [r.type for r in job.results()] == [Result.Type.SUCCESSFUL]
        assert continued_text(events(fake_redis, job_id)) == expected_text(6) == job.return_value()["text"]
    assert FailedJobRegistry(Q, connection=fake_redis).count == 0


def test_a_job_whose_workers_keep_dying_fails_as_a_poison_job(fake_redis):
    client = Client(fake_redis, queue=Q)
    poison = client.submit(request(max_tokens=50))
    for _ in range(MAX_ATTEMPTS):
        run_until_killed(fake_redis)
        expire_leases(fake_redis)
    engine = FakeEngine()
    make_worker(fake_redis, engine).work(burst=True)
    assert engine.added == []  # recovered as failed, not started again
    with pytest.raises(JobFailed, match=f"started {MAX_ATTEMPTS} times") as info:
        client.result(poison, timeout=10)
    assert "lost" in info.value.reason and info.value.status == "failed"
    assert events(fake_redis, poison)[-1].type == "error"
    assert not fake_redis.keys("batcher:lease*") and not fake_redis.exists(keys.attempts_key(poison))


def test_a_cancel_while_the_worker_is_dead_wins(fake_redis):
    client = Client(fake_redis, queue=Q)
    victim, other = client.submit_many([request(max_tokens=50), request(max_tokens=50)])
    run_until_killed(fake_redis)
    assert client.cancel(victim)  # the stop-job command reaches nobody: the recorded cancel decides
    expire_leases(fake_redis)
    engine = FakeEngine()
    make_worker(fake_redis, engine).work(burst=True)
    assert len(engine.added) == 1  # only `other` runs again
    assert fetch(fake_redis, victim).get_status() == JobStatus.STOPPED
    with pytest.raises(JobFailed, match="stopped"):
        client.result(victim, timeout=10)
    assert (events(fake_redis, victim)[-1].type, events(fake_redis, victim)[-1].finish_reason) == ("done", "cancelled")
    assert [e.type for e in client.stream(victim, timeout=10)][-1] == "done"
    assert client.result(other, timeout=10).text == expected_text(50)
    assert not fake_redis.exists(keys.cancel_key(victim))


def test_a_cancel_while_queued_for_a_rerun_wins_and_ends_the_stream(fake_redis):
    client = Client(fake_redis, queue=Q)
    job_id = client.submit(request(max_tokens=50))
    run_until_killed(fake_redis)
    expire_leases(fake_redis)
    make_worker(fake_redis).keeper.recover_expired()  # requeued at the front, not taken yet
    assert fetch(fake_redis, job_id).get_status() == JobStatus.QUEUED
    assert client.cancel(job_id)
    engine = FakeEngine()
    make_worker(fake_redis, engine).work(burst=True)
    assert engine.added == [] and fetch(fake_redis, job_id).get_status() == JobStatus.CANCELED
    last = events(fake_redis, job_id)[-1]
    assert (last.type, last.finish_reason) == ("done", "cancelled")
    assert not client.cancel(job_id)


def test_a_job_cancelled_between_its_dequeue_and_its_start_never_runs(fake_redis):
    client = Client(fake_redis, queue=Q)
    job_id = client.submit(request(max_tokens=5))
    fake_redis.set(keys.cancel_key(job_id), 1)  # what cancel records when the job is in no queue list
    engine = FakeEngine()
    make_worker(fake_redis, engine).work(burst=True)
    assert engine.added == [] and fetch(fake_redis, job_id).get_status() == JobStatus.STOPPED
    assert [e.type for e in events(fake_redis, job_id)] == ["start", "done"]


def test_the_keeper_applies_a_cancel_whose_stop_command_was_missed(fake_redis):
    client = Client(fake_redis, queue=Q)
    job_id = client.submit(request(max_tokens=10_000))

    def cancel_quietly(worker, outputs):
        if worker.engine.step_index == 1:
            fake_redis.set(keys.cancel_key(job_id), 1)  # no stop-job command is published

    make_worker(fake_redis, lease_s=1, on_step=cancel_quietly).work(burst=True)
    assert fetch(fake_redis, job_id).get_status() == JobStatus.STOPPED
    assert events(fake_redis, job_id)[-1].finish_reason == "cancelled"


def test_rq_cleanup_run_by_rq_info_never_retries_or_fails_a_batcher_job(fake_redis):
    queue = Queue(Q, connection=fake_redis, serializer=JSONSerializer)
    ids = [queue.enqueue(JOB_FUNCTION, request(max_tokens=6)).id for _ in range(3)]
    run_until_killed(fake_redis)
    expire_leases(fake_redis)
    for _ in range(2):  # what a plain `rq info` and another RQ worker's maintenance run, racing the recovery
        StartedJobRegistry(Q, connection=fake_redis, serializer=JSONSerializer).cleanup()
        clean_registries(queue)
    assert queue.count == 0 and FailedJobRegistry(Q, connection=fake_redis).count == 0
    engine = FakeEngine()
    make_worker(fake_redis, engine).work(burst=True)
    assert len(engine.added) == 3  # each started once more, not twice
    assert all([r.type for r in fetch(fake_redis, j).results()] == [Result.Type.SUCCESSFUL] for j in ids)


def test_a_duplicate_queue_entry_of_a_running_job_is_dropped(fake_redis):
    client = Client(fake_redis, queue=Q)
    job_id = client.submit(request(max_tokens=8))

    def duplicate(worker, outputs):
        if worker.engine.step_index == 1:
            Queue(Q, connection=fake_redis).push_job_id(job_id)  # e.g. an enqueue whose reply was lost, sent again

    engine = FakeEngine()
    make_worker(fake_redis, engine, on_step=duplicate).work(burst=True)
    assert len(engine.added) == 1 and Queue(Q, connection=fake_redis).count == 0
    assert [r.type for r in fetch(fake_redis, job_id).results()] == [Result.Type.SUCCESSFUL]


def test_a_flush_whose_reply_was_lost_is_sent_again_without_writing_anything_twice(fake_redis):
    client = Client(fake_redis, queue=Q)
    ids = client.submit_many([request(max_tokens=12) for _ in range(3)])
    worker = make_worker(fake_redis, FakeEngine(max_num_seqs=2))  # the third job starts once one has ended
    write, cuts = worker.streams._write, []

    def applied_then_cut(*args, **kwargs):  # Redis ran the script; the connection died before its reply
        result = write(*args, **kwargs)
        if kwargs.get("client") is fake_redis and len(cuts) < 3:
            cuts.append(worker.engine.step_index)
            raise RedisConnectionError("connection cut mid-pipeline")
        return result

    worker.streams._write = applied_then_cut
    worker.work(burst=True)
    assert cuts
    for job_id in ids:
        stream = events(fake_redis, job_id)
        tokens = [e for e in stream if e.type == "token"]
        assert [e.index for e in tokens] == [sum(len(t.token_ids) for t in tokens[:i]) for i in range(len(tokens))]
        assert continued_text(stream) == expected_text(12) == client.result(job_id, 10).text
        assert [e.type for e in stream].count("done") == 1


def test_an_execution_that_lost_its_lease_writes_no_more_events(fake_redis):
    client = Client(fake_redis, queue=Q)
    taken = client.submit(request(max_tokens=20))
    seen = {}

    def take_over(worker, outputs):
        if worker.engine.step_index == 2:
            worker.streams.flush(force=True)
            fake_redis.set(keys.lease_key(taken), "another-execution")
            seen["events"] = len(events(fake_redis, taken))

    make_worker(fake_redis, on_step=take_over).work(burst=True)
    assert len(events(fake_redis, taken)) == seen["events"]
    assert fetch(fake_redis, taken).latest_result() is None


@pytest.mark.parametrize("payload, field", [
    ({"prompt_token_ids": ["x"] * 5000}, "prompt_token_ids.0"),
    ({"messages": [{"role": "robot", "text": "hi"}] * 1000}, "messages.0"),
])
def test_a_request_with_thousands_of_errors_fails_with_a_bounded_reason(fake_redis, payload, field):
    job_id = Queue(Q, connection=fake_redis, serializer=JSONSerializer).enqueue(JOB_FUNCTION, payload).id
    make_worker(fake_redis).work(burst=True)
    with pytest.raises(JobFailed) as info:
        Client(fake_redis, queue=Q).result(job_id, timeout=10)
    reason = info.value.reason
    assert len(reason) <= MAX_REASON_CHARS and field in reason and "problems in all" in reason
    assert len(events(fake_redis, job_id)[-1].error) <= MAX_REASON_CHARS


def test_a_worker_that_takes_back_a_job_it_still_ran_keeps_the_two_executions_apart(fake_redis):
    client = Client(fake_redis, queue=Q)
    job_id = client.submit(request(max_tokens=30))

    def lease_runs_out(worker, outputs):  # e.g. a Redis frozen longer than the lease: its keeper could not renew
        if worker.engine.step_index == 3:
            worker.streams.flush(force=True)
            expire_leases(fake_redis)
            worker.keeper.recover_expired()  # requeued at the front; this same worker takes it back
            time.sleep(2 * BUSY_RESCAN_S)  # before the old execution ends: the next iteration looks at the queues

    engine = FakeEngine()
    make_worker(fake_redis, engine, on_step=lease_runs_out).work(burst=True)
    assert len(engine.added) == 2
    stream = events(fake_redis, job_id)
    assert continued_text(stream) == expected_text(30) == client.result(job_id, 10).text
    new = fetch(fake_redis, job_id).latest_result().execution_id
    tail = stream[next(i for i, e in enumerate(stream) if e.type == "start" and e.execution_id == new):]
    assert {e.execution_id for e in tail} == {new}  # the old execution, still running here, wrote nothing more
    assert engine.resumed[new] == 3
    assert [r.type for r in fetch(fake_redis, job_id).results()] == [Result.Type.SUCCESSFUL]


def test_a_recoverer_that_comes_late_finds_nothing_to_recover(fake_redis):
    """Two workers saw the same expired lease; the first recovered the job, which then ran to its end and released
    its lease. The second, slow, must not requeue the finished job."""
    client = Client(fake_redis, queue=Q)
    job_id = client.submit(request(max_tokens=5))
    run_until_killed(fake_redis)
    (index,) = fake_redis.keys("batcher:leases:*")
    (member,) = fake_redis.zrange(index, 0, -1)
    expire_leases(fake_redis)
    make_worker(fake_redis).work(burst=True)  # recovers the job and runs it to its end
    late = make_worker(fake_redis)
    dead_job, dead_execution = member.decode().split(":")
    assert not late.keeper._recover(Queue(Q, connection=fake_redis, serializer=JSONSerializer), dead_job,
                                    dead_execution)
    assert Queue(Q, connection=fake_redis).count == 0
    assert [r.type for r in fetch(fake_redis, job_id).results()] == [Result.Type.SUCCESSFUL]


def test_a_job_taken_by_a_worker_that_died_before_starting_it_is_requeued(fake_redis, monkeypatch):
    client = Client(fake_redis, queue=Q)
    job_id = client.submit(request(max_tokens=4))
    queue = Queue(Q, connection=fake_redis, serializer=JSONSerializer)
    fake_redis.lmove(queue.key, queue.intermediate_queue_key)  # taken (LMOVE), then the worker was killed
    worker = make_worker(fake_redis)
    assert worker.keeper.recover_expired() == 0  # first seen: it may still be starting
    monkeypatch.setattr("rqbatcher.workers.job_worker.leases.STRANDED_GRACE_LEASES", 0)
    assert worker.keeper.recover_expired() == 1
    assert queue.job_ids == [job_id] and fake_redis.llen(queue.intermediate_queue_key) == 0
    worker.work(burst=True)
    assert client.result(job_id, timeout=10).text == expected_text(4)
