"""End to end: batches, the completion feed and model routing with real `batcher worker` processes
on tiny models and the real Redis.

One worker serving model `tiny-a` on queue `bq` runs all the tests; the crash test adds a second one
and SIGKILLs it, the routing test adds one serving `tiny-b` (another model family)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import pytest
from click.testing import CliRunner
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from rqbatcher.cli import main
from rqbatcher.client import Client
from rqbatcher.jobs import keys
from tests.e2e.test_workers import start_worker, stop, wait_ready
from tests.jobs_support import wait_for

pytestmark = pytest.mark.timeout(300)
QUEUE = "bq"
MODEL = "tiny-a"
LONG = 450  # tokens: a job that runs for hundreds of steps (the tiny models have 512 positions)


def request_line(i: int, tokens: int, model: str = MODEL, **body) -> str:
    body = {"model": model, "prompt": f"request number {i}", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, **body}
    return json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": body})


def snapshot(connection, batch_id: str) -> tuple[int, int, int, str]:
    """(completed, failed, outcomes stored, status), read in one transaction."""
    with connection.pipeline() as pipe:
        pipe.hmget(keys.batch_key(batch_id), "completed", "failed", "status")
        pipe.hlen(keys.batch_lines_key(batch_id))
        (completed, failed, status), stored = pipe.execute()
    return int(completed), int(failed), stored, status.decode()


def files(client: Client, batch_id: str) -> tuple[list[dict], list[dict]]:
    return ([json.loads(x) for x in client.batch_output(batch_id)],
            [json.loads(x) for x in client.batch_output(batch_id, errors=True)])


def batch_jobs_running(connection, batch_id: str, total: int) -> list[str]:
    jobs = Job.fetch_many([keys.batch_job_id(batch_id, i) for i in range(total)], connection,
                          serializer=JSONSerializer)
    return [job.id for job in jobs if job is not None and job.get_status() == JobStatus.STARTED]


@pytest.fixture(scope="module")
def serving(e2e_redis, tiny_model_dir, tmp_path_factory):
    """One worker serving `tiny-a` on `bq`: (url, connection, worker name)."""
    url, connection = e2e_redis
    name, process = start_worker(url, tiny_model_dir("llama"), QUEUE, tmp_path_factory.mktemp("w") / "a.log", 8,
                                 "--served-model-name", MODEL)
    try:
        wait_ready(connection, name, process)
        yield url, connection, name
    finally:
        stop(process)


def test_fifty_jobs_with_five_bad_lines_count_exactly_and_two_consumers_share_the_feed(serving, tmp_path):
    url, connection, _ = serving
    client = Client(connection, queue=QUEUE)
    bad = {3: {"max_tokens": -1}, 11: {"logprobs": 6}, 20: {"temperature": "hot"}, 37: {"prompt": None},
           49: {"model": ""}}
    lines = [request_line(i, 4 + i % 9, **bad.get(i, {})) for i in range(50)]
    batch = client.create_batch(lines, metadata={"test": "fifty"})
    assert batch.request_counts.total == 50 and batch.request_counts.failed == 5

    handled: list[tuple[str, str]] = []

    def consume(name: str) -> None:
        for completion in client.completions("backend", name, batch_id=batch.id, timeout=5):
            handled.append((name, completion.custom_id))

    consumers = [threading.Thread(target=consume, args=(name,)) for name in ("one", "two")]
    for thread in consumers:
        thread.start()
    seen = []
    while True:
        completed, failed, stored, status = snapshot(connection, batch.id)
        assert completed + failed == stored and completed <= 45 and failed == 5, (completed, failed, stored)
        seen.append(completed)
        if status != "in_progress":
            break
        time.sleep(0.05)
    assert status == "completed" and seen == sorted(seen) and len(set(seen)) > 2  # watched while it ran
    ended = client.batch(batch.id)
    assert ended.request_counts.model_dump() == {"total": 50, "completed": 45, "failed": 5}
    assert ended.output_file_id and ended.error_file_id and ended.completed_at >= ended.in_progress_at

    out, errors = files(client, batch.id)
    assert [o["custom_id"] for o in out] == [f"c{i}" for i in range(50) if i not in bad]
    assert [e["custom_id"] for e in errors] == [f"c{i}" for i in sorted(bad)]
    assert all(o["response"]["body"]["usage"]["completion_tokens"] == 4 + int(o["custom_id"][1:]) % 9 for o in out)
    assert sorted(c["custom_id"] for c in out + errors) == sorted(f"c{i}" for i in range(50))

    for thread in consumers:
        thread.join(60)
    assert sorted(custom_id for _, custom_id in handled) == sorted(f"c{i}" for i in range(50))
    assert {name for name, _ in handled} == {"one", "two"}

    # A consumer killed before its acknowledgement: its entry goes to another consumer of the group.
    dying = subprocess.run(
        [sys.executable, "-c", "import os, signal, sys; from rqbatcher.client import Client; "
         f"c = next(Client({url!r}, queue={QUEUE!r}).completions('late', 'dying', batch_id={batch.id!r})); "
         "print(c.custom_id, flush=True); os.kill(os.getpid(), signal.SIGKILL)"],
        capture_output=True, text=True, timeout=60)
    assert dying.returncode == -signal.SIGKILL
    lost = dying.stdout.strip()
    time.sleep(1.2)
    survivor = [c.custom_id for c in client.completions("late", "survivor", batch_id=batch.id, claim_idle_s=1,
                                                        timeout=1)]
    assert lost in survivor and sorted(survivor) == sorted(f"c{i}" for i in range(50))


def test_cancelling_mid_run_keeps_partial_output_and_stops_every_job(serving):
    url, connection, worker = serving
    client = Client(connection, queue=QUEUE)
    lines = [request_line(i, 4 if i < 3 else LONG) for i in range(24)]
    batch = client.create_batch(lines)
    wait_for(lambda: snapshot(connection, batch.id)[0] >= 3 and batch_jobs_running(connection, batch.id, 24), 60,
             "three short jobs done and long ones running")
    cancelled = client.cancel_batch(batch.id)
    assert cancelled.status == "cancelled"
    wait_for(lambda: not batch_jobs_running(connection, batch.id, 24), 10, "no job of the batch running")
    counts = client.batch(batch.id).request_counts
    assert counts.total == 24 and counts.completed >= 3 and counts.completed + counts.failed == 24
    out, errors = files(client, batch.id)
    assert len(out) == counts.completed and {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert sorted(c["custom_id"] for c in out + errors) == sorted(f"c{i}" for i in range(24))
    statuses = {job.get_status() for job in Job.fetch_many([keys.batch_job_id(batch.id, i) for i in range(24)],
                                                           connection, serializer=JSONSerializer)}
    assert JobStatus.CANCELED in statuses and JobStatus.STOPPED in statuses
    assert statuses <= {JobStatus.FINISHED, JobStatus.CANCELED, JobStatus.STOPPED}


def test_a_batch_whose_window_passes_ends_expired(serving):
    url, connection, _ = serving
    client = Client(connection, queue=QUEUE)
    # Far more work than the window holds on any machine: 64 lines of 450 tokens on 8 slots ran in about 3 s on an
    # idle fast CPU, so the batch could complete before its window did. The window still ends the test's wait.
    lines = 256
    batch = client.create_batch([request_line(i, LONG) for i in range(lines)], completion_window="3s")
    time.sleep(max(0.0, batch.expires_at + 1 - time.time()))
    expired = client.batch(batch.id)  # the first reader past the window expires it
    assert expired.status == "expired" and expired.expired_at
    counts = expired.request_counts
    assert counts.total == lines and counts.completed + counts.failed == lines and counts.failed > 0
    wait_for(lambda: not batch_jobs_running(connection, batch.id, lines), 30, "no job of the batch running")
    out, errors = files(client, batch.id)
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert sorted(c["custom_id"] for c in out + errors) == sorted(f"c{i}" for i in range(lines))
    assert client.batch(batch.id).request_counts == counts  # the stopped jobs' late ends counted nothing


def test_a_worker_sigkilled_mid_batch_changes_no_count_twice(serving, tiny_model_dir, tmp_path):
    url, connection, _ = serving
    client = Client(connection, queue=QUEUE)
    name, process = start_worker(url, tiny_model_dir("llama"), QUEUE, tmp_path / "killed.log", 4,
                                 "--served-model-name", MODEL)
    try:
        wait_ready(connection, name, process)
        batch = client.create_batch([request_line(i, LONG) for i in range(16)])
        job_ids = [keys.batch_job_id(batch.id, i) for i in range(16)]

        def streaming_on_killed() -> list[str]:
            jobs = Job.fetch_many(job_ids, connection, serializer=JSONSerializer)
            return [j.id for j in jobs if j.worker_name == name and j.get_status() == JobStatus.STARTED
                    and connection.xlen(keys.stream_key(j.id)) > 1]

        killed = wait_for(streaming_on_killed, 60, "tokens from the doomed worker's jobs")
        process.send_signal(signal.SIGKILL)
        process.wait()
        wait_for(lambda: client.batch(batch.id).ended, 120, "the batch to end on the surviving worker")
    finally:
        stop(process)
    ended = client.batch(batch.id)
    assert ended.status == "completed"
    assert ended.request_counts.model_dump() == {"total": 16, "completed": 16, "failed": 0}
    assert connection.hlen(keys.batch_lines_key(batch.id)) == 16
    assert connection.xlen(keys.batch_feed_key(batch.id)) == 16  # one feed entry per job, retried or not
    out, _ = files(client, batch.id)
    assert [o["custom_id"] for o in out] == [f"c{i}" for i in range(16)]
    usages = [o["response"]["body"]["usage"] for o in out]  # the batch's usage: each line's once, retried or not
    assert ended.usage.output_tokens == 16 * LONG == sum(u["completion_tokens"] for u in usages)
    assert ended.usage.input_tokens == sum(u["prompt_tokens"] for u in usages)
    for job_id in killed:  # run twice, recorded once
        assert len(Job.fetch(job_id, connection, JSONSerializer).results()) == 1


def test_jobs_run_only_on_a_worker_serving_their_model_and_an_unserved_model_waits(serving, tiny_model_dir,
                                                                                   tmp_path):
    url, connection, worker_a = serving
    client = Client(connection, queue=QUEUE)
    worker_b, process = start_worker(url, tiny_model_dir("qwen2"), QUEUE, tmp_path / "b.log", 4,
                                     "--served-model-name", "tiny-b")
    try:
        wait_ready(connection, worker_b, process)
        wait_for(lambda: {MODEL, "tiny-b"} <= set(client.models()), 30, "both models announced")
        jobs = {model: client.submit_many([{"prompt": f"to {model} {i}", "model": model,
                                            "sampling": {"max_tokens": 3}} for i in range(3)])
                for model in (MODEL, "tiny-b")}
        waiting = client.submit({"prompt": "nobody serves me", "model": "tiny-c"})
        for model, runs_on in ((MODEL, worker_a), ("tiny-b", worker_b)):
            for job_id in jobs[model]:
                result = client.result(job_id, timeout=60)
                assert (result.worker, result.model) == (runs_on, model)
        assert client.status(waiting).status == "queued"
        overview = json.loads(CliRunner().invoke(main, ["queues", "--redis-url", url, "--queue", QUEUE,
                                                        "--json"]).output)["queues"]
        row = next(r for r in overview if r["model"] == "tiny-c")
        assert (row["queued"], row["served"]) == (1, False)
        assert all(r["served"] for r in overview if r["model"] != "tiny-c")
        table = CliRunner().invoke(main, ["queues", "--redis-url", url, "--queue", QUEUE]).output
        assert "unserved: 1 job(s)" in table and "tiny-c" in table
        workers = CliRunner().invoke(main, ["workers", "--redis-url", url]).output
        assert "tiny-b" in workers and MODEL in workers
    finally:
        stop(process)
    client.cancel(waiting)
