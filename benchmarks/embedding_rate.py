"""Embedding throughput through Redis and a real worker: many short inputs as one job (batched: each step embeds as
many inputs as the slots and the token budget hold) against one job per input, each submitted once the previous
one's result is back (a client that embeds one text at a time).

    python -m benchmarks.embedding_rate --model smollm2 --inputs 1000 --threads 2 [--through gateway]

`--through gateway` sends them as HTTP requests to a `batcher serve` of its own with the `openai` SDK, as a backend
would: all inputs in one `embeddings.create`, against one call per input. Runs against a redis-server of its own
(`benchmarks.private_redis`); the worker serves `--task embed` in a thread of this process (the bundled SmolLM2
is a causal LM: it embeds from its final hidden states). torch runs on `--threads` threads, set here and printed:
on a shared CPU, threads fight. Prints inputs/s of both runs, their ratio,
and the largest difference between the two runs' vectors (fp32: the batch a row lands in may move its last bits).
"""

from __future__ import annotations

import base64
import contextlib
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import click
import numpy as np
import torch
from openai import OpenAI

from benchmarks.private_redis import private_redis
from rqbatcher.client import Client
from rqbatcher.config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_MODEL,
    TASK_EMBED,
    EngineConfig,
)
from rqbatcher.jobs import keys
from rqbatcher.schema import GenerationRequest, GenerationResult
from rqbatcher.workers.bench.report import environment
from rqbatcher.workers.engine.engine import build_engine
from rqbatcher.workers.job_worker.worker import JobWorker

QUEUE = "embedding-rate"
RESULT_TIMEOUT_S = 3600
GATEWAY_START_S = 60
TOPICS = ["queues", "batches", "streams", "workers", "leases", "tokens", "prefixes", "kernels"]


def short_inputs(n: int) -> list[str]:
    """`n` distinct short sentences (about ten tokens each)."""
    return [f"Sentence {i} is about {TOPICS[i % len(TOPICS)]} and {TOPICS[i * 3 % len(TOPICS)]}." for i in range(n)]


def decoded(result: GenerationResult) -> list[np.ndarray]:
    return [np.frombuffer(base64.b64decode(e), "<f4") for e in result.embeddings]


@contextlib.contextmanager
def gateway(connection, queue: str):
    """The base URL of a `batcher serve` of its own on `connection`'s Redis, stopped when the block ends."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    pool = connection.connection_pool.connection_kwargs
    url = f"redis://{pool['host']}:{pool['port']}/{pool.get('db', 0)}"
    server = subprocess.Popen([sys.executable, "-m", "rqbatcher", "serve", "--port", str(port), "--redis-url", url,
                               "--queue", queue], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + GATEWAY_START_S
        while True:
            try:
                urllib.request.urlopen(f"{base}/health", timeout=1).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise click.ClickException("the gateway did not start") from None
                time.sleep(0.2)
        yield base
    finally:
        server.terminate()
        server.wait()


def sdk_runs(base: str, texts: list[str]):
    """(all inputs in one request, one request per input), through the `openai` SDK."""
    sdk = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=RESULT_TIMEOUT_S)
    model = sdk.models.list().data[0].id

    def vectors(inputs: list[str]) -> list[np.ndarray]:
        return [np.asarray(d.embedding, "<f4") for d in sdk.embeddings.create(model=model, input=inputs).data]

    return (lambda: vectors(texts)), (lambda: [vectors([text])[0] for text in texts])


def client_runs(client: Client, model: str, texts: list[str]):
    """(all inputs in one job, one job per input), through batcher's Client, naming the model as the gateway does
    (an idle worker blocks on its model's queue)."""
    def vectors(inputs: list[str]) -> list[np.ndarray]:
        request = GenerationRequest(embed=inputs, model=model)
        return decoded(client.result(client.submit(request), timeout=RESULT_TIMEOUT_S))

    return (lambda: vectors(texts)), (lambda: [vectors([text])[0] for text in texts])


def timed(run) -> tuple[float, list[np.ndarray]]:
    started = time.perf_counter()
    vectors = run()
    return time.perf_counter() - started, vectors


@click.command()
@click.option("--model", default=DEFAULT_MODEL, show_default=True, help="A model folder, a hub id or smollm2.")
@click.option("--inputs", type=click.IntRange(1, 2048), default=1000, show_default=True)
@click.option("--threads", type=click.IntRange(1), default=2, show_default=True, help="torch CPU threads.")
@click.option("--max-num-seqs", type=click.IntRange(1), default=DEFAULT_MAX_NUM_SEQS, show_default=True)
@click.option("--max-num-batched-tokens", type=click.IntRange(1), default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
              show_default=True)
@click.option("--dtype", default="float32", show_default=True)
@click.option("--through", type=click.Choice(["redis", "gateway"]), default="redis", show_default=True,
              help="redis: jobs through batcher's Client; gateway: HTTP requests with the openai SDK.")
def main(model: str, inputs: int, threads: int, max_num_seqs: int, max_num_batched_tokens: int, dtype: str,
         through: str) -> None:
    torch.set_num_threads(threads)
    engine = build_engine(EngineConfig(model=model, tasks=(TASK_EMBED,), dtype=dtype, max_num_seqs=max_num_seqs,
                                       max_num_batched_tokens=max_num_batched_tokens))
    engine.warm_up()
    device, _ = environment(engine.runner.device)
    texts = short_inputs(inputs)
    with private_redis() as connection:
        client = Client(connection, queue=QUEUE, max_queue_length=None)
        # it polls its model's queue too, where the gateway routes a request that names the model
        worker = JobWorker(keys.priority_queue_names([QUEUE], model=model), engine, connection=connection,
                           model_name=model)
        serving = threading.Thread(target=worker.work, kwargs={"logging_level": "WARNING"}, daemon=True)
        serving.start()
        with contextlib.ExitStack() as stack:
            if through == "gateway":
                all_at_once, one_by_one = sdk_runs(stack.enter_context(gateway(connection, QUEUE)), texts)
            else:
                all_at_once, one_by_one = client_runs(client, model, texts)
            batched_s, batched = timed(all_at_once)
            single_s, single = timed(one_by_one)
        worker.request_stop(None, None)  # drain: nothing is in flight, so it exits at once
        serving.join()
    difference = max(float(np.abs(a - b).max()) for a, b in zip(batched, single, strict=True))
    unit = "request" if through == "gateway" else "job"
    click.echo(f"{device}, torch threads {threads}, {dtype}, model {model}, {max_num_seqs} slots, "
               f"{max_num_batched_tokens} tokens a step, through {through}")
    click.echo(f"{inputs} short inputs as one {unit}: {inputs / batched_s:.1f} inputs/s ({batched_s:.2f} s)")
    click.echo(f"{inputs} one-by-one {unit}s: {inputs / single_s:.1f} inputs/s ({single_s:.2f} s)")
    click.echo(f"batched / one-by-one: {single_s / batched_s:.2f}x; largest difference between their vectors "
               f"{difference:.2e}")


if __name__ == "__main__":
    main()
