"""End to end: `batcher worker` processes with a tiny model, jobs enqueued from other processes.

One worker serves the first tests; the crash test starts two of its own (one is SIGKILLed), and
the second of them is then drained with SIGTERM.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from redis import Redis
from rq.job import Job, JobStatus
from rq.results import Result
from rq.serializers import JSONSerializer
from transformers import AutoModelForCausalLM, AutoTokenizer

from rqbatcher.client import Client
from rqbatcher.jobs import keys
from rqbatcher.schema import GenerationRequest, SamplingParams
from tests.jobs_support import continued_text, wait_for

pytestmark = pytest.mark.timeout(300)
WORKER_READY_S = 120  # loading torch and the model, on a busy 2-core machine
LEASE_S = 3
RECOVERY_S = 30


def start_worker(url: str, model_dir: Path, queue: str, log_path: Path,
                 max_num_seqs: int, *extra: str) -> tuple[str, subprocess.Popen]:
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    command = [sys.executable, "-m", "rqbatcher", "worker", "--redis-url", url, "--queue", queue,
               "--model", str(model_dir), "--device", "cpu", "--dtype", "float32", "--num-blocks", "512",
               "--max-num-seqs", str(max_num_seqs), "--lease", str(LEASE_S), "--name", name, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=log_path.open("w"))
    return name, process


def wait_ready(connection: Redis, name: str, process: subprocess.Popen) -> None:
    def ready():
        assert process.poll() is None, f"worker {name} exited with {process.returncode}"
        return connection.exists(f"rq:worker:{name}")

    wait_for(ready, WORKER_READY_S, f"worker {name} to register")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


def greedy(max_tokens: int, **request) -> GenerationRequest:
    return GenerationRequest(sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True), **request)


@pytest.fixture(scope="module")
def serving(e2e_redis, tiny_model_dir, tmp_path_factory):
    """One worker on queue `e2e`: (url, connection, model_dir)."""
    url, connection = e2e_redis
    model_dir = tiny_model_dir("llama")
    name, process = start_worker(url, model_dir, "e2e", tmp_path_factory.mktemp("w") / "worker.log", 8)
    try:
        wait_ready(connection, name, process)
        yield url, connection, model_dir
    finally:
        stop(process)


def test_twenty_jobs_from_another_process_equal_generate_alone(serving, tmp_path):
    url, connection, model_dir = serving
    words = "The quick brown fox jumps over the lazy dog Redis streams carry tokens to readers".split()
    lines = []
    for i in range(20):
        prompt = " ".join(words[i % 7: i % 7 + 2 + i % 5])
        body = {"prompt": prompt, "max_tokens": 4 + (i * 7) % 13, "temperature": 0, "ignore_eos": True}
        lines.append({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions", "body": body})
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps(line) + "\n" for line in lines))
    submitted = subprocess.run([sys.executable, "-m", "rqbatcher", "submit", "--redis-url", url, "--queue", "e2e",
                                "--file", str(batch), "--follow"], capture_output=True, text=True, timeout=240)
    assert submitted.returncode == 0, submitted.stderr
    out = {o["custom_id"]: o for o in map(json.loads, submitted.stdout.splitlines()[1:])}
    assert sorted(out) == sorted(line["custom_id"] for line in lines)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for line in lines:
        body = out[line["custom_id"]]["response"]["body"]
        prompt_ids = tokenizer(line["body"]["prompt"], return_tensors="pt")["input_ids"]
        with torch.no_grad():
            alone = model.generate(prompt_ids, max_new_tokens=line["body"]["max_tokens"], do_sample=False,
                                   eos_token_id=None, pad_token_id=0)[0, prompt_ids.shape[1]:].tolist()
        assert body["choices"][0]["token_ids"] == alone, line["custom_id"]


def test_a_stream_reader_sees_tokens_before_the_job_finishes(serving):
    url, connection, _ = serving
    client = Client(connection, queue="e2e")
    job_id = client.submit(greedy(400, prompt="A long answer, please"))
    status_at_first_token = None
    text = ""
    for event in client.stream(job_id, timeout=120):
        if event.type == "token":
            if status_at_first_token is None:
                status_at_first_token = client.status(job_id).status
            text += event.text
    assert status_at_first_token == "started"
    assert (event.type, event.usage.completion_tokens) == ("done", 400)
    assert text == client.result(job_id, timeout=30).text


def test_a_sigkilled_workers_jobs_finish_on_another_within_30s_then_sigterm_drains(e2e_redis, tiny_model_dir,
                                                                                tmp_path):
    url, connection = e2e_redis
    model_dir = tiny_model_dir("llama")
    client = Client(connection, queue="crash")
    first, first_process = start_worker(url, model_dir, "crash", tmp_path / "first.log", 4)
    second, second_process = start_worker(url, model_dir, "crash", tmp_path / "second.log", 8)
    try:
        wait_ready(connection, first, first_process)
        wait_ready(connection, second, second_process)
        ids = client.submit_many([greedy(450, prompt_token_ids=[11 + i, 22, 33 + i]) for i in range(24)])

        def running_on_first() -> list[str]:
            jobs = [Job.fetch(j, connection, JSONSerializer) for j in ids]
            return [job.id for job in jobs if job.worker_name == first and job.get_status() == JobStatus.STARTED]

        wait_for(lambda: (running := running_on_first()) and all(
            connection.xlen(keys.stream_key(j)) > 1 for j in running), 60, "tokens from the first worker's jobs")
        first_process.send_signal(signal.SIGKILL)
        first_process.wait()
        killed_at = time.monotonic()
        killed = running_on_first()  # the worker is gone: these stay "started" until their leases run out
        assert killed, "the first worker had no job in flight when it was killed"
        # A job taken just before the kill may not have flushed any event yet: its rerun has nothing to go on
        # from. Every job that had streamed goes on from its stream: two executions, one uninterrupted text.
        streamed = [j for j in killed if connection.exists(keys.stream_key(j))]
        assert streamed, "no killed job had streamed anything"

        for job_id in ids:
            remaining = RECOVERY_S - (time.monotonic() - killed_at)
            assert client.result(job_id, timeout=max(remaining, 0.1)).usage.completion_tokens == 450
        for job_id in ids:
            results = Job.fetch(job_id, connection, JSONSerializer).results()
            assert [r.type for r in results] == [Result.Type.SUCCESSFUL]
        for job_id in killed:
            stream = list(client.stream(job_id))
            assert (stream[0].type, stream[-1].type) == ("start", "done")
            assert len({e.execution_id for e in stream}) == (2 if job_id in streamed else 1)
            assert continued_text(stream) == client.result(job_id).text

        # Drain: the first SIGTERM stops admission; the jobs in flight finish; the worker exits 0.
        in_flight = client.submit_many([greedy(450, prompt="drain me") for _ in range(4)])
        wait_for(lambda: all(connection.xlen(keys.stream_key(j)) > 1 for j in in_flight), 60, "tokens")
        second_process.send_signal(signal.SIGTERM)
        draining = wait_for(lambda: re.search(r"draining \(stop admitting, finish (\d+) jobs in flight\)",
                                              (tmp_path / "second.log").read_text()), 30, "the drain to begin")
        assert int(draining.group(1)) > 0
        late = client.submit(greedy(4, prompt="too late"))
        assert second_process.wait(60) == 0
        assert [client.result(j, timeout=30).usage.completion_tokens for j in in_flight] == [450] * 4
        assert client.status(late).status == "queued"
    finally:
        stop(first_process)
        stop(second_process)
