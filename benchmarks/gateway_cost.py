"""What the HTTP gateway costs: a large batch file uploaded and turned into a batch, and streaming through the
gateway against the Python client on the same worker.

    python -m benchmarks.gateway_cost --lines 10000 --requests 20 --max-tokens 64 --threads 1

Runs a redis-server of its own (a free loopback port, no persistence), a `batcher serve` process and, for the
streaming part, one `batcher worker` process on --model (in --dtype, float32 unless told otherwise). Everything goes
through real sockets.

- upload: the file is uploaded with the official `openai` SDK (files.create), then made a batch
  (batches.create); the gateway's resident memory is sampled all along (its peak against its size before).
  No worker runs: the batch's jobs only queue.
- streaming: the same chat request, greedy, `ignore_eos`, one at a time, in turn through the Python client
  (`Client.submit` then `Client.stream`), through the gateway with the official SDK
  (`chat.completions.create(stream=True)`), and through the gateway with a bare HTTP client (httpx, reading
  the server-sent events itself: the gateway's cost without the SDK's), the order rotated every round.
  Time to first token is from the call to the first text; tokens/s is the generated tokens after the first
  over the time from the first text to the last. Figures are medians (and quartiles).
  The time to first token of one request varies by tens of ms with the worker's prefill on a shared CPU, far
  more than the gateway adds, so the added time is also taken apart, each part timed where it happens:
  `added_ttft_ms` = the extra time to enqueue the job (from the call to RQ's `enqueued_at`, against the
  Python client's) + `relay_ms` (a Python client reads the same job's stream beside the gateway's client:
  from its first text to the gateway client's). `added_ttft_ms_end_to_end` is the plain difference of each
  round's times to first token, noise included.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timezone
from pathlib import Path

import click
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer

from benchmarks.batch_redis_cost import _batch_lines
from benchmarks.private_redis import free_port, start_redis_server
from rqbatcher.client import Client
from rqbatcher.config import DTYPES
from rqbatcher.openai.generation_answer import CHAT_ID_PREFIX
from rqbatcher.schema import ChatMessage, GenerationRequest, SamplingParams
from rqbatcher.workers.bench.record import PeakRss
from rqbatcher.workers.bench.report import cpu_name

QUEUE = "bench"
READY_S = 300  # a worker loads torch and the model on a busy machine
PROMPT = "Write a short story about a queue of requests waiting for a GPU."


def _start_gateway(redis_url: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "BATCHER_API_KEYS": ""}
    server = subprocess.Popen([sys.executable, "-m", "rqbatcher", "serve", "--port", str(port),
                               "--redis-url", redis_url,
                               "--queue", QUEUE, "--max-queue-length", "1000000"],
                              env=env, stdout=subprocess.DEVNULL, stderr=log.open("w"))
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        import httpx

        assert server.poll() is None, log.read_text()
        try:
            return httpx.get(f"{base}/health").status_code == 200
        except httpx.TransportError:
            return False

    _wait(up, 60, "the gateway")
    return server, base


def _start_worker(redis_url: str, model: str, dtype: str, threads: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen([sys.executable, "-m", "rqbatcher", "worker", "--redis-url", redis_url, "--queue", QUEUE,
                             "--model", model, "--dtype", dtype, "--device", "cpu"], env=env,
                            stdout=subprocess.DEVNULL, stderr=log.open("w"))


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return
        except Exception:  # noqa: BLE001  (not up yet)
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start within {timeout} s")
        time.sleep(0.1)


def _sdk(base: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=600)


def bench_upload(base: str, gateway_pid: int, lines: int, directory: Path) -> dict:
    path = directory / "requests.jsonl"
    path.write_text("\n".join(_batch_lines(lines)) + "\n")
    sdk = _sdk(base)
    sdk.models.list()  # a first request: the gateway's steady size before the upload
    before = PeakRss(gateway_pid)._process.memory_info().rss
    with PeakRss(gateway_pid) as upload_rss:
        started = time.perf_counter()
        with path.open("rb") as f:
            uploaded = sdk.files.create(file=f, purpose="batch")
        uploaded_at = time.perf_counter()
    with PeakRss(gateway_pid) as create_rss:
        batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
        created_at = time.perf_counter()
    return {"lines": lines, "file_mib": round(path.stat().st_size / 2**20, 2),
            "upload_s": round(uploaded_at - started, 3), "create_batch_s": round(created_at - uploaded_at, 3),
            "batch_total": batch.request_counts.total, "gateway_rss_before_mib": round(before / 2**20, 1),
            "gateway_peak_added_upload_mib": round((upload_rss.peak - before) / 2**20, 1),
            "gateway_peak_added_create_batch_mib": round((create_rss.peak - before) / 2**20, 1)}


@dataclass(frozen=True)
class Timing:
    """One streamed request. Seconds: `ttft` from the call to the first text, `decode` from the first text to the
    last, `enqueue` from the call to the job's enqueue time (RQ's `enqueued_at`), and for the gateway's paths
    `relay`: from a Python client reading the same job's stream seeing the first text to the gateway's client
    seeing it."""

    ttft: float
    decode: float
    tokens: int
    enqueue: float
    relay: float | None = None


class _FirstText(threading.Thread):
    """Reads a job's stream with the Python client, as `_via_client` does, and notes when the first text comes."""

    def __init__(self, client: Client, job_id: str) -> None:
        super().__init__(daemon=True)
        self.client, self.job_id, self.at = client, job_id, None
        self.start()

    def run(self) -> None:
        for event in self.client.stream(self.job_id):
            if event.type == "token" and event.text:
                self.at = time.perf_counter()
                return


def _enqueue_delay(client: Client, job_id: str, called_at: float) -> float:
    job = Job.fetch(job_id, connection=client.connection, serializer=JSONSerializer)
    return job.enqueued_at.replace(tzinfo=timezone.utc).timestamp() - called_at


def _via_client(client: Client, model: str, max_tokens: int) -> Timing:
    request = GenerationRequest(messages=[ChatMessage(role="user", content=PROMPT)], model=model,
                                sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    called_at, started = time.time(), time.perf_counter()
    job_id = client.submit(request)
    first = last = None
    tokens = 0
    for event in client.stream(job_id):
        if event.type == "token" and event.text:
            last = time.perf_counter()
            first = first or last
        if event.type == "done":
            tokens = event.usage.completion_tokens
    return Timing(first - started, last - first, tokens, _enqueue_delay(client, job_id, called_at))


def _relayed(client: Client, chunks, prefix: str) -> Timing:
    """Time a gateway stream, given as (chat chunk as a dict, receipt time), with a Python client beside it."""
    called_at, started = time.time(), time.perf_counter()
    first = last = beside = None
    tokens = 0
    for chunk, at in chunks:
        if beside is None:
            job_id = chunk["id"].removeprefix(prefix)
            beside = _FirstText(client, job_id)
        if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
            last = at
            first = first or last
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    beside.join()
    return Timing(first - started, last - first, tokens, _enqueue_delay(client, job_id, called_at), first - beside.at)


def _via_gateway(client: Client, sdk, model: str, max_tokens: int) -> Timing:
    def chunks():
        stream = sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                             max_tokens=max_tokens, stream=True,
                                             stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        for chunk in stream:
            yield chunk.model_dump(), time.perf_counter()

    return _relayed(client, chunks(), CHAT_ID_PREFIX)


def _via_http(client: Client, http, base: str, model: str, max_tokens: int) -> Timing:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

    def chunks():
        with http.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    yield json.loads(line[len("data: "):]), time.perf_counter()

    return _relayed(client, chunks(), CHAT_ID_PREFIX)


def _quantiles(values: list[float]) -> dict[str, float]:
    """p25, p50 and p75 of seconds, in ms."""
    q1, q2, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return {"p25": round(q1 * 1000, 1), "p50": round(statistics.median(values) * 1000, 1), "p75": round(q3 * 1000, 1)}


def bench_streaming(base: str, redis_url: str, model: str, requests: int, max_tokens: int) -> dict:
    import httpx

    client = Client(redis_url, queue=QUEUE)
    sdk = _sdk(base)
    http = httpx.Client(timeout=600)
    _wait(lambda: model in [m.id for m in sdk.models.list()], READY_S, "the worker")
    paths = {"client": lambda n: _via_client(client, model, n),
             "gateway_sdk": lambda n: _via_gateway(client, sdk, model, n),
             "gateway_http": lambda n: _via_http(client, http, base, model, n)}
    for path in paths.values():
        path(4)  # warm each path (a model's first steps are slower)
    runs: dict[str, list[Timing]] = {name: [] for name in paths}
    names = list(paths)
    for i in range(requests):
        for name in names[i % len(names):] + names[:i % len(names)]:
            runs[name].append(paths[name](max_tokens))
    summary: dict = {}
    for name, timings in runs.items():
        summary[name] = {"ttft_ms_p50": round(statistics.median(t.ttft for t in timings) * 1000, 1),
                         "tokens_per_s_p50": round(statistics.median((t.tokens - 1) / t.decode for t in timings
                                                                     if t.decode > 0), 2),
                         "enqueue_ms_p50": round(statistics.median(t.enqueue for t in timings) * 1000, 2),
                         "tokens": timings[0].tokens}
    for name in ("gateway_sdk", "gateway_http"):
        pairs = list(zip(runs["client"], runs[name]))
        ratio = summary[name]["tokens_per_s_p50"] / summary["client"]["tokens_per_s_p50"]
        added = [g.enqueue - c.enqueue + g.relay for c, g in pairs]
        summary[name].update({
            "tokens_per_s_ratio": round(ratio, 3),
            "added_ttft_ms_end_to_end": _quantiles([g.ttft - c.ttft for c, g in pairs]),
            "relay_ms": _quantiles([g.relay for _, g in pairs]),
            "added_ttft_ms": _quantiles(added),
            "goals_met": {"tokens_per_s_ratio >= 0.9": ratio >= 0.9,
                          "added_ttft_ms_p50 <= 20": statistics.median(added) * 1000 <= 20}})
    return summary


def run(lines: int, requests: int, max_tokens: int, model: str, dtype: str, threads: int, keep_logs: bool) -> dict:
    directory = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    processes = []
    try:
        redis_server, redis_url = start_redis_server(directory)
        processes.append(redis_server)
        gateway, base = _start_gateway(redis_url, directory / "gateway.log")
        processes.append(gateway)
        report = {"cpu": cpu_name(), "worker_threads": threads, "model": model, "dtype": dtype}
        if lines:
            report["upload"] = bench_upload(base, gateway.pid, lines, directory)
            Redis.from_url(redis_url).flushdb()  # the batch's queued jobs: no worker is to run them
        if requests:
            processes.append(_start_worker(redis_url, model, dtype, threads, directory / "worker.log"))
            report["streaming"] = {"requests": requests, "max_tokens": max_tokens,
                                   **bench_streaming(base, redis_url, model, requests, max_tokens)}
        return report
    finally:
        stop_all(processes, directory, keep_logs)


def stop_processes(processes: list[subprocess.Popen]) -> None:
    """Stop processes, newest first: terminate, and kill what is still running 30 s later."""
    for process in reversed(processes):
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def stop_all(processes: list[subprocess.Popen], directory: Path, keep_logs: bool) -> None:
    """Stop the bench's processes, newest first, and remove their folder unless its logs are kept."""
    stop_processes(processes)
    if keep_logs:
        click.echo(f"logs in {directory}", err=True)
    else:
        shutil.rmtree(directory, ignore_errors=True)


@click.command()
@click.option("--lines", type=click.IntRange(0), default=10_000, show_default=True,
              help="Lines of the uploaded batch file (0: skip the upload part).")
@click.option("--requests", type=click.IntRange(0), default=20, show_default=True,
              help="Streamed requests through each path (0: skip the streaming part).")
@click.option("--max-tokens", type=click.IntRange(2), default=64, show_default=True)
@click.option("--model", default="smollm2", show_default=True)
@click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True, help="The worker's dtype.")
@click.option("--threads", type=click.IntRange(1), default=1, show_default=True, help="The worker's torch threads.")
@click.option("--keep-logs", is_flag=True, help="Keep the gateway's and the worker's logs.")
def main(lines, requests, max_tokens, model, dtype, threads, keep_logs) -> None:
    """Measure the gateway: a LINES-line batch file upload, and streaming against the Python client; print JSON."""
    click.echo(json.dumps(run(lines, requests, max_tokens, model, dtype, threads, keep_logs), indent=1))


if __name__ == "__main__":
    main()
