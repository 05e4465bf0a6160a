"""A TCP proxy between workers and Redis that injects network faults on command (no external service).

- `latency(seconds)`: every chunk, in each direction, is passed on this long after it arrived;
- `cut()`: closes every open connection at once, both sides (a pipeline in flight is lost or half-applied);
- `partition()` / `heal()`: nothing passes while partitioned (connections stay open, bytes wait in the proxy),
  and on heal what waited is delivered, late: exactly what a stale worker's writes look like to Redis.
"""

from __future__ import annotations

import socket
import threading
import time

CHUNK = 65536
POLL_S = 0.01


class FaultProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._delay_s = 0.0
        self._open = threading.Event()
        self._open.set()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def latency(self, seconds: float) -> None:
        self._delay_s = seconds

    def partition(self) -> None:
        self._open.clear()

    def heal(self) -> None:
        self._open.set()

    def cut(self) -> int:
        """Close every connection now; return how many there were."""
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            _close(s)
        return len(sockets) // 2

    def close(self) -> None:
        self._closed = True
        _close(self._server)
        self.cut()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(CHUNK)
                if not data:
                    break
                arrived = time.monotonic()
                if self._delay_s:  # from the chunk's arrival: delays of chunks in a row do not add up
                    time.sleep(max(0.0, arrived + self._delay_s - time.monotonic()))
                while not self._open.wait(POLL_S):
                    if self._closed:
                        return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _close(src)
            _close(dst)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()
