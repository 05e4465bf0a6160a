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
from pathlib import Path

from redis import Redis

START_TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis_server(directory: Path | str) -> tuple[subprocess.Popen, str]:
    """A redis-server process keeping its files in `directory`, once it answers, and its URL."""
    port = free_port()
    server = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                               "--appendonly", "no", "--dir", str(directory)], stdout=subprocess.DEVNULL)
    connection = Redis(port=port)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            connection.ping()
            return server, f"redis://127.0.0.1:{port}/0"
        except Exception:  # noqa: BLE001  (not up yet)
            if time.monotonic() > deadline or server.poll() is not None:
                server.terminate()
                raise
            time.sleep(0.05)


@contextmanager
def private_redis() -> Iterator[Redis]:
    """A connection to a fresh redis-server that stops (and leaves nothing on disk) when the block ends."""
    directory = tempfile.mkdtemp(prefix="bench-redis-")
    server, url = start_redis_server(directory)
    try:
        yield Redis.from_url(url)
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(directory, ignore_errors=True)
