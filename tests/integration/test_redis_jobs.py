"""Jobs on the real Redis with the real engine (a tiny Llama), the worker running in this process:
RQ's own tools on our jobs, slot refills from the step log, cancel, and bad input."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
from redis import Redis
from rq import Queue
from rq.job import Job, JobStatus
from rq.results import Result
from rq.serializers import JSONSerializer

from rqbatcher.client import Client, JobFailed
from rqbatcher.config import EngineConfig
from rqbatcher.jobs import keys
from rqbatcher.jobs.life import PICKLED_JOB_REASON
from rqbatcher.schema import GenerationRequest, SamplingParams
from rqbatcher.workers.engine.api import RequestError
from rqbatcher.workers.engine.engine import build_engine
from rqbatcher.workers.job_worker.worker import JobWorker
from tests.jobs_support import keep_signal_handlers_fixture  # noqa: F401

pytestmark = [pytest.mark.usefixtures("keep_signal_handlers"), pytest.mark.timeout(300)]
Q = "it"
RQ = str(Path(sys.executable).parent / "rq")


def tiny_engine(model_dir, max_num_seqs=4):
    return build_engine(EngineConfig(model=str(model_dir), max_num_seqs=max_num_seqs, num_blocks=256, device="cpu",
                                     dtype="float32"))


def greedy(max_tokens: int, **request) -> GenerationRequest:
    return GenerationRequest(sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True), **request)


def make_worker(url: str, engine) -> JobWorker:
    return JobWorker(keys.priority_queue_names([Q]), engine, connection=Redis.from_url(url))


@contextmanager
def running(worker: JobWorker):
    thread = threading.Thread(target=worker.work, daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        worker.request_stop(None, None)
        thread.join(60)
        assert not thread.is_alive()


def rq_info(url: str, *args: str) -> str:
    return subprocess.run([RQ, "info", "-u", url, "--serializer", "json", "-r", *args], check=True,
                          capture_output=True, text=True).stdout


def queue_counts(url: str) -> tuple[int, int, int, int]:
    """`rq info`'s line for our queue: (queued, executing, finished, failed)."""
    line = re.search(rf"^queue {Q} (\d+), (\d+) executing, (\d+) finished, (\d+) failed$", rq_info(url, "-Q"), re.M)
    return tuple(int(n) for n in line.groups())


class FlakyEngine:
    """The real engine, except that it refuses requests marked flaky while `failing` is set."""

    def __init__(self, engine) -> None:
        self.engine, self.failing = engine, True

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def add(self, request_id, request, arrival_time=None, progress=None):
        if self.failing and request.metadata.get("flaky"):
            raise RequestError("a transient failure")
        return self.engine.add(request_id, request, arrival_time, progress)


def test_rq_info_status_results_and_requeue_work_on_our_jobs(redis_url, tiny_model_dir):
    connection = Redis.from_url(redis_url)
    client = Client(connection, queue=Q)
    ok = client.submit_many([greedy(3, prompt="The quick brown fox"), greedy(4, prompt="Redis streams")])
    flaky = client.submit(greedy(3, prompt="Summarise this", metadata={"flaky": True}))
    assert queue_counts(redis_url) == (3, 0, 0, 0)

    engine = FlakyEngine(tiny_engine(tiny_model_dir("llama")))
    make_worker(redis_url, engine).work(burst=True)
    subprocess.run([RQ, "info", "-u", redis_url], check=True, capture_output=True)  # pickle: must not hurt our jobs
    assert queue_counts(redis_url) == (0, 0, 2, 1)
    for job_id in ok:
        job = Job.fetch(job_id, connection=connection, serializer=JSONSerializer)
        assert job.get_status() == JobStatus.FINISHED
        assert job.latest_result().type == Result.Type.SUCCESSFUL
        assert job.return_value() == client.result(job_id, timeout=30).model_dump(mode="json")
    job = Job.fetch(flaky, connection=connection, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.FAILED
    assert job.latest_result().exc_string == "a transient failure"

    subprocess.run([RQ, "requeue", "-u", redis_url, "--serializer", "json", "--queue", Q, "--all"], check=True,
                   capture_output=True)
    assert job.get_status() == JobStatus.QUEUED
    assert queue_counts(redis_url) == (1, 0, 2, 0)
    engine.failing = False
    make_worker(redis_url, engine).work(burst=True)
    assert client.result(flaky, timeout=30).usage.completion_tokens == 3
    assert [r.type for r in job.results()] == [Result.Type.SUCCESSFUL, Result.Type.FAILED]
    assert [e.type for e in client.stream(flaky)][:2] == ["restart", "start"]


def test_a_running_job_shows_in_rq_info_and_cancel_stops_it(redis_url, tiny_model_dir):
    connection = Redis.from_url(redis_url)
    client = Client(connection, queue=Q)
    engine = tiny_engine(tiny_model_dir("llama"))
    go_on = threading.Event()  # holds the worker after a step, so the job is surely running while we look
    worker = make_worker(redis_url, engine)
    worker.on_step = lambda worker, outputs: go_on.wait(60)
    with running(worker):
        job_id = client.submit(greedy(400, prompt="A long document"))
        stream = client.stream(job_id, timeout=60)
        try:
            assert next(e for e in stream if e.type == "token")
            assert queue_counts(redis_url)[1] == 1  # executing
            assert re.search(rf"^worker {worker.name} \(.*\) busy {Q}, ", rq_info(redis_url, "-W"), re.M)
            assert client.cancel(job_id)
        finally:
            go_on.set()
        last = list(stream)[-1]
        assert (last.type, last.finish_reason) == ("done", "cancelled")
        assert 0 < last.usage.completion_tokens < 400
        with pytest.raises(JobFailed, match="stopped"):
            client.result(job_id, timeout=10)  # the stream ends first; the RQ result follows
        assert client.status(job_id).status == "stopped"
        assert engine.scheduler.allocator.usage == 0  # its KV blocks are free again
        assert not client.cancel(job_id)


def test_a_waiting_job_is_admitted_on_the_step_after_a_slot_frees(redis_url, tiny_model_dir):
    """12 jobs of skewed lengths, 4 slots: from the engine's step log, every job after the first four
    starts on the step right after the step that freed the slot it takes."""
    connection = Redis.from_url(redis_url)
    lengths = [2, 30, 5, 18, 3, 25, 8, 12, 4, 20, 6, 15]
    ids = Client(connection, queue=Q).submit_many(
        [greedy(n, prompt_token_ids=[10 + i, 20 + i, 30 + i]) for i, n in enumerate(lengths)])
    engine = tiny_engine(tiny_model_dir("llama"), max_num_seqs=4)
    added, first, finished = [], {}, {}  # request ids in order; step of the first token; step of the end
    add, step = engine.add, engine.step
    engine.add = lambda request_id, request, arrival_time=None, progress=None: (
        added.append(request_id), add(request_id, request, arrival_time, progress))[1]

    def logged_step():
        index, outputs = engine.step_index, step()
        for out in outputs:
            first.setdefault(out.request_id, index)  # 3-token prompts: the step that admits a job samples
            if out.finished:
                finished[out.request_id] = (index, len(out.token_ids))
        return outputs

    engine.step = logged_step
    make_worker(redis_url, engine).work(burst=True)

    assert len(added) == 12
    assert [finished[r][1] for r in added] == lengths  # admitted in queue order
    freed = sorted(finished[r][0] for r in added)
    starts = [first[r] for r in added]
    assert starts[:4] == [0, 0, 0, 0]
    assert starts[4:] == [step + 1 for step in freed[:8]]
    for job_id in ids:
        assert Job.fetch(job_id, connection=connection, serializer=JSONSerializer).get_status() == "finished"


def test_bad_jobs_fail_alone_on_the_real_engine(redis_url, tiny_model_dir):
    connection = Redis.from_url(redis_url)
    client = Client(connection, queue=Q)
    engine = tiny_engine(tiny_model_dir("llama"))
    execute = engine.runner.execute

    def execute_failing_for_one_request(batch):
        if any(seq.prompt_token_ids[:3] == [7, 7, 7] for seq in batch.num_tokens):
            raise RuntimeError("kernel fault on this request")
        return execute(batch)

    engine.runner.execute = execute_failing_for_one_request
    bad = {
        client.submit(greedy(4, prompt_token_ids=[5] * 600)): "the prompt has 600 tokens",
        client.submit(greedy(4, prompt_token_ids=[1, 1000])): "token id 1000 is outside the vocabulary",
        client.submit(greedy(4, prompt_token_ids=[7, 7, 7, 8])): "generation failed: RuntimeError: kernel fault",
        Queue(Q, connection=connection).enqueue("rqbatcher.jobs.generate", {"prompt": "hi"}).id: PICKLED_JOB_REASON,
    }
    good = client.submit_many([greedy(6, prompt="The quick brown fox"), greedy(5, prompt_token_ids=[3, 4, 5])])
    make_worker(redis_url, engine).work(burst=True)
    for job_id, reason in bad.items():
        with pytest.raises(JobFailed) as failure:
            client.result(job_id, timeout=30)
        assert reason in failure.value.reason
        assert reason in list(client.stream(job_id))[-1].error
    assert [client.result(job_id, timeout=30).usage.completion_tokens for job_id in good] == [6, 5]
