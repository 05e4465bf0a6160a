"""End to end: service classes and fairness with two real `batcher worker` processes (tiny model, 4 slots each,
sharing one Redis and its fairness counters), a real `batcher serve` with two API keys (two tenants), and the
official `openai` SDK. Sizes are scaled down from the issue's targets; `benchmarks/mixed_load.py`
measures them.

The crash test SIGKILLs one worker and comes last."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from rq import Queue
from rq.serializers import JSONSerializer
from rq.suspension import resume, suspend

from rqbatcher.gateway.job_streams import OUTAGE_WAIT_S
from rqbatcher.jobs import keys
from tests.e2e.test_workers import start_worker, stop, wait_ready
from tests.engine_helpers import random_prompts, reference_tokens
from tests.jobs_support import wait_for
from tests.reliability.support import free_port

pytestmark = pytest.mark.timeout(600)
QUEUE = "urg"
MODEL = "tiny-urg"
KEY_A, KEY_B = "sk-urgency-a", "sk-urgency-b"
SLOTS = 4
TOKENS = 24  # per batch line: each line runs for many steps
PROMPTS = random_prompts(4, seed=19, min_len=6, max_len=14)
BATCH_END_S = 300
STREAMS = 150
LOADED_MARGIN_S = 5.0  # an interactive request behind a batch, against idle: generous (a shared 2-core machine)


@pytest.fixture(scope="module")
def pool(e2e_redis, tiny_model_dir, tmp_path_factory):
    """Two workers and a gateway: (base url, worker processes by name, metrics url by name)."""
    url, connection = e2e_redis
    logs = tmp_path_factory.mktemp("urg")
    port = free_port()
    env = {**os.environ, "BATCHER_API_KEYS": f"{KEY_A},{KEY_B}"}
    server = subprocess.Popen([sys.executable, "-m", "rqbatcher", "serve", "--port", str(port), "--redis-url", url,
                               "--queue", QUEUE], env=env, stdout=subprocess.DEVNULL,
                              stderr=(logs / "gateway.log").open("w"))
    workers, metrics = {}, {}
    try:
        for i in range(2):
            metrics_port = free_port()
            name, process = start_worker(url, tiny_model_dir("llama"), QUEUE, logs / f"worker{i}.log", SLOTS,
                                         "--served-model-name", MODEL, "--metrics-port", str(metrics_port))
            workers[name], metrics[name] = process, f"http://127.0.0.1:{metrics_port}/metrics"
        for name, process in workers.items():
            wait_ready(connection, name, process)
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: _models(base), 60, "the gateway to list the workers' model")
        yield base, workers, metrics
    finally:
        stop(server)
        for process in workers.values():
            stop(process)


def _models(base: str) -> bool:
    try:
        return MODEL in [m.id for m in sdk(base, KEY_A).models.list()]
    except Exception:  # noqa: BLE001  (not up yet)
        return False


def sdk(base: str, key: str) -> OpenAI:
    return OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)


def create_batch(client: OpenAI, lines: int, bodies: list[dict] | None = None) -> str:
    """A batch of `lines` completions: `bodies`, else this module's prompts in turn."""
    bodies = bodies or [{"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": TOKENS,
                         "ignore_eos": True} for i in range(lines)]
    rows = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": body})
            for i, body in enumerate(bodies)]
    uploaded = client.files.create(file=("lines.jsonl", "\n".join(rows).encode()), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h").id


def completed(client: OpenAI, batch_id: str) -> int:
    return client.batches.retrieve(batch_id).request_counts.completed


def wait_done(client: OpenAI, batch_id: str):
    return wait_for(lambda: (b := client.batches.retrieve(batch_id)).status in ("completed", "failed") and b,
                    BATCH_END_S, f"batch {batch_id} to end")


def interactive(client: OpenAI) -> float:
    """Seconds for a short interactive completion; its tier is echoed."""
    started = time.monotonic()
    answer = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, extra_body={"ignore_eos": True})
    assert answer.service_tier == "default" and answer.usage.completion_tokens == 4
    return time.monotonic() - started


def urgency_preemptions(metrics: dict[str, str]) -> dict[str, float]:
    counts = {}
    for name, url in metrics.items():
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        counts[name] = sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                           if s.name == "batcher_urgency_preemptions_total" and s.labels["service_class"] == "batch")
    return counts


def check_outputs(client: OpenAI, batch, model_dir) -> None:
    """Every line's greedy fp32 tokens equal `model.generate` alone, preempted for urgency or not."""
    references = [reference_tokens(model_dir, p, TOKENS) for p in PROMPTS]
    for line in client.files.content(batch.output_file_id).text.splitlines():
        row = json.loads(line)
        index = int(row["custom_id"][1:])
        assert row["response"]["body"]["choices"][0]["token_ids"] == references[index % len(PROMPTS)], index
        assert row["response"]["body"]["service_tier"] == "flex"


def test_an_interactive_request_never_waits_behind_a_batch_backlog(pool, tiny_model_dir):
    base, _, metrics = pool
    a, b = sdk(base, KEY_A), sdk(base, KEY_B)
    idle = [interactive(b) for _ in range(3)]
    total = 120
    batch_id = create_batch(a, total)
    wait_for(lambda: completed(a, batch_id) >= 2 * SLOTS, BATCH_END_S, "the batch to run")
    before = sum(urgency_preemptions(metrics).values())
    loaded, left = [], []
    # A slot's worth of interactive requests at once, three times: one request alone may find a slot just freed
    # between two admission scans and need no preemption; as many as a worker has slots cannot.
    with ThreadPoolExecutor(SLOTS) as pool_:
        for _ in range(3):
            loaded += pool_.map(lambda _: interactive(b), range(SLOTS))
            left.append(total - completed(a, batch_id))
    assert min(left) > total // 4, f"the interactive requests ran only once the batch was nearly done: {left}"
    assert max(loaded) < max(idle) + LOADED_MARGIN_S, (idle, loaded)
    assert sum(urgency_preemptions(metrics).values()) > before, "no slot was free: batch work gave way"
    done = wait_done(a, batch_id)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", total, 0)
    check_outputs(a, done, tiny_model_dir("llama"))


def test_a_tenants_small_batch_is_not_stuck_behind_anothers_large_one(pool):
    base, _, _ = pool
    a, b = sdk(base, KEY_A), sdk(base, KEY_B)
    large = create_batch(a, 100)
    wait_for(lambda: completed(a, large) >= 2 * SLOTS, BATCH_END_S, "the large batch to run")
    small = create_batch(b, 10)
    at_start = completed(a, large)  # B's lines wait in the queue from here on
    wait_for(lambda: completed(b, small) == 10, BATCH_END_S, "the small batch's lines")
    ran = completed(a, large) - at_start
    # Scaled from the issue's 80 of A's lines at 32 slots: the lines in flight (two rounds of the 2 workers' slots),
    # about one of A's per line of B's, and a round of A's beside B's last lines, in the slots B no longer needs (a
    # CI run on 2 loaded cores reached 38 of the 34 the first two allowed). Behind A's backlog B would wait ~80.
    assert ran <= 3 * 2 * SLOTS + 10 + 8, f"A completed {ran} lines while B's 10 ran"
    wait_done(b, small)
    assert a.batches.retrieve(large).status == "in_progress"
    wait_done(a, large)


def test_interactive_requests_are_fair_between_tenants(pool, e2e_redis):
    """A backend floods the model's queue with stock RQ (its jobs name no tenant), then a gateway tenant sends a
    few chat requests: the tenant's are taken as slots free, not after the flood (first come first served would
    finish them last)."""
    base, _, _ = pool
    _, connection = e2e_redis
    flood = 12 * SLOTS  # six rounds of both workers' slots
    queue = Queue(keys.model_queue(QUEUE, MODEL), connection=connection, serializer=JSONSerializer)
    jobs = queue.enqueue_many([Queue.prepare_data("rqbatcher.jobs.generate", args=(
        {"prompt_token_ids": PROMPTS[1], "sampling": {"max_tokens": TOKENS, "ignore_eos": True}},))
        for _ in range(flood)])
    b = sdk(base, KEY_B)
    with ThreadPoolExecutor(SLOTS) as threads:
        answers = list(threads.map(lambda _: b.completions.create(
            model=MODEL, prompt=PROMPTS[1], max_tokens=TOKENS, extra_body={"ignore_eos": True}), range(SLOTS)))
    left = sum(job.get_status(refresh=True) != "finished" for job in jobs)
    assert [a.usage.completion_tokens for a in answers] == [TOKENS] * SLOTS
    assert left >= flood // 3, f"only {left} of the flood's {flood} jobs were left when the tenant's {SLOTS} ended"
    wait_for(lambda: all(job.get_status(refresh=True) == "finished" for job in jobs), BATCH_END_S, "the flood")


def test_the_gateway_relays_more_streams_at_once_than_a_redis_pools_default(pool, e2e_redis):
    """Each relayed stream holds a Redis connection while it waits: 150 wait at once while the workers are
    suspended, longer than the gateway waits out a Redis outage (redis-py's pool stops at 100, and a stream that
    found no connection for that long failed), then all are answered."""
    base, _, _ = pool
    _, connection = e2e_redis
    a = sdk(base, KEY_A)

    def stream(_) -> int:
        chunks = a.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=TOKENS, stream=True,
                                      extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
        return [c.usage.completion_tokens for c in chunks if c.usage][-1]

    suspend(connection)
    try:
        with ThreadPoolExecutor(STREAMS) as threads:
            answered = threads.map(stream, range(STREAMS))
            queued = f"rq:queue:{keys.model_queue(QUEUE, MODEL)}"
            wait_for(lambda: connection.llen(queued) == STREAMS, 60, "every request to queue")
            time.sleep(OUTAGE_WAIT_S + 5)
            resume(connection)
            assert list(answered) == [TOKENS] * STREAMS
    finally:
        resume(connection)


def test_under_a_sustained_interactive_overload_a_batch_keeps_its_minimum_share(pool):
    """Twice as many interactive clients as the pool has slots, each sending again as soon as it is answered: the
    batch still runs in its minimum share of the slots (`--min-batch-share`, 25%) and completes."""
    base, _, _ = pool
    a, b = sdk(base, KEY_A), sdk(base, KEY_B)
    stop, answered = threading.Event(), []

    def load() -> None:
        while not stop.is_set():
            b.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=TOKENS, extra_body={"ignore_eos": True})
            answered.append(time.monotonic())

    clients = [threading.Thread(target=load) for _ in range(4 * SLOTS)]
    for client in clients:
        client.start()
    try:
        wait_for(lambda: len(answered) >= 2 * SLOTS, 60, "the interactive load to run")
        created = time.monotonic()
        done = wait_done(a, create_batch(a, 6 * SLOTS))
        ended = time.monotonic()
    finally:
        stop.set()
        for client in clients:
            client.join(60)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 6 * SLOTS, 0)
    during = sum(created <= t <= ended for t in answered)
    assert during >= 6 * SLOTS, f"the interactive load went on while the batch ran ({during} answered)"


def test_a_worker_killed_while_holding_preempted_work_loses_nothing(pool, tiny_model_dir):
    base, workers, metrics = pool
    a, b = sdk(base, KEY_A), sdk(base, KEY_B)
    total = 48
    batch_id = create_batch(a, total)
    wait_for(lambda: completed(a, batch_id) >= SLOTS, BATCH_END_S, "the batch to run")
    before = urgency_preemptions(metrics)
    answers: list[float] = []
    threads = [threading.Thread(target=lambda: answers.append(interactive(b))) for _ in range(2 * SLOTS)]
    for thread in threads:
        thread.start()
    victim = wait_for(lambda: next((n for n, c in urgency_preemptions(metrics).items() if c > before[n]), None),
                      60, "a worker to preempt batch work")
    workers[victim].kill()  # it holds sequences preempted for urgency (waiting in its engine) and running ones
    workers[victim].wait()
    for thread in threads:
        thread.join(timeout=BATCH_END_S)
    assert len(answers) == 2 * SLOTS, "every interactive request was answered (the survivor reran the lost ones)"
    done = wait_done(a, batch_id)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", total, 0)
    check_outputs(a, done, tiny_model_dir("llama"))
