"""Network faults between workers and Redis, injected by a TCP proxy (fault_proxy.py): latency spikes, connections
cut mid-pipeline, a Redis that stops answering for longer than a lease, and one worker partitioned while another
stays healthy. In every case: no job lost, none with two results, every stream event written once, nothing of an
execution that lost its lease written after the takeover, and the workers recover by themselves."""

from __future__ import annotations

import os
import signal
import time

import pytest
from rq.job import JobStatus
from rq.results import Result

from rqbatcher.client import Client
from tests.jobs_support import wait_for
from tests.reliability.fault_proxy import FaultProxy
from tests.reliability.support import (
    LEASE_S,
    RedisServer,
    events,
    fetch,
    greedy,
    prompt_pool,
    record,
    start_worker,
    stop,
    wait_ready,
)

QUEUE = "net"
SLOTS = 4
TOKENS = 60


def submit(client: Client, n: int, tokens: int = TOKENS) -> list[str]:
    prompts = prompt_pool()
    return client.submit_many([greedy(tokens, prompt_token_ids=prompts[i % len(prompts)]) for i in range(n)])


def check_exactly_once(connection, client: Client, ids: list[str], timeout: float = 180) -> int:
    """Every job finished once, and its stream after the last `restart` (if any) is one text, each token once, whose
    text is the result's; once the result's execution began (its `start`), no other execution wrote. Return how
    many jobs were rerun (their stream holds more than one execution, or a `restart`)."""
    rerun = 0
    for job_id in ids:
        result = client.result(job_id, timeout=timeout)
        job = fetch(connection, job_id)
        assert job.get_status() == JobStatus.FINISHED
        assert [r.type for r in job.results()] == [Result.Type.SUCCESSFUL], job_id
        stream = events(connection, job_id)
        restarts = [i for i, e in enumerate(stream) if e.type == "restart"]
        rerun += bool(restarts) or len({e.execution_id for e in stream if e.type == "start"}) > 1
        tail = stream[restarts[-1] if restarts else 0:]
        latest = job.latest_result().execution_id
        begun = next(i for i, e in enumerate(tail) if e.type == "start" and e.execution_id == latest)
        assert {e.execution_id for e in tail[begun:]} == {latest}, job_id  # no stale writer
        tokens = [e for e in tail if e.type == "token"]
        assert [e.index for e in tokens] == [sum(len(t.token_ids) for t in tokens[:i]) for i in range(len(tokens))]
        assert "".join(e.text for e in tokens) == result.text
        assert [e.type for e in tail].count("done") == 1 and tail[-1].type == "done"
        assert "".join(e.text for e in client.stream(job_id, timeout=10) if e.type == "token") == result.text
    return rerun


@pytest.fixture
def cluster(tiny_model_dir, tmp_path):
    """A Redis, a proxy in front of it per worker, and a factory for workers behind them."""
    server = RedisServer(tmp_path / "redis").start()
    proxies, processes = [], []

    def worker(name: str, through_proxy: bool = True):
        proxy = FaultProxy(server.port) if through_proxy else None
        url = proxy.url() if proxy else server.url
        name, process = start_worker(url, tiny_model_dir("llama"), QUEUE, tmp_path / f"{name}.log", name=name,
                                     max_num_seqs=SLOTS)
        proxies.append(proxy)
        processes.append(process)
        wait_ready(server.connection(), name, process)
        return name, process, proxy

    try:
        yield server, worker
    finally:
        for process in processes:
            stop(process)
        for proxy in proxies:
            if proxy:
                proxy.close()
        server.stop()


def test_connections_cut_mid_pipeline_and_latency_spikes(cluster):
    server, worker = cluster
    connection = server.connection()
    (_, _, proxy_a), (_, _, proxy_b) = worker("lat-a"), worker("lat-b")
    client = Client(server.url, queue=QUEUE)
    ids = submit(client, 4 * SLOTS, tokens=300)
    running = lambda: sum(fetch(connection, j).get_status() == JobStatus.STARTED for j in ids)  # noqa: E731
    wait_for(lambda: running() >= SLOTS, 60, "jobs")
    cuts, in_flight = 0, []
    for _ in range(8):  # cut every connection, mid-flush, eight times in four seconds
        in_flight.append(running())
        cuts += proxy_a.cut() + proxy_b.cut()
        time.sleep(0.5)
    for proxy in (proxy_a, proxy_b):  # then a spike of 2 s round trips
        proxy.latency(1.0)
    time.sleep(2.5)
    for proxy in (proxy_a, proxy_b):
        proxy.latency(0)
    ended = time.monotonic()
    rerun = check_exactly_once(connection, client, ids)
    assert max(in_flight) > 0, "no job was in flight during the cuts"
    record("cuts_and_latency", jobs=len(ids), jobs_lost=0, doubled=0, rerun=rerun, connections_cut=cuts,
           max_in_flight_at_a_cut=max(in_flight), all_done_after_faults_s=f"{time.monotonic() - ended:.1f}")


def test_a_redis_that_stops_answering_for_longer_than_a_lease(cluster):
    server, worker = cluster
    connection = server.connection()
    worker("frozen-a", through_proxy=False)
    worker("frozen-b", through_proxy=False)
    client = Client(server.url, queue=QUEUE)
    ids = submit(client, 3 * SLOTS)
    wait_for(lambda: sum(fetch(connection, j).get_status() == JobStatus.STARTED for j in ids) >= SLOTS, 60, "jobs")
    os.kill(server.process.pid, signal.SIGSTOP)  # connections are accepted by the kernel; nothing answers
    time.sleep(2 * LEASE_S)
    os.kill(server.process.pid, signal.SIGCONT)  # what the workers sent meanwhile is served now, late
    thawed = time.monotonic()
    rerun = check_exactly_once(connection, client, ids)
    record("redis_stops_answering", jobs=len(ids), jobs_lost=0, doubled=0, rerun=rerun, frozen_s=2 * LEASE_S,
           all_done_after_thaw_s=f"{time.monotonic() - thawed:.1f}")


def test_one_worker_partitioned_while_another_stays_healthy(cluster):
    server, worker = cluster
    connection = server.connection()
    name_a, process_a, proxy_a = worker("part-a")
    _, process_b, _ = worker("part-b", through_proxy=False)
    client = Client(server.url, queue=QUEUE)
    ids = submit(client, 3 * SLOTS, tokens=300)

    def on_a() -> list[str]:
        jobs = [fetch(connection, j) for j in ids]
        return [j.id for j in jobs if j.worker_name == name_a and j.get_status() == JobStatus.STARTED]

    wait_for(lambda: len(on_a()) >= 2, 60, "jobs running on the worker to partition")
    stranded = on_a()
    proxy_a.partition()
    cut_at = time.monotonic()
    wait_for(lambda: all(fetch(connection, j).worker_name != name_a for j in stranded), 60,
             "the healthy worker to take the partitioned worker's jobs over")
    taken_over_s = time.monotonic() - cut_at
    time.sleep(LEASE_S)
    proxy_a.heal()  # the partitioned worker's buffered writes now reach Redis: all fenced off
    healed = time.monotonic()
    rerun = check_exactly_once(connection, client, ids)
    stop(process_b)  # from now on only the worker that was cut off can serve: it must have come back
    more = submit(client, SLOTS, tokens=20)
    check_exactly_once(connection, client, more)
    assert process_a.poll() is None and all(fetch(connection, j).worker_name == name_a for j in more)
    record("worker_partitioned", jobs=len(ids), stranded=len(stranded), jobs_lost=0, doubled=0, rerun=rerun,
           taken_over_after_s=f"{taken_over_s:.1f}", done_on_it_after_heal_s=f"{time.monotonic() - healed:.1f}")
