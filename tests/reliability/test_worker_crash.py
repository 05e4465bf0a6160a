"""Worker crash: three `batcher worker` processes, 60 jobs of mixed lengths, half of them enqueued with plain RQ
(no Retry), while the stock `rq info` runs in a loop; one worker is SIGKILLed while it has at least 8 jobs in
flight, a second one later, among a second wave of jobs. Every job ends with exactly one successful result whose
tokens equal `model.generate` alone, and a rerun job goes on where its stream stopped: no `restart`, one
uninterrupted text. The time from each kill to the lost jobs running again is measured (goal: 30 s). A second test
kills a worker running a sampled n = 3 request, a constrained one and one with a stop string: each goes on to what
an uninterrupted run gives."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest
from rq import Queue
from rq.job import JobStatus
from rq.registry import FailedJobRegistry, StartedJobRegistry
from rq.results import Result
from rq.serializers import JSONSerializer

from rqbatcher.client import Client
from rqbatcher.jobs import keys
from rqbatcher.jobs.contract import JOB_FUNCTION
from rqbatcher.schema import GenerationRequest, SamplingParams
from tests.engine_helpers import engine_for
from tests.jobs_support import continued_text, wait_for
from tests.reliability.support import (
    LEASE_S,
    RedisServer,
    events,
    fetch,
    greedy,
    prompt_pool,
    record,
    reference,
    start_worker,
    stop,
    wait_ready,
)

pytestmark = pytest.mark.timeout(420)
QUEUE = "crash"
RECOVERY_GOAL_S = 30
LENGTHS = (8, 24, 48, 80, 120, 160)
SECOND_WAVE = 48  # jobs of the longest length, enqueued once the first kill's jobs run again: work for the second


def in_flight(connection, worker) -> list[str]:
    """The worker's jobs that have begun streaming; read from RQ's started registry, so that a poll stays short."""
    started = StartedJobRegistry(QUEUE, connection=connection, serializer=JSONSerializer).get_job_ids(cleanup=False)
    jobs = [fetch(connection, j) for j in started]
    return [j.id for j in jobs if j.worker_name == worker and j.get_status(refresh=False) == JobStatus.STARTED
            and connection.xlen(keys.stream_key(j.id)) > 1]


def first_entry(connection, job_id):
    entries = connection.xrange(keys.stream_key(job_id), count=1)
    return entries[0] if entries else None


def kill_and_time_recovery(connection, process, ids, worker) -> tuple[list[str], float]:
    """SIGKILL `worker`; return its jobs in flight (that had begun streaming) and the seconds until all of
    them run again elsewhere."""
    process.send_signal(signal.SIGKILL)
    process.wait()
    killed_at = time.monotonic()
    jobs = [fetch(connection, j) for j in ids]
    lost = [j.id for j in jobs if j.worker_name == worker and j.get_status(refresh=False) == JobStatus.STARTED]
    streamed = [j for j in lost if first_entry(connection, j)]
    executions = {j: {e.execution_id for e in events(connection, j)} for j in streamed}

    def running_again():  # a rerun writes `start` under a new execution on the stream it goes on from
        return all({e.execution_id for e in events(connection, j)} - executions[j] for j in streamed)

    wait_for(running_again, RECOVERY_GOAL_S, "the killed worker's jobs to run again", interval=0.05)
    return streamed, time.monotonic() - killed_at


def kept_tokens(connection, job_id) -> int:
    """The tokens a rerun went on from: those its earlier executions streamed (a restart would make them again)."""
    stream = events(connection, job_id)
    last = stream[-1].execution_id
    return sum(len(e.token_ids) for e in stream if e.type == "token" and e.execution_id != last)


class StockRqInfo:
    """Runs the stock `rq info` CLI (which cleans the registries) in a loop from a thread."""

    def __init__(self, url: str, queues: list[str]) -> None:
        self.command = [sys.executable, "-m", "rq.cli", "info", "--url", url, *queues]
        self.runs = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> StockRqInfo:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            done = subprocess.run(self.command, capture_output=True, text=True, timeout=60)
            self.runs += 1
            if done.returncode:
                self.failures.append(done.stdout + done.stderr)
            self._stop.wait(0.2)


def test_two_sigkilled_workers_lose_no_job_and_every_job_equals_the_reference(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("llama")
    server = RedisServer(tmp_path / "redis").start()
    connection = server.connection()
    workers = [start_worker(server.url, model_dir, QUEUE, tmp_path / f"w{i}.log", max_num_seqs=16) for i in range(3)]
    rq_info = StockRqInfo(server.url, [QUEUE])
    try:
        prompts = prompt_pool()
        jobs = [(tuple(prompts[i % len(prompts)]), LENGTHS[i % len(LENGTHS)]) for i in range(60)]
        wave = [(tuple(prompts[i % len(prompts)]), max(LENGTHS)) for i in range(SECOND_WAVE)]
        for prompt in prompts:  # while the workers load
            reference(model_dir, prompt, max(LENGTHS))
        references = {job: reference(model_dir, list(job[0]), job[1]) for job in jobs + wave}
        for name, process in workers:
            wait_ready(connection, name, process)
        client = Client(connection, queue=QUEUE)
        plain_rq = Queue(QUEUE, connection=connection, serializer=JSONSerializer)
        # Half the jobs through plain RQ, as a backend may enqueue them: no Retry, recovered all the same.
        ids = [plain_rq.enqueue(JOB_FUNCTION, greedy(n, prompt_token_ids=list(p)).model_dump(mode="json")).id
               if i % 2 else client.submit(greedy(n, prompt_token_ids=list(p))) for i, (p, n) in enumerate(jobs)]
        by_id = dict(zip(ids, jobs))

        busiest = wait_for(lambda: next(((n, p) for n, p in workers if len(in_flight(connection, n)) >= 8),
                                        None), 60, "a worker with 8 jobs streaming")
        # An operator runs the stock `rq info` over and over meanwhile: its registry cleanup must neither fail
        # nor requeue (a second time) any job of the dead worker.
        rq_info.start()
        lost1, recovery1 = kill_and_time_recovery(connection, busiest[1], ids, busiest[0])
        assert len(lost1) >= 8
        survivors = [w for w in workers if w is not busiest]
        # The survivors may have finished the first wave by now: a second one keeps both busy for the next kill.
        wave_ids = [client.submit(greedy(n, prompt_token_ids=list(p))) for p, n in wave]
        ids += wave_ids
        by_id.update(zip(wave_ids, wave))
        second = wait_for(lambda: next(((n, p) for n, p in survivors if in_flight(connection, n)), None),
                          30, "a surviving worker with jobs in flight")
        lost2, recovery2 = kill_and_time_recovery(connection, second[1], ids, second[0])
        assert lost2

        for job_id in ids:
            result = client.result(job_id, timeout=120)
            assert result.token_ids == references[by_id[job_id]], job_id
            results = fetch(connection, job_id).results()
            assert [r.type for r in results if r.type != Result.Type.RETRIED] == [Result.Type.SUCCESSFUL], job_id
        kept = 0
        for job_id in set(lost1) | set(lost2):
            stream = events(connection, job_id)
            assert (stream[0].type, stream[-1].type) == ("start", "done")
            assert continued_text(stream) == client.result(job_id).text
            assert [t for e in stream for t in e.token_ids] == references[by_id[job_id]]
            kept += kept_tokens(connection, job_id)
        rq_info.stop()
        assert rq_info.runs > 0 and not rq_info.failures, rq_info.failures
        assert FailedJobRegistry(QUEUE, connection=connection).count == 0
        assert max(recovery1, recovery2) <= RECOVERY_GOAL_S
        assert kept > 0
        record("worker_crash", jobs=len(ids), plain_rq_jobs=len(jobs) // 2, rq_info_runs=rq_info.runs, jobs_lost=0,
               doubled=0, restarts=0, tokens_kept_across_kills=kept,
               killed_in_flight=f"{len(lost1)}+{len(lost2)}",
               recovery_s=f"{recovery1:.1f}/{recovery2:.1f}", lease_s=LEASE_S)
    finally:
        rq_info.stop()
        for _, process in workers:
            stop(process)
        server.stop()


def special_requests(prompts) -> dict[str, GenerationRequest]:
    """Requests whose state a resume must restore beyond the tokens: n = 3 seeded sampling, a grammar, a stop
    string (taken from the uninterrupted answer: late in it, so that the kill comes before it)."""
    schema = {"type": "object", "properties": {"notes": {"type": "string", "minLength": 150, "maxLength": 200}},
              "required": ["notes"], "additionalProperties": False}
    return {
        "choices": GenerationRequest(prompt_token_ids=prompts[0], sampling=SamplingParams(
            max_tokens=300, n=3, temperature=0.8, seed=99, ignore_eos=True)),
        "grammar": GenerationRequest(prompt_token_ids=prompts[1], sampling=SamplingParams(max_tokens=150),
                                     response_format={"type": "json_schema",
                                                      "json_schema": {"name": "n", "schema": schema}}),
        "stop": GenerationRequest(prompt_token_ids=prompts[2], sampling=SamplingParams(
            max_tokens=300, ignore_eos=True, logprobs=1)),
    }


def test_a_killed_workers_sampled_constrained_and_stopping_jobs_go_on_to_the_uninterrupted_answer(tiny_model_dir,
                                                                                                  tmp_path):
    model_dir = tiny_model_dir("llama")
    requests = special_requests(prompt_pool())
    engine = engine_for(model_dir)  # the uninterrupted answers, alone in an engine of this process
    whole = {name: run_alone(engine, request) for name, request in requests.items()}
    text = whole["stop"].text
    stop_text = next(text[i:i + 5] for i in range(len(text) * 3 // 4, len(text)) if text.find(text[i:i + 5]) == i)
    requests["stop"] = requests["stop"].model_copy(update={"sampling": requests["stop"].sampling.model_copy(
        update={"stop": [stop_text]})})
    whole["stop"] = run_alone(engine, requests["stop"])
    assert whole["stop"].finish_reason == "stop" and len(whole["stop"].token_ids) > 40
    server = RedisServer(tmp_path / "redis").start()
    connection = server.connection()
    first = start_worker(server.url, model_dir, QUEUE, tmp_path / "first.log", max_num_seqs=8)
    second = None
    try:
        wait_ready(connection, *first)
        client = Client(connection, queue=QUEUE)
        ids = {name: client.submit(request) for name, request in requests.items()}
        wait_for(lambda: all(sum(len(e.token_ids) for e in events(connection, j)) >= 20 for j in ids.values()),
                 60, "every job to stream 20 tokens")
        first[1].send_signal(signal.SIGKILL)
        first[1].wait()
        second = start_worker(server.url, model_dir, QUEUE, tmp_path / "second.log", max_num_seqs=8)
        for name, job_id in ids.items():
            result = client.result(job_id, timeout=120)
            stream = events(connection, job_id)
            assert len({e.execution_id for e in stream}) == 2 and kept_tokens(connection, job_id) >= 20, name
            answers = result.choices or [result]
            assert [a.token_ids for a in answers] == [c.token_ids for c in (whole[name].choices or [whole[name]])]
            assert [a.finish_reason for a in answers] == [c.finish_reason for c in
                                                          (whole[name].choices or [whole[name]])], name
            for choice, answer in enumerate(answers):
                assert continued_text(stream, choice) == answer.text, (name, choice)
        logprobs = client.result(ids["stop"]).logprobs  # those of the tokens before the kill came from the stream
        assert [(lp.token, round(lp.logprob, 4)) for lp in logprobs] == [
            (lp.token, round(lp.logprob, 4)) for lp in whole["stop"].logprobs]
    finally:
        for worker in (first, second):
            if worker is not None:
                stop(worker[1])
        server.stop()


def run_alone(engine, request):
    engine.add("alone", request)
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                return out
