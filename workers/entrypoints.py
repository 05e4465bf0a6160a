"""The wiring behind the CLI's commands that run a model: serve a worker, run a file offline, bench, demo.

`batcher/cli/engine_commands.py` is the one CLI module that imports `workers/`, and it imports this module
alone, lazily (the light install has no torch). Each function takes plain values and builds what it needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from rqbatcher.client import connect
from rqbatcher.config import EngineConfig
from rqbatcher.jobs import keys
from rqbatcher.workers.engine.engine import Engine, build_engine

if TYPE_CHECKING:  # the bench harness loads only when `batcher bench` runs, never in `batcher worker`
    from rqbatcher.workers.bench.report import BenchReport
    from rqbatcher.workers.bench.system import System


def serve_worker(redis_url: str, queues: list[str], engine_config: EngineConfig, *, name: str | None,
                 served_model_name: str | None, lease_s: int, burst: bool, metrics_port: int | None,
                 metrics_addr: str, announce: Callable[[str], None]) -> None:
    """Load the model and serve `queues` (most urgent first, each with its priority levels and its model's
    queue) until drained; with `metrics_port`, serve Prometheus metrics too (announced once listening)."""
    from rqbatcher.workers.job_worker.worker import JobWorker

    model_name = served_model_name or engine_config.model
    for queue in queues:
        keys.model_queue(queue, model_name)  # checks the name, before the model loads
    connection = connect(redis_url)
    engine = build_engine(engine_config)
    hooks = {}
    if metrics_port is not None:
        from rqbatcher.workers.job_worker.class_metrics import ClassMetrics, combined_hooks
        from rqbatcher.workers.job_worker.engine_metrics import EngineMetrics

        metrics = EngineMetrics(engine)
        server = metrics.start_http_server(metrics_port, metrics_addr)  # after the model loaded: probes rely on it
        announce(f"metrics on http://{metrics_addr}:{server.server_port}/metrics")
        hooks = combined_hooks(metrics.worker_hooks(), ClassMetrics(engine).worker_hooks())
    JobWorker(keys.priority_queue_names(queues, model=model_name), engine, connection=connection, name=name,
              model_name=model_name, lease_s=lease_s, **hooks).work(burst=burst)


def load_engine(engine_config: EngineConfig) -> Engine:
    """The model loaded into an engine (`dtype="auto"` resolved): a model that cannot load fails here, first."""
    return build_engine(engine_config)


def run_file(engine: Engine, lines: list[str], on_done: Callable[[], None]) -> list[dict]:
    """`batcher run`: an OpenAI batch file's lines through the engine, without Redis; results in input order."""
    from rqbatcher.workers.offline import run_batch

    return run_batch(engine, lines, on_done=on_done)


def parse_system(spec: str) -> System:
    """A bench system from its name (`batcher:continuous@redis`...); ValueError names the known ones."""
    from rqbatcher.workers.bench.system import System

    return System.parse(spec)


def bench(workload: str, systems: list[System], baseline: System, engine_config: EngineConfig, threads: int,
          redis_url: str | None) -> BenchReport:
    """Run a workload (a file, or a bundled name) through `systems` and compare them with `baseline`."""
    from rqbatcher.workers.bench.record import psutil
    from rqbatcher.workers.bench.run import run_bench
    from rqbatcher.workers.bench.workload import load_workload, workload_path

    items = load_workload(workload)
    psutil()  # a missing extra is reported now, not after loading the model
    if any(s.through_redis for s in systems):
        connect(redis_url).ping()  # a Redis that cannot be reached is reported now, not after loading the model
    return run_bench(items, workload_path(workload).stem, systems, baseline, engine_config, threads, redis_url)


def demo(redis_url: str | None, engine_config: EngineConfig, compare: bool) -> None:
    """`batcher demo`: the bundled documents summarised through Redis (embedded where none is given) and a worker."""
    from rqbatcher.workers.demo import run_demo
    from rqbatcher.workers.embedded_redis import embedded_redis

    connection = connect(redis_url) if redis_url else embedded_redis()
    connection.ping()  # a Redis that cannot be reached is reported now, not after loading the model
    run_demo(connection, build_engine(engine_config), compare)

