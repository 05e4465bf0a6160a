"""What per-tenant limits cost and what they protect (issue 44): the gateway's time to refuse a tenant past its
limit, and other tenants' time to first token while that tenant floods the gateway, against their time without it.

    python -m benchmarks.rate_limited_tenant --rounds 4 --requests 10 --flood-rps 50

Runs a redis-server of its own (a free loopback port, no persistence), one `batcher serve` process whose keys file
gives the flooding tenant `requests-per-minute=--flood-limit` (the victims have no limit), and one worker process on
the letter engine (`tests.letter_engine`, no model) that sleeps --step-ms each step, as a small model's decode step
takes. Everything goes through real sockets.

- ttft: each victim tenant sends streamed chat requests one after the other (httpx, reading the server-sent events);
  time to first token is from the call to the first text. Rounds alternate: victims alone, then victims while the
  flooder sends --flood-rps requests per second (open loop, from threads) far past its limit, so nearly all of them
  are refused. `ttft_ratio` is the median time to first token with the flood over the median without it, taken in
  the same run (goal: <= 1.05).
- refusal: the gateway's own time for a 429, from the request's arrival to its response (p50, p99; goal: p99 <= 10
  ms): the gateway's app built by `create_app` in this process on the same Redis and the same live worker, called
  through httpx's ASGI transport (no socket), every request past the tenant's limit. The flood's 429s as its client
  saw them over loopback (the socket and uvicorn included) are reported beside it.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import click
import httpx

from benchmarks.gateway_cost import _wait, stop_all
from benchmarks.private_redis import free_port, start_redis_server
from rqbatcher.client import connect
from rqbatcher.gateway.app import GatewayConfig, create_app
from rqbatcher.gateway.auth import ApiKeys
from rqbatcher.jobs.connection import connect_async
from rqbatcher.workers.bench.report import cpu_name

QUEUE = "bench"  # the queue benchmarks.gateway_cost's gateway serves
MODEL = "letter-model"
VICTIM_KEYS = ("sk-victim-1", "sk-victim-2")
FLOOD_KEY = "sk-flooder"
PROBE_KEY = "sk-probe"  # the in-process gateway's tenant, limited to one request a minute
PROMPT = "Write a short story about a queue of requests waiting for a GPU."
REFUSALS_IN_PROCESS = 2000
READY_S = 60
FLOOD_THREADS = 4
# The worker process: the letter engine, each step sleeping as long as a small model's decode step takes
WORKER_CODE = """
import sys, time
from redis import Redis
from rqbatcher.jobs import keys
from rqbatcher.workers.job_worker.worker import JobWorker
from tests.letter_engine import LetterEngine

url, slots, step_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])

class SteppedEngine(LetterEngine):
    def step(self):
        time.sleep(step_s)
        return super().step()

JobWorker(keys.priority_queue_names([sys.argv[4]], model=sys.argv[5]), SteppedEngine(max_num_seqs=slots),
          connection=Redis.from_url(url), model_name=sys.argv[5]).work()
"""


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _chat(max_tokens: int, stream: bool) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "stream": stream}


def _ttfts(base: str, key: str, requests: int, max_tokens: int, into: list[float]) -> None:
    """A victim: streamed requests one after the other, each read to its end; their times to first text."""
    with httpx.Client(timeout=120) as http:
        for _ in range(requests):
            started, first = time.perf_counter(), None
            with http.stream("POST", f"{base}/v1/chat/completions", headers=_auth(key),
                             json=_chat(max_tokens, True)) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if first is None and line.startswith("data: {"):
                        choices = json.loads(line[len("data: "):])["choices"]
                        if choices and choices[0]["delta"].get("content"):
                            first = time.perf_counter()
            into.append(first - started)


def _flood(base: str, rate: float, stop: threading.Event, refusals: list[float], statuses: list[int]) -> None:
    """One of the flooder's threads: requests at `rate` a second (open loop), each as soon as it is due."""
    with httpx.Client(timeout=120) as http:
        due = time.perf_counter()
        while not stop.is_set():
            due += 1 / rate
            time.sleep(max(0.0, due - time.perf_counter()))
            started = time.perf_counter()
            response = http.post(f"{base}/v1/chat/completions", headers=_auth(FLOOD_KEY), json=_chat(4, False))
            statuses.append(response.status_code)
            if response.status_code == 429:
                refusals.append(time.perf_counter() - started)


def _flooder(base: str, rate: float, started, stop, results) -> None:
    """The flooding tenant, in a process of its own (its client's work must not hold the victims' GIL): threads that
    send `rate` requests a second in all until `stop`; what they saw goes to `results`."""
    refusals: list[float] = []
    statuses: list[int] = []
    threads = [threading.Thread(target=_flood, args=(base, rate / FLOOD_THREADS, stop, refusals, statuses))
               for _ in range(FLOOD_THREADS)]
    for thread in threads:
        thread.start()
    started.set()
    for thread in threads:
        thread.join()
    results.put({"refusals_s": refusals, "statuses": statuses})


def _round(base: str, requests: int, max_tokens: int, flood_rps: float | None) -> tuple[list[float], dict]:
    """One round of every victim's requests, with the flood alongside when `flood_rps` is given."""
    context = multiprocessing.get_context("spawn")
    started, stop, results = context.Event(), context.Event(), context.Queue()
    flooder = None
    if flood_rps:
        flooder = context.Process(target=_flooder, args=(base, flood_rps, started, stop, results))
        flooder.start()
        started.wait(READY_S)
    ttfts: list[float] = []
    victims = [threading.Thread(target=_ttfts, args=(base, key, requests, max_tokens, ttfts)) for key in VICTIM_KEYS]
    for thread in victims:
        thread.start()
    for thread in victims:
        thread.join()
    if flooder is None:
        return ttfts, {"refusals_s": [], "statuses": []}
    stop.set()
    seen = results.get(timeout=READY_S)
    flooder.join()
    return ttfts, seen


def _start_gateway(redis_url: str, keys_file: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "rqbatcher", "serve", "--port", str(port), "--redis-url",
                               redis_url, "--queue", QUEUE, "--api-keys-file", str(keys_file),
                               "--max-queue-length", "1000000"], env={**os.environ, "BATCHER_API_KEYS": ""},
                              stdout=subprocess.DEVNULL, stderr=log.open("w"))
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert server.poll() is None, log.read_text()
        return httpx.get(f"{base}/health").status_code == 200

    _wait(up, READY_S, "the gateway")
    return server, base


def _ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 2)


async def _refusals_in_process(redis_url: str, keys_file: Path) -> list[float]:
    """The gateway's own time for each 429: its app called through httpx's ASGI transport (no socket)."""
    config = GatewayConfig(queue=QUEUE, api_keys=ApiKeys.load(None, keys_file), max_queue_length=1_000_000)
    app = create_app(config, connect(redis_url), connect_async(redis_url))
    times = []
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=60) as http:
        body, headers = _chat(4, False), _auth(PROBE_KEY)
        assert (await http.post("/v1/chat/completions", headers=headers, json=body)).status_code == 200
        for _ in range(REFUSALS_IN_PROCESS):
            started = time.perf_counter()
            response = await http.post("/v1/chat/completions", headers=headers, json=body)
            times.append(time.perf_counter() - started)
            assert response.status_code == 429, response.text
    return times


def run(rounds: int, requests: int, max_tokens: int, flood_rps: float, flood_limit: int, slots: int,
        step_ms: float, keep_logs: bool) -> dict:
    directory = Path(tempfile.mkdtemp(prefix="bench-tenant-limits-"))
    processes = []
    try:
        redis_server, redis_url = start_redis_server(directory)
        processes.append(redis_server)
        keys_file = directory / "keys"
        keys_file.write_text("\n".join([*VICTIM_KEYS, f"{FLOOD_KEY} requests-per-minute={flood_limit}",
                                        f"{PROBE_KEY} requests-per-minute=1"]) + "\n")
        processes.append(subprocess.Popen([sys.executable, "-c", WORKER_CODE, redis_url, str(slots),
                                           str(step_ms / 1000), QUEUE, MODEL], cwd=Path(__file__).parents[1],
                                          stdout=subprocess.DEVNULL, stderr=(directory / "worker.log").open("w")))
        gateway, base = _start_gateway(redis_url, keys_file, directory / "gateway.log")
        processes.append(gateway)
        _wait(lambda: MODEL in [m["id"] for m in httpx.get(f"{base}/v1/models", headers=_auth(VICTIM_KEYS[0])).json()[
            "data"]], READY_S, "the worker")
        _round(base, 2, max_tokens, None)  # warm the victims' path
        with httpx.Client(timeout=120) as http:  # the flooder spends its minute's requests: from now on it is over
            while http.post(f"{base}/v1/chat/completions", headers=_auth(FLOOD_KEY),
                            json=_chat(4, False)).status_code != 429:
                pass
        alone, flooded, flood = [], [], {"refusals_s": [], "statuses": []}
        for _ in range(rounds):
            alone += _round(base, requests, max_tokens, None)[0]
            ttfts, seen = _round(base, requests, max_tokens, flood_rps)
            flooded += ttfts
            for name in flood:
                flood[name] += seen[name]
        in_process = asyncio.run(_refusals_in_process(redis_url, keys_file))
        ratio = statistics.median(flooded) / statistics.median(alone)
        statuses = flood["statuses"]
        return {
            "cpu": cpu_name(), "victims": len(VICTIM_KEYS), "requests_per_victim_per_round": requests,
            "rounds": rounds, "max_tokens": max_tokens, "worker_slots": slots, "step_ms": step_ms,
            "flood": {"rps_asked": flood_rps, "requests_per_minute_limit": flood_limit, "sent": len(statuses),
                      "refused_429": statuses.count(429), "admitted": statuses.count(200),
                      "client_round_trip_429_ms": {"p50": _ms(flood["refusals_s"], 0.5),
                                                   "p99": _ms(flood["refusals_s"], 0.99)}},
            "refusal_in_process_ms": {"requests": len(in_process), "p50": _ms(in_process, 0.5),
                                      "p99": _ms(in_process, 0.99)},
            "ttft_ms": {"alone_p50": _ms(alone, 0.5), "flooded_p50": _ms(flooded, 0.5),
                        "alone_p90": _ms(alone, 0.9), "flooded_p90": _ms(flooded, 0.9)},
            "ttft_ratio": round(ratio, 3),
            "goals_met": {"refusal_in_process_p99_ms <= 10": _ms(in_process, 0.99) <= 10,
                          "ttft_ratio <= 1.05": ratio <= 1.05},
        }
    finally:
        stop_all(processes, directory, keep_logs)


@click.command()
@click.option("--rounds", type=click.IntRange(1), default=4, show_default=True,
              help="Rounds of victims alone, then flooded.")
@click.option("--requests", type=click.IntRange(1), default=10, show_default=True,
              help="Streamed requests of each victim in each round.")
@click.option("--max-tokens", type=click.IntRange(1), default=16, show_default=True)
@click.option("--flood-rps", type=click.FloatRange(1), default=50, show_default=True,
              help="Requests per second the flooding tenant sends.")
@click.option("--flood-limit", type=click.IntRange(1), default=60, show_default=True,
              help="The flooding tenant's requests per minute.")
@click.option("--slots", type=click.IntRange(1), default=8, show_default=True, help="The worker's slots.")
@click.option("--step-ms", type=click.FloatRange(0), default=20, show_default=True,
              help="How long each of the worker's steps takes.")
@click.option("--keep-logs", is_flag=True, help="Keep the gateway's and the worker's logs.")
def main(rounds, requests, max_tokens, flood_rps, flood_limit, slots, step_ms, keep_logs) -> None:
    """Measure a 429's cost in the gateway and other tenants' time to first token under a flood; print JSON."""
    click.echo(json.dumps(run(rounds, requests, max_tokens, flood_rps, flood_limit, slots, step_ms, keep_logs),
                          indent=1))


if __name__ == "__main__":
    main()
