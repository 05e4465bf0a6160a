"""What one job costs Redis, for sizing a primary (docs/reliability.md, "Scale on paper").

    python -m tests.reliability.redis_cost [--jobs 2000] [--tokens 4] [--slots 32]

Private redis-server processes (a primary, and with --replica one replica), the in-process worker on the test
suite's fake engine (no model: every cost is the job system's), and `INFO commandstats` / `INFO cpu` read
before and after each phase: enqueueing (one `Client.submit` per job, as a gateway does) and serving (the
worker in burst mode). Also the cost of confirming writes on a replica (WAIT) per enqueue pipeline.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from rqbatcher.client import Client
from rqbatcher.jobs import keys
from rqbatcher.jobs.durability import ReplicaWait
from rqbatcher.workers.job_worker.worker import JobWorker
from tests.fake_engine import FakeEngine
from tests.jobs_support import wait_for
from tests.reliability.support import RedisServer

QUEUE = "cost"
WAIT_SAMPLES = 1000


def snapshot(connection) -> tuple[dict[str, int], float]:
    stats = connection.info("commandstats")
    cpu = connection.info("cpu")
    return ({name: int(v["calls"]) for name, v in stats.items()},
            float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]))


def delta(before, after) -> tuple[dict[str, int], float]:
    calls = {k: v - before[0].get(k, 0) for k, v in after[0].items() if v - before[0].get(k, 0) > 0}
    return calls, after[1] - before[1]


def phase(connection, run) -> tuple[dict[str, int], float, float]:
    """(commands by name, Redis CPU seconds, wall seconds) of `run()`."""
    before = snapshot(connection)
    started = time.perf_counter()
    run()
    wall = time.perf_counter() - started
    calls, cpu = delta(before, snapshot(connection))
    calls.pop("cmdstat_info", None)  # our own snapshots
    return calls, cpu, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--replica", action="store_true", help="attach a replica (enqueues and ends then WAIT)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        primary = RedisServer(Path(directory) / "primary", "--appendonly", "yes").start()
        replica = None
        if args.replica:
            replica = RedisServer(Path(directory) / "replica", "--replicaof", "127.0.0.1", str(primary.port)).start()
            wait_for(lambda: primary.connection().info("replication").get("slave0", {}).get("state") == "online",
                     20, "the replica")
        try:
            connection = primary.connection()
            client = Client(connection, queue=QUEUE)
            request = {"prompt": "x", "sampling": {"max_tokens": args.tokens}}
            enqueue = phase(connection, lambda: [client.submit(request) for _ in range(args.jobs)])
            worker = JobWorker(keys.priority_queue_names([QUEUE]), FakeEngine(max_num_seqs=args.slots),
                                 connection=primary.connection())
            serve = phase(connection, lambda: worker.work(burst=True))
            for name, (calls, cpu, wall) in (("enqueue (Client.submit)", enqueue), ("serve (worker)", serve)):
                total = sum(calls.values())
                top = ", ".join(f"{k.removeprefix('cmdstat_')} {v / args.jobs:.1f}"
                                for k, v in sorted(calls.items(), key=lambda kv: -kv[1])[:8])
                print(f"{name}: {total / args.jobs:.1f} commands/job ({top}); Redis CPU {cpu / args.jobs * 1e6:.0f} "
                      f"us/job; {args.jobs / wall:.0f} jobs/s in one process")
            # the price of WAIT: enqueues with and without confirmation, interleaved in the same run, and a PING
            clients = {label: Client(connection, queue="wait-cost", replica_wait=policy, max_queue_length=None)
                       for label, policy in (("no WAIT", ReplicaWait(replicas=0)), ("WAIT", ReplicaWait()))}
            spent = dict.fromkeys([*clients, "PING"], 0.0)
            for _ in range(WAIT_SAMPLES):
                for label, timed in clients.items():
                    started = time.perf_counter()
                    timed.submit(request)
                    spent[label] += time.perf_counter() - started
                started = time.perf_counter()
                connection.ping()
                spent["PING"] += time.perf_counter() - started
            print(", ".join(f"{label} {t / WAIT_SAMPLES * 1e6:.0f} us" for label, t in spent.items())
                  + " (a submit, a round trip)")
        finally:
            if replica is not None:
                replica.stop()
            primary.stop()


if __name__ == "__main__":
    main()
