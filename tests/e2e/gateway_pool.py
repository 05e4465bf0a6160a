"""One real `batcher worker` and one real `batcher serve` with two tenants' keys on a queue of their own, for the
e2e tests that drive a pool through the `openai` SDK."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager

from tests.e2e.test_urgency import sdk
from tests.e2e.test_workers import start_worker, stop, wait_ready
from tests.jobs_support import wait_for
from tests.reliability.support import free_port

OPEN_GATEWAY_KEY = "any"  # what a client sends to a gateway without keys


@contextmanager
def serving(e2e_redis, model_dir, logs, queue: str, model: str, keys: tuple[str, ...], slots: int,
            *worker_options: str):
    """A worker serving `model_dir` as `model` with `worker_options`, and a gateway with `keys` (none: open) on
    `queue`: (base url, the worker's metrics url), once the gateway lists the model."""
    url, connection = e2e_redis
    port, metrics_port = free_port(), free_port()
    env = {**os.environ, "BATCHER_API_KEYS": ",".join(keys)} if keys else None
    server = subprocess.Popen([sys.executable, "-m", "rqbatcher", "serve", "--port", str(port), "--redis-url", url,
                               "--queue", queue], env=env, stdout=subprocess.DEVNULL,
                              stderr=(logs / f"gateway-{queue}.log").open("w"))
    name, worker = start_worker(url, model_dir, queue, logs / f"worker-{queue}.log", slots,
                                "--served-model-name", model, "--metrics-port", str(metrics_port), *worker_options)
    try:
        wait_ready(connection, name, worker)
        base = f"http://127.0.0.1:{port}"
        key = keys[0] if keys else OPEN_GATEWAY_KEY
        wait_for(lambda: _listed(base, model, key), 60, "the gateway to list the worker's model")
        yield base, f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        stop(server)
        stop(worker)


def _listed(base: str, model: str, key: str) -> bool:
    try:
        return model in [m.id for m in sdk(base, key).models.list()]
    except Exception:  # noqa: BLE001  (not up yet)
        return False
