"""A redis-server of the bench's own, on a free loopback port with no persistence, so that its memory and command
figures hold nothing else."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

from redis import Redis

START_TIMEOUT_S = 5.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def private_redis() -> Iterator[Redis]:
    """A connection to a fresh redis-server that stops (and leaves nothing on disk) when the block ends."""
    directory = tempfile.mkdtemp(prefix="bench-redis-")
    port = free_port()
    server = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                               "--appendonly", "no", "--dir", directory], stdout=subprocess.DEVNULL)
    try:
        connection = Redis(port=port)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                connection.ping()
                break
            except Exception:  # noqa: BLE001  (not up yet)
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield connection
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(directory, ignore_errors=True)
