"""`batcher demo`: the whole system in one process, on the bundled model.

A JobWorker serves a queue from a thread, the bundled sample documents are enqueued as
summarisation jobs, and their streams are followed live. With `compare`, the same jobs then run
under static batching on the same model, so the two figures come from one run.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from importlib import resources

import click
from redis import Redis

from rqbatcher.client import Client, JobFailed
from rqbatcher.config import EngineConfig
from rqbatcher.openai.batch_lines import parse_batch_line
from rqbatcher.schema import GenerationRequest
from rqbatcher.workers.engine.engine import Engine
from rqbatcher.workers.job_worker.worker import JobWorker

SAMPLES = "samples.jsonl"
REDRAW_S = 0.5
RESULT_TIMEOUT_S = 900


@dataclass
class Progress:
    """What the screen shows of one job; written by its stream follower, read by the renderer."""

    name: str
    state: str = "queued"
    text: str = ""
    tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def sample_requests() -> list[tuple[str, GenerationRequest]]:
    lines = (resources.files("rqbatcher.data") / SAMPLES).read_text().splitlines()
    return [parse_batch_line(line) for line in lines if line.strip()]


def _follow(client: Client, job_id: str, progress: Progress) -> None:
    for event in client.stream(job_id, timeout=RESULT_TIMEOUT_S):
        with progress.lock:
            if event.type == "restart":
                progress.text, progress.tokens = "", 0
            elif event.type == "start":
                progress.state = "running"
            elif event.type == "token":
                progress.text += event.text
                progress.tokens += len(event.token_ids)
            elif event.type == "done":
                progress.state = event.finish_reason
            else:
                progress.state = "failed"


def _render(rows: list[Progress], first: bool) -> None:
    width = shutil.get_terminal_size((100, 20)).columns
    if not first:
        sys.stdout.write(f"\x1b[{len(rows)}A")
    for p in rows:
        with p.lock:
            tail = " ".join(p.text.split())[-(width - 32):]
            line = f"{p.name[:12]:<12} {p.state:<9} {p.tokens:>4} tok  {tail}"
        sys.stdout.write("\x1b[2K" + line[: width - 1] + "\n")
    sys.stdout.flush()


def run_jobs(connection: Redis, engine: Engine, queue: str, live: bool) -> tuple[dict, float]:
    """Serve `queue` with a worker thread, enqueue the samples, follow them; return results and wall time."""
    client = Client(connection, queue=queue)
    requests = sample_requests()
    worker = JobWorker([queue], engine, connection=connection, name=f"demo-{queue}")
    started = time.monotonic()
    job_ids = client.submit_many([request for _, request in requests])
    serving = threading.Thread(target=worker.work, kwargs={"burst": True, "logging_level": "WARNING"}, daemon=True)
    serving.start()
    rows = [Progress(custom_id) for custom_id, _ in requests]
    followers = [threading.Thread(target=_follow, args=(client, j, p), daemon=True) for j, p in zip(job_ids, rows)]
    for t in followers:
        t.start()
    first = True
    while live and any(t.is_alive() for t in followers):
        _render(rows, first)
        first = False
        time.sleep(REDRAW_S)
    if live:
        _render(rows, first)
    results = {}
    for job_id, p in zip(job_ids, rows):
        try:
            results[p.name] = client.result(job_id, timeout=RESULT_TIMEOUT_S)
        except JobFailed as exc:  # shown, not fatal: the other jobs' summaries still count
            results[p.name] = exc
    wall = time.monotonic() - started
    serving.join()
    return results, wall


def _generated(results: dict) -> int:
    return sum(r.usage.completion_tokens for r in results.values() if not isinstance(r, JobFailed))


def run_demo(connection: Redis, engine: Engine, compare: bool) -> None:
    live = sys.stdout.isatty()
    engine.warm_up()
    click.echo(f"Summarising {len(sample_requests())} documents with {engine.loaded.name}, "
               f"{engine.config.max_num_seqs} slots, continuous batching:\n")
    results, wall = run_jobs(connection, engine, "demo", live)
    for name, result in results.items():
        if isinstance(result, JobFailed):
            click.echo(f"\n== {name}: failed ==\n{result}")
            continue
        click.echo(f"\n== {name} ({result.usage.prompt_tokens} prompt tokens, {result.finish_reason}) ==")
        click.echo(result.text.strip())
    generated = _generated(results)
    click.echo(f"\ncontinuous batching: {generated} tokens in {wall:.1f}s = {generated / wall:.1f} tok/s")
    if not compare:
        return
    static = Engine(engine.loaded, EngineConfig(**{**engine.config.__dict__, "policy": "static"}))
    click.echo("\nThe same jobs under static batching (the batch is refilled only once it is empty)...")
    static_results, static_wall = run_jobs(connection, static, "demo-static", live=False)
    static_generated = _generated(static_results)
    click.echo(f"static batching: {static_generated / static_wall:.1f} tok/s; continuous batching: "
               f"{generated / wall:.1f} tok/s, {(generated / wall) / (static_generated / static_wall):.2f}x "
               f"(same jobs, model and slots, measured in this run)")
