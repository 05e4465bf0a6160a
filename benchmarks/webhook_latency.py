"""How soon a webhook arrives after a batch ends, on an idle pool: `batcher webhooks worker` running, nothing queued.

    python -m benchmarks.webhook_latency --rounds 10

Runs against a redis-server of its own (`benchmarks.private_redis`), a receiver on a loopback port (an endpoint
added with private addresses allowed), and `batcher webhooks worker` as a subprocess. Each round creates a small
batch and runs it through one in-process worker on the letter engine (no model): the worker's job end records the
batch's end and dispatches the outbox. The figure is the time from the last job's end hook (called just after the
end's transaction and the dispatch) to the receiver's arrival; the second figure, for an event pushed onto the outbox
by a producer that does not dispatch, is the periodic dispatch's worst case plus the same delivery.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import click
from redis import Redis
from rq import Worker

from benchmarks.private_redis import private_redis
from rqbatcher.client import Client
from rqbatcher.jobs import keys
from rqbatcher.webhooks import endpoints
from rqbatcher.webhooks.delivery import DELIVERY_QUEUE
from rqbatcher.workers.job_worker.worker import JobWorker
from tests.letter_engine import LetterEngine

QUEUE = "webhook-latency"
TENANT = "key-00000000bench000"
ARRIVAL_TIMEOUT_S = 30.0
WORKER_START_TIMEOUT_S = 30.0
POLL_S = 0.005


class Receiver(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.arrivals: dict[str, float] = {}  # the event's subject (batch id) -> arrival time


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802  (http.server's name)
        arrived = time.time()
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.server.arrivals[body["data"]["id"]] = arrived
        self.send_response(204)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def arrival(receiver: Receiver, subject: str) -> float:
    deadline = time.monotonic() + ARRIVAL_TIMEOUT_S
    while subject not in receiver.arrivals:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no webhook for {subject} within {ARRIVAL_TIMEOUT_S} s")
        time.sleep(POLL_S)
    return receiver.arrivals[subject]


def batch_end_latency(connection: Redis, receiver: Receiver, lines: int) -> float:
    """Seconds from a batch's end (its last job's end hook) to its `batch.completed` webhook's arrival."""
    client = Client(connection, queue=QUEUE, max_queue_length=None)
    body = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                        "body": {"prompt": f"p{i}", "max_tokens": 2}}) for i in range(lines)]
    batch = client.create_batch(body, owner=TENANT)
    ends: list[float] = []
    JobWorker(keys.priority_queue_names([QUEUE]), LetterEngine(max_num_seqs=lines), connection=connection,
              on_job_end=lambda _worker, _end: ends.append(time.time())).work(burst=True)
    return arrival(receiver, batch.id) - ends[-1]


def undispatched_latency(connection: Redis, receiver: Receiver, round_: int) -> float:
    """Seconds from an outbox push that nobody dispatches to its webhook's arrival."""
    subject = f"batch_undispatched{round_}"
    pushed = time.time()
    connection.rpush(keys.WEBHOOK_OUTBOX, json.dumps({"type": "batch.completed", "id": subject, "tenant": TENANT,
                                                      "created_at": int(pushed)}))
    return arrival(receiver, subject) - pushed


def describe(name: str, figures: list[float]) -> str:
    ms = sorted(f * 1000 for f in figures)
    return (f"{name}: median {statistics.median(ms):.0f} ms, max {ms[-1]:.0f} ms over {len(ms)} rounds "
            f"({', '.join(f'{m:.0f}' for m in ms)})")


@click.command()
@click.option("--rounds", type=click.IntRange(1), default=10, show_default=True)
@click.option("--lines", type=click.IntRange(1), default=4, show_default=True, help="Lines per batch.")
def main(rounds: int, lines: int) -> None:
    receiver = Receiver()
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    with private_redis() as connection:
        url = "redis://127.0.0.1:{port}/0".format(**connection.connection_pool.connection_kwargs)
        endpoints.add(connection, f"http://127.0.0.1:{receiver.server_address[1]}/hook", tenant=TENANT,
                      allow_private_addresses=True)
        worker = subprocess.Popen([sys.executable, "-m", "rqbatcher", "webhooks", "worker", "--redis-url", url],
                                  stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + WORKER_START_TIMEOUT_S
            while not Worker.all(connection=connection, queue=None) or not any(
                    DELIVERY_QUEUE in w.queue_names() for w in Worker.all(connection=connection)):
                if time.monotonic() > deadline:
                    raise TimeoutError("the webhooks worker did not start")
                time.sleep(0.1)
            time.sleep(1.0)  # idle: blocked on the queue
            ended = [batch_end_latency(connection, receiver, lines) for _ in range(rounds)]
            undispatched = [undispatched_latency(connection, receiver, r) for r in range(rounds)]
        finally:
            worker.terminate()
            worker.wait()
    receiver.shutdown()
    click.echo(describe("batch end -> batch.completed webhook", ended))
    click.echo(describe("outbox push, no dispatch -> webhook (the periodic dispatch)", undispatched))


if __name__ == "__main__":
    main()
