"""Operator commands against the real Redis and a real `batcher worker` process, and a real HTTP
scrape of its /metrics while jobs run. The drain test runs last: it stops the worker."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest
from click.testing import CliRunner
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from rqbatcher.cli import main
from rqbatcher.client import Client
from rqbatcher.schema import GenerationRequest, SamplingParams
from tests.e2e.test_workers import WORKER_READY_S
from tests.jobs_support import wait_for

pytestmark = pytest.mark.timeout(300)
QUEUE = "ops"
HELD_FOR_S = 2.5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(url: str, *args: str):
    result = CliRunner().invoke(main, [args[0], "--redis-url", url, *args[1:]])
    return result


def greedy(max_tokens: int, **request) -> GenerationRequest:
    return GenerationRequest(sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True), **request)


def scrape(port: int) -> dict[str, float]:
    """Every sample of /metrics, keyed by its name with labels."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples


def sample(samples: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in samples.items() if k.startswith(prefix))


@pytest.fixture(scope="module")
def worker(e2e_redis, tiny_model_dir, tmp_path_factory):
    """One worker process on queue `ops`, with metrics: (url, connection, name, port, process)."""
    url, connection = e2e_redis
    name, port = f"ops-{uuid.uuid4().hex[:8]}", free_port()
    log = tmp_path_factory.mktemp("ops") / "worker.log"
    command = [sys.executable, "-m", "rqbatcher", "worker", "--redis-url", url, "--queue", QUEUE,
               "--model", str(tiny_model_dir("llama")), "--device", "cpu", "--num-blocks", "512",
               "--max-num-seqs", "8", "--lease", "3", "--name", name, "--metrics-port", str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=log.open("w"))
    try:
        wait_for(lambda: process.poll() is None and any(
            w["name"] == name for w in json.loads(cli(url, "workers", "--json").output)), WORKER_READY_S,
            "the worker to publish its stats")
        yield url, connection, name, port, process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_workers_table_lists_the_live_worker(worker):
    url, _, name, _, _ = worker
    rows = json.loads(cli(url, "workers", "--json").output)
    me = next(r for r in rows if r["name"] == name)
    assert me["queues"] == QUEUE and me["state"] == "idle" and me["in_flight"] == 0 and me["free_slots"] == 8
    assert me["dtype"] in ("float32", "bfloat16")  # the worker runs with --dtype auto: shown resolved
    table = cli(url, "workers").output
    assert name in table and "FREE_SLOTS" in table and "TOKENS_PER_S" in table and me["dtype"] in table
    assert "PREFIX_HITS" in table and me["prefix_cache_hit_rate"] == 0.0
    assert me["step_time_target_s"] == 0.0 and me["step_s"] == 0.0, "no step run yet: no target has bound one"
    assert "STEP_TARGET" in table and "PROMPT_URGENT/BATCH" in table and "AWAITED" in table


def test_metrics_scraped_over_http_move_while_jobs_run(worker):
    url, connection, name, port, _ = worker
    before = scrape(port)
    client = Client(connection, queue=QUEUE)
    ids = client.submit_many([greedy(300, prompt_token_ids=[20 + i, 30, 40]) for i in range(6)])
    seen_running = wait_for(lambda: sample(scrape(port), "batcher_num_requests_running") > 0, 60,
                            "a scrape with requests running")
    assert seen_running
    for job_id in ids:
        client.result(job_id, timeout=120)
    # The worker counts a step's tokens just after recording its results: wait for the last step's.
    def counted_all():
        now = scrape(port)
        generated = sample(now, "batcher_generation_tokens_total") - sample(before, "batcher_generation_tokens_total")
        return now if generated >= 6 * 300 else None

    after = wait_for(counted_all, 30, "the last step's tokens in /metrics")
    assert sample(after, "batcher_generation_tokens_total") - sample(before, "batcher_generation_tokens_total") \
        >= 6 * 300
    assert sample(after, 'batcher_request_success_total{finished_reason="length"') \
        - sample(before, 'batcher_request_success_total{finished_reason="length"') == 6
    assert sample(after, "batcher_time_to_first_token_seconds_count") > sample(
        before, "batcher_time_to_first_token_seconds_count")
    assert sample(after, "batcher_step_duration_seconds_count") > sample(before, "batcher_step_duration_seconds_count")
    measured = wait_for(lambda: next(r["step_s"] for r in json.loads(cli(url, "workers", "--json").output)
                                     if r["name"] == name) or None, 30, "the measured step time in `batcher workers`")
    assert 0 < measured < 60


def test_suspend_holds_new_jobs_and_resume_releases_them(worker):
    url, connection, name, _, _ = worker
    assert "suspended" in cli(url, "suspend").output
    try:
        wait_for(lambda: any(w["name"] == name and w["state"] == "suspended"
                             for w in json.loads(cli(url, "workers", "--json").output)), 30,
                 "the worker to report itself suspended")
        client = Client(connection, queue=QUEUE)
        job_id = client.submit(greedy(5, prompt="held"))
        time.sleep(HELD_FOR_S)  # asserting that nothing happens needs a wait: a suspended worker polls each second
        overview = json.loads(cli(url, "queues", "--queue", QUEUE, "--json").output)
        assert overview["suspended"] is True
        assert next(q for q in overview["queues"] if q["queue"] == QUEUE)["queued"] == 1
        assert client.status(job_id).status == "queued"
    finally:
        assert "resumed" in cli(url, "resume").output
    assert client.result(job_id, timeout=60).finish_reason == "length"


def test_requeue_failed_puts_failed_jobs_back(worker):
    url, connection, _, _, _ = worker
    client = Client(connection, queue=QUEUE)
    job_id = client.submit(greedy(4, prompt_token_ids=[5] * 600))  # longer than the tiny model's context
    wait_for(lambda: client.status(job_id).status == "failed", 60, "the over-long job to fail")
    failed = lambda: next(q for q in json.loads(cli(url, "queues", "--json").output)["queues"]  # noqa: E731
                          if q["queue"] == QUEUE)["failed"]
    assert failed() == 1
    result = cli(url, "requeue", "--failed", "--queue", QUEUE)
    assert result.exit_code == 0 and "requeued 1 job(s)" in result.output
    job = Job.fetch(job_id, connection=connection, serializer=JSONSerializer)
    wait_for(lambda: len(job.results()) == 2, 60, "the requeued job to run (and fail) again")
    assert failed() == 1 and "max_model_len" in client.status(job_id).error


def test_drain_wait_returns_only_after_the_jobs_in_flight_finished(worker):
    url, connection, name, _, process = worker
    client = Client(connection, queue=QUEUE)
    # Five times the slots of jobs that each run to the tiny model's context: seconds of work in flight.
    ids = client.submit_many([greedy(500, prompt_token_ids=[50 + i, 60, 70]) for i in range(40)])
    wait_for(lambda: any(w["name"] == name and w["in_flight"] > 0
                         for w in json.loads(cli(url, "workers", "--json").output)), 60, "jobs in flight")
    timed_out = cli(url, "drain", name, "--wait", "--timeout", "0")
    assert timed_out.exit_code == 1 and "timed out" in timed_out.output
    drained = wait_for(lambda: process.poll() is not None, 120, "the worker to drain and exit")
    assert drained and process.returncode == 0
    statuses = [Job.fetch(j, connection=connection, serializer=JSONSerializer).get_status() for j in ids]
    started = [s for s in statuses if s != JobStatus.QUEUED]
    assert started and all(s == JobStatus.FINISHED for s in started), statuses
    assert json.loads(cli(url, "workers", "--json").output) == []
    later = cli(url, "drain", "--all", "--wait", "--timeout", "5")
    assert later.exit_code == 0
