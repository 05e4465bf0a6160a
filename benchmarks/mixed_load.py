"""A mixed load through Redis and the gateway with the official `openai` SDK: the figures of issue 19.

    python -m benchmarks.mixed_load --lines 600 --small-lines 10 --requests 10 --threads 1 \
        [--steady-lines 200 --steady-load 0.5] [--throughput-lines 64 --baseline-src DIR --rounds 3]

Runs a redis-server of its own, one `batcher serve` with two API keys (tenants A and B) and one `batcher worker`
(32 slots, --model in --dtype), all through real sockets:
- idle: --requests interactive chat streams (tenant B), one at a time; time to first token from the call to the
  first text;
- loaded: tenant A's --lines-line batch (--tokens tokens a line, ignore_eos) is created; once it runs, the same
  interactive streams, one a second; their times to first token against idle (the issue's target: p50 within
  idle p50 + 0.5 s, max within idle max + 1.5 s);
- two tenants: while A's batch runs, tenant B creates a --small-lines batch; how many of A's lines complete
  from B's creation to B's completion (target: at most 80 at 600 and 10 lines);
- burst (with --burst N): while A's --lines-line batch runs, N interactive streams at once, started together with
  tenant B's --small-lines batch, --burst-rounds times, --burst-gap seconds apart (the first after the idle
  measurement, with no interactive work in the worker for longer than the step budget's quiet period: the cold case);
  their times to first token against idle (issue 34's target: p50 within idle + 0.5 s, max within idle + 1.5 s);
- interactive flood (with --flood): tenant A sends --flood chat requests of --tokens tokens at once; once they
  are queued, tenant B's --requests interactive streams one at a time: their times to first token, and how many
  of A's requests were still to answer when B's last one ended (first come first served: none);
- steady (with --steady-lines): tenant A's --steady-lines-line batch alone, then again under a steady
  interactive load of tenant B at --steady-load of the pool's capacity (requests of --tokens tokens, sent at that
  fraction of the batch's own rate alone, so of the tokens the pool serves at 32 slots): the batch's rate under
  load against alone, its share of the tokens served while it ran, and whether it completed within its window
  (target: at least its minimum share, 25% of the slots, of the pool);
- throughput (with --throughput-lines): a batch alone, created with `batcher batch create` and served by a worker
  of this tree, then of --baseline-src (a checkout of the code before, e.g. `git worktree add <dir> <commit>`), on
  the same Redis, alternating for --rounds rounds so that both see the same noise: lines per second, each round's
  ratio and their median (target: at least 0.97).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click
from redis import Redis

from benchmarks.bench_worker import start_worker, worker_env
from benchmarks.gateway_cost import _wait, stop_all
from benchmarks.private_redis import free_port, start_redis_server
from rqbatcher.config import DTYPES
from rqbatcher.jobs import keys
from rqbatcher.workers.bench.report import cpu_name
from rqbatcher.workers.scheduler.step_budget import QUIET_S

QUEUE = "bench"
READY_S = 300
POLL_S = 0.2
END_S = 3600
KEY_A, KEY_B = "sk-bench-a", "sk-bench-b"
PROMPT = "Write a short story about a queue of requests waiting for a GPU."
INTERACTIVE_TOKENS = 16
LOADED_GAP_S = 1.0  # between two interactive requests while the batch runs
STEADY_THREADS = 128  # interactive requests in flight at most, under the steady load
STEADY_WARMUP_S = 5.0
SLOTS = 32


def _worker(redis_url: str, model: str, dtype: str, threads: int, log: Path, src: Path | None = None,
            step_time_target: float | None = None):
    target = [] if step_time_target is None else ["--step-time-target", str(step_time_target)]
    return start_worker(redis_url, QUEUE, model, dtype, threads, SLOTS, log, *target, src=src)


def _gateway(redis_url: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "BATCHER_API_KEYS": f"{KEY_A},{KEY_B}"}
    server = subprocess.Popen([sys.executable, "-m", "rqbatcher", "serve", "--port", str(port),
                               "--redis-url", redis_url,
                               "--queue", QUEUE, "--max-queue-length", "1000000"], env=env,
                              stdout=subprocess.DEVNULL, stderr=log.open("w"))
    return server, f"http://127.0.0.1:{port}"


def _sdk(base: str, key: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=600)


def _lines(n: int, tokens: int, model: str) -> str:
    return "\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": {"model": model, "max_tokens": tokens, "ignore_eos": True, "messages": [
                                     {"role": "user", "content": f"Request {i}: {PROMPT}"}]}}) for i in range(n))


def _create(sdk, lines: str) -> str:
    uploaded = sdk.files.create(file=("lines.jsonl", lines.encode()), purpose="batch")
    return sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h").id


def _ttft(sdk, model: str) -> float:
    started = time.perf_counter()
    stream = sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}], stream=True,
                                         max_tokens=INTERACTIVE_TOKENS, extra_body={"ignore_eos": True})
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - started
    return first


def _summary(values: list[float]) -> dict:
    return {"p50_s": round(statistics.median(values), 3), "max_s": round(max(values), 3), "n": len(values)}


def bench_mixed(base: str, model: str, lines: int, tokens: int, small: int, requests: int) -> dict:
    a, b = _sdk(base, KEY_A), _sdk(base, KEY_B)
    _ttft(b, model)  # warm up
    idle = [_ttft(b, model) for _ in range(requests)]
    large = _create(a, _lines(lines, tokens, model))

    def completed(batch_id: str, client=a) -> int:
        return client.batches.retrieve(batch_id).request_counts.completed

    _wait(lambda: completed(large) >= 1, READY_S, "the batch to run")
    loaded, left = [], []
    for _ in range(requests):
        loaded.append(_ttft(b, model))
        left.append(lines - completed(large))
        time.sleep(LOADED_GAP_S)
    at_small = completed(large)
    small_id = _create(b, _lines(small, tokens, model))
    _wait(lambda: b.batches.retrieve(small_id).status == "completed", END_S, "B's batch")
    during = completed(large) - at_small
    _wait(lambda: a.batches.retrieve(large).status == "completed", END_S, "A's batch")
    idle_s, loaded_s = _summary(idle), _summary(loaded)
    return {
        "interactive_ttft_idle": idle_s, "interactive_ttft_loaded": loaded_s,
        "batch_lines_left_at_each_interactive": left,
        "ttft_p50_added_s": round(loaded_s["p50_s"] - idle_s["p50_s"], 3),
        "ttft_max_added_s": round(loaded_s["max_s"] - idle_s["max_s"], 3),
        "two_tenants": {"a_lines": lines, "b_lines": small, "a_lines_completed_while_b_ran": during},
        "goals_met": {"ttft p50 <= idle p50 + 0.5 s": loaded_s["p50_s"] <= idle_s["p50_s"] + 0.5,
                      "ttft max <= idle max + 1.5 s": loaded_s["max_s"] <= idle_s["max_s"] + 1.5,
                      "A completes <= 80 lines while B's run": during <= 80}}


def bench_burst(base: str, model: str, lines: int, tokens: int, small: int, requests: int, streams: int,
                rounds: int, gap_s: float) -> dict:
    a, b = _sdk(base, KEY_A), _sdk(base, KEY_B)
    _ttft(b, model)  # warm up
    idle = [_ttft(b, model) for _ in range(requests)]
    large = _create(a, _lines(lines, tokens, model))
    _wait(lambda: a.batches.retrieve(large).request_counts.completed >= 1, READY_S, "the batch to run")
    time.sleep(QUIET_S + 1)  # the first burst finds no recent interactive work: the full budget runs (cold)
    by_round = []
    with ThreadPoolExecutor(streams) as pool:
        for _ in range(rounds):
            _create(b, _lines(small, tokens, model))
            by_round.append([round(t, 3) for t in pool.map(lambda _: _ttft(b, model), range(streams))])
            time.sleep(gap_s)
    a.batches.cancel(large)
    idle_s, warm = _summary(idle), _summary([t for r in by_round[1:] for t in r] or by_round[0])
    every = _summary([t for r in by_round for t in r])
    return {"streams": streams, "interactive_ttft_idle": idle_s, "ttft_by_round_s": by_round,
            "first_round_cold": _summary(by_round[0]), "later_rounds_warm": warm, "all_rounds": every,
            "goals_met": {"ttft p50 <= idle p50 + 0.5 s": every["p50_s"] <= idle_s["p50_s"] + 0.5,
                          "ttft max <= idle max + 1.5 s": every["max_s"] <= idle_s["max_s"] + 1.5}}


def bench_flood(base: str, redis_url: str, model: str, flood: int, tokens: int, requests: int,
                connections: int | None = None) -> dict:
    """Tenant A's `flood` chat requests over `connections` (default: one each), then B's `requests` streams one
    after another: each of B's times to first token."""
    a, b = _sdk(base, KEY_A), _sdk(base, KEY_B)
    queue = Redis.from_url(redis_url)
    idle = [_ttft(b, model) for _ in range(requests)]
    answered: list[float] = []

    def ask() -> None:
        a.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=tokens,
                                  extra_body={"ignore_eos": True})
        answered.append(time.monotonic())

    with ThreadPoolExecutor(connections or flood) as pool:
        asked = [pool.submit(ask) for _ in range(flood)]
        waiting = max(1, ((connections or flood) - SLOTS) // 2)  # of those in flight, beyond the slots
        _wait(lambda: queue.llen(f"rq:queue:{keys.model_queue(QUEUE, model)}") >= waiting, READY_S,
              "A's requests to queue")
        loaded = [_ttft(b, model) for _ in range(requests)]
        b_done = time.monotonic()
        for future in asked:
            future.result()
    left = sum(at > b_done for at in answered)
    idle_s, loaded_s = _summary(idle), _summary(loaded)
    return {"a_requests": flood, "interactive_ttft_idle": idle_s, "b_ttft_behind_a": loaded_s,
            "b_ttft_each_s": [round(t, 3) for t in loaded], "a_requests_left_when_b_ended": left}


def bench_steady(base: str, redis_url: str, model: str, lines: int, tokens: int, load: float) -> dict:
    a, b = _sdk(base, KEY_A), _sdk(base, KEY_B)
    connection = Redis.from_url(redis_url)
    alone_s, _, _ = _run_batch(a, connection, lines, tokens, model)
    interval = alone_s / lines / load  # between two interactive requests: `load` of the pool's rate
    answered: list[tuple[float, int]] = []  # (unix time answered, tokens)
    stop = threading.Event()

    def ask() -> None:
        answer = b.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=tokens, extra_body={"ignore_eos": True})
        answered.append((time.time(), answer.usage.completion_tokens))

    def send(pool: ThreadPoolExecutor) -> None:
        while not stop.wait(interval):
            pool.submit(ask)

    with ThreadPoolExecutor(STEADY_THREADS) as pool:
        sender = threading.Thread(target=send, args=(pool,), daemon=True)
        sender.start()
        time.sleep(STEADY_WARMUP_S)  # the interactive load is steady before the batch comes
        loaded_s, (start, end), expires_at = _run_batch(a, connection, lines, tokens, model)
        stop.set()
        sender.join()
    interactive = sum(n for at, n in answered if start <= at <= end)
    share = lines * tokens / (lines * tokens + interactive)
    return {"batch_lines": lines, "interactive_load": load,
            "interactive_requests_per_s": round(1 / interval, 3),
            "batch_alone_lines_per_s": round(lines / alone_s, 3),
            "batch_loaded_lines_per_s": round(lines / loaded_s, 3),
            "batch_rate_loaded_vs_alone": round(alone_s / loaded_s, 3),
            "interactive_tokens_per_s_while_batch_ran": round(interactive / loaded_s, 1),
            "batch_share_of_tokens_while_it_ran": round(share, 3),
            "completed_within_window": end <= expires_at,
            "goals_met": {"batch rate under load >= its minimum share (0.25) of alone": alone_s / loaded_s >= 0.25,
                          "completed within its window": end <= expires_at}}


def _run_batch(client, connection: Redis, lines: int, tokens: int, model: str) -> tuple[float, tuple, float]:
    """Create a batch and wait for it: (seconds it ran, (in_progress_at, completed_at), expires_at)."""
    batch_id = _create(client, _lines(lines, tokens, model))
    key = f"batcher:batch:{batch_id}"
    _wait(lambda: connection.hget(key, "status") == b"completed", END_S, "the batch")
    start, end, expires = (float(connection.hget(key, f)) for f in ("in_progress_at", "completed_at", "expires_at"))
    return end - start, (start, end), expires


def _batch_alone(redis_url: str, model: str, dtype: str, threads: int, lines: int, tokens: int, directory: Path,
                 src: Path | None, label: str) -> float:
    """Lines per second of one batch served alone by a worker of `src` (None: this tree)."""
    connection = Redis.from_url(redis_url)
    connection.flushdb()
    path = directory / f"alone-{label}.jsonl"
    path.write_text(_lines(lines, tokens, model) + "\n")
    worker = _worker(redis_url, model, dtype, threads, directory / f"worker-{label}.log", src)
    try:
        _wait(lambda: connection.scard("batcher:workers") >= 1, READY_S, f"the {label} worker")
        created = subprocess.run([sys.executable, "-m", "rqbatcher", "batch", "create", str(path), "--redis-url",
                                  redis_url, "--queue", QUEUE], env=worker_env(1, src), cwd=src, capture_output=True,
                                 text=True, check=True)
        key = f"batcher:batch:{created.stdout.strip()}"
        _wait(lambda: connection.hget(key, "status") == b"completed", END_S, f"the {label} batch")
        start, end = (float(connection.hget(key, f)) for f in ("in_progress_at", "completed_at"))
        return lines / (end - start)
    finally:
        worker.terminate()
        worker.wait(60)


def bench_alone(redis_url: str, model: str, dtype: str, threads: int, lines: int, tokens: int, directory: Path,
                baseline_src: str | None, rounds: int) -> dict:
    """Lines per second of a batch alone, this tree and the baseline in turn, `rounds` times."""
    this, baseline = [], []
    for round_ in range(rounds):
        this.append(_batch_alone(redis_url, model, dtype, threads, lines, tokens, directory, None, f"this-{round_}"))
        if baseline_src is not None:
            baseline.append(_batch_alone(redis_url, model, dtype, threads, lines, tokens, directory,
                                         Path(baseline_src), f"baseline-{round_}"))
    report = {"lines": lines, "this_lines_per_s": [round(v, 3) for v in this]}
    if baseline:
        ratios = [t / b for t, b in zip(this, baseline)]
        report.update(baseline_lines_per_s=[round(v, 3) for v in baseline], ratios=[round(r, 3) for r in ratios],
                      median_ratio=round(statistics.median(ratios), 3))
    return report


def run(lines, tokens, small, requests, flood, steady_lines, steady_load, throughput_lines, baseline_src, rounds, model,
        dtype, threads, keep_logs, burst=0, burst_rounds=3, burst_gap=3.0, step_time_target=None) -> dict:
    directory = Path(tempfile.mkdtemp(prefix="bench-urgency-"))
    processes: list[subprocess.Popen] = []
    try:
        redis_server, redis_url = start_redis_server(directory)
        processes.append(redis_server)
        report = {"cpu": cpu_name(), "worker_threads": threads, "model": model, "dtype": dtype, "slots": SLOTS,
                  "tokens_per_line": tokens, "step_time_target": step_time_target}
        if lines or flood or steady_lines:
            gateway, base = _gateway(redis_url, directory / "gateway.log")
            worker = _worker(redis_url, model, dtype, threads, directory / "worker.log",
                             step_time_target=step_time_target)
            processes += [gateway, worker]
            _wait(lambda: model in [m.id for m in _sdk(base, KEY_A).models.list()], READY_S, "the worker")
            if lines and burst:
                report["burst"] = bench_burst(base, model, lines, tokens, small, requests, burst, burst_rounds,
                                              burst_gap)
            elif lines:
                report["mixed"] = bench_mixed(base, model, lines, tokens, small, requests)
            if flood:
                report["interactive_flood"] = bench_flood(base, redis_url, model, flood, tokens, requests)
            if steady_lines:
                report["steady"] = bench_steady(base, redis_url, model, steady_lines, tokens, steady_load)
            for process in (worker, gateway):
                process.terminate()
                process.wait(60)
        if throughput_lines:
            report["throughput_alone"] = bench_alone(redis_url, model, dtype, threads, throughput_lines, tokens,
                                                     directory, baseline_src, rounds)
        return report
    finally:
        stop_all(processes, directory, keep_logs)


@click.command()
@click.option("--lines", type=click.IntRange(0), default=600, show_default=True,
              help="Tenant A's batch (0: skip the mixed part).")
@click.option("--tokens", type=click.IntRange(1), default=64, show_default=True, help="Tokens a batch line.")
@click.option("--small-lines", type=click.IntRange(1), default=10, show_default=True, help="Tenant B's batch.")
@click.option("--requests", type=click.IntRange(1), default=10, show_default=True,
              help="Interactive streams, idle and loaded.")
@click.option("--burst", type=click.IntRange(0), default=0, show_default=True,
              help="Interactive streams at once behind --lines (0: the mixed part instead).")
@click.option("--burst-rounds", type=click.IntRange(1), default=3, show_default=True)
@click.option("--burst-gap", type=click.FloatRange(0), default=3.0, show_default=True, help="Seconds between bursts.")
@click.option("--step-time-target", type=click.FloatRange(0), default=None,
              help="The worker's --step-time-target (default: its own default).")
@click.option("--flood", type=click.IntRange(0), default=0, show_default=True,
              help="Tenant A's chat requests at once, ahead of tenant B's (0: skip).")
@click.option("--steady-lines", type=click.IntRange(0), default=0, show_default=True,
              help="A batch alone, then under a steady interactive load (0: skip).")
@click.option("--steady-load", type=click.FloatRange(0.05, 0.95), default=0.5, show_default=True,
              help="The steady interactive load, as a fraction of the pool's capacity.")
@click.option("--throughput-lines", type=click.IntRange(0), default=0, show_default=True,
              help="A batch served alone, by this tree's worker and --baseline-src's (0: skip).")
@click.option("--baseline-src", type=click.Path(exists=True, file_okay=False),
              help="A source tree of the code before (its batcher/ and workers/), for the throughput ratio.")
@click.option("--rounds", type=click.IntRange(1), default=3, show_default=True,
              help="Alternating runs of this tree and the baseline, for the throughput ratio.")
@click.option("--model", default="smollm2", show_default=True)
@click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True)
@click.option("--threads", type=click.IntRange(1), default=1, show_default=True, help="The worker's torch threads.")
@click.option("--keep-logs", is_flag=True)
def main(lines, tokens, small_lines, requests, burst, burst_rounds, burst_gap, step_time_target, flood, steady_lines,
         steady_load, throughput_lines, baseline_src, rounds, model, dtype, threads, keep_logs):
    """Measure interactive TTFT behind a batch, two tenants' batches, and batch throughput; print JSON."""
    click.echo(json.dumps(run(lines, tokens, small_lines, requests, flood, steady_lines, steady_load, throughput_lines,
                              baseline_src, rounds, model, dtype, threads, keep_logs, burst, burst_rounds, burst_gap,
                              step_time_target), indent=1))


if __name__ == "__main__":
    main()
