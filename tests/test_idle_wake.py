"""An idle worker wakes for work on any of its queues, not only its first (workers/job_worker/admission.py), on the
real Redis: the wait takes nothing, and a plain RQ producer's job on a later queue is admitted from inside the wait."""

from __future__ import annotations

import threading
import time

import pytest

from rqbatcher.jobs import keys, rq_adapter
from rqbatcher.jobs.contract import JOB_FUNCTION
from rqbatcher.jobs.queues import class_queue
from rqbatcher.jobs.rq_adapter import rq_queue
from rqbatcher.service_class import BATCH
from rqbatcher.workers.job_worker import admission
from rqbatcher.workers.job_worker.worker import JobWorker
from tests.fake_engine import FakeEngine
from tests.jobs_support import claim_database, release_database

BASE = "wake"
LONG_WAIT_S = 30  # far longer than any test here waits: a wait that returns True was woken, not timed out
POLL_S = 0.05


def idle_worker(redis) -> JobWorker:
    return JobWorker(keys.priority_queue_names([BASE]), FakeEngine(), connection=redis)


class SleepSpy:
    """rq_adapter's `time`, telling when the wait first sleeps: it has looked at the queues once and found nothing."""

    monotonic = staticmethod(time.monotonic)

    def __init__(self) -> None:
        self.slept = threading.Event()

    def sleep(self, seconds: float) -> None:
        self.slept.set()
        time.sleep(seconds)


@pytest.fixture
def sleep_spy(monkeypatch) -> SleepSpy:
    spy = SleepSpy()
    monkeypatch.setattr(rq_adapter, "time", spy)
    return spy


def wait_in_thread(spy: SleepSpy, wait) -> tuple[threading.Thread, list]:
    """Run `wait` on a thread and return once it is waiting (it found nothing and sleeps until its next look)."""
    woke: list = []
    spy.slept.clear()
    thread = threading.Thread(target=lambda: woke.append(wait()))
    thread.start()
    assert spy.slept.wait(10), "the worker never waited"
    return thread, woke


def test_the_wait_returns_when_a_job_appears_on_a_later_queue_and_takes_nothing(sleep_spy):
    url, redis = claim_database()
    try:
        worker = idle_worker(redis)
        second = worker.queues[1]
        assert worker.wait_for_work(worker.queues, POLL_S, POLL_S) is False  # nothing queued: it times out
        thread, woke = wait_in_thread(sleep_spy, lambda: worker.wait_for_work(worker.queues, LONG_WAIT_S, POLL_S))
        redis.rpush(second.key, "j1")
        thread.join(LONG_WAIT_S)
        assert woke == [True]
        assert redis.lrange(second.key, 0, -1) == [b"j1"]
    finally:
        release_database(redis)


def test_a_class_queue_registered_while_idle_wakes_the_worker(sleep_spy):
    """A tenant's first batch line opens a queue the worker does not know yet: the registry's change wakes it."""
    url, redis = claim_database()
    try:
        worker = idle_worker(redis)
        registry = keys.class_queues_key(BASE)
        thread, woke = wait_in_thread(
            sleep_spy, lambda: worker.wait_for_work(worker.queues, LONG_WAIT_S, POLL_S, {registry: 0}))
        redis.sadd(registry, class_queue(BASE, BATCH, 0, "acme"))
        thread.join(LONG_WAIT_S)
        assert woke == [True]
    finally:
        release_database(redis)


def test_an_idle_worker_admits_a_plain_rq_job_on_its_second_queue_from_inside_its_wait(monkeypatch, sleep_spy):
    """With the idle wait stretched far past the test's patience, the job can only be admitted by the wait waking:
    the old wait blocked on the first queue alone for the whole of it."""
    monkeypatch.setattr(admission, "IDLE_WAIT_S", LONG_WAIT_S)
    url, redis = claim_database()
    try:
        worker = idle_worker(redis)
        second = worker.queues[1]
        thread, admitted = wait_in_thread(sleep_spy, lambda: worker.admission.admit(block=True))
        job = rq_queue(second.name, redis).enqueue(JOB_FUNCTION, {"prompt": "hi", "max_new_tokens": 2})
        thread.join(LONG_WAIT_S / 2)
        assert not thread.is_alive(), "the idle wait did not wake for the second queue"
        assert [f.job.id for f in admitted[0]] == [job.id]
        assert redis.llen(second.key) == 0
    finally:
        release_database(redis)
