"""The lock of one build's folder (`kernels.build`): an `fcntl.flock`, which the kernel drops when its owner dies
however it died, and a record of its owner (pid, host, start) that outlives the owner. A record found by whoever
takes the lock next is a build that never finished: it is logged, and cleared with the partial build. Waits are
bounded and logged at once and every WAIT_LOG_EVERY_S."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path

log = logging.getLogger(__name__)

WAIT_LOG_EVERY_S = 30.0


class NotReady(Exception):
    """Why a build cannot be loaded here now (not built, a failed build, a lock given up on)."""


class Lock:
    """`<folder>.lock` beside a build's folder: an flock, and the record of whoever holds (or held) it. A builder
    builds in `.<folder>.tmp-<pid>` beside them (the partial build a dead owner leaves)."""

    def __init__(self, label: str, folder: Path) -> None:
        self.label, self.folder = label, folder
        self.path = folder.with_name(folder.name + ".lock")
        self.file = None

    def _open(self, create: bool) -> bool:
        try:
            if create:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | (os.O_CREAT if create else 0), 0o666)
        except OSError:
            return False
        self.file = os.fdopen(fd, "r+")
        return True

    def _try(self) -> bool:
        import fcntl

        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def record(self) -> dict | None:
        """What the holder (or a holder that died) wrote: pid, host, started."""
        try:
            return json.loads(self.path.read_text() or "null")
        except (OSError, ValueError):
            return {"pid": "?", "host": "?", "started": None}

    def _describe(self, record: dict | None) -> str:
        record = record or {}
        started = record.get("started")
        running = f" (started {time.time() - started:.0f} s ago)" if isinstance(started, (int, float)) else ""
        return f"pid {record.get('pid', '?')} on {record.get('host', '?')}{running}"

    def _clear_dead_owner(self) -> None:
        """Holding the lock: a record left in it is a build whose owner died before it finished."""
        record = self.record()
        leftovers = sorted(self.folder.parent.glob(f".{self.folder.name}.tmp-*"))
        if record is not None:
            log.warning("the %s CPU kernels' build by %s never finished: its process died and left its lock "
                        "(%s), which is now free; cleared it%s", self.label, self._describe(record), self.path,
                        f" and its partial build ({len(leftovers)} folder(s))" if leftovers else "")
            self.file.seek(0)
            self.file.truncate()
            self.file.flush()
        for folder in leftovers:
            shutil.rmtree(folder, ignore_errors=True)

    def probe(self) -> str | None:
        """Without waiting or building: clear a dead owner's lock; say so if a live one is building now."""
        if not self.path.is_file() or not self._open(create=False):
            return None
        try:
            if self._try():
                self._clear_dead_owner()
                return None
            return f"being built now by {self._describe(self.record())}"
        finally:
            self.close()

    def acquire(self, wait_s: float) -> None:
        """Take the lock, waiting at most `wait_s` with a log line every WAIT_LOG_EVERY_S; NotReady past it."""
        if not self._open(create=True):
            raise NotReady(f"cannot write the build folder {self.path.parent}")
        start, last_log = time.monotonic(), None
        while not self._try():
            now = time.monotonic()
            if now - start > wait_s:
                holder = self._describe(self.record())
                self.close()
                log.warning("gave up waiting for the %s CPU kernels' build by %s after %.0f s (%s)",
                            self.label, holder, wait_s, self.path)
                raise NotReady(f"another build ({holder}) held its lock past {wait_s:.0f} s: {self.path}")
            if last_log is None or now - last_log >= WAIT_LOG_EVERY_S:  # at once, then every WAIT_LOG_EVERY_S
                log.warning("waiting for the %s CPU kernels' build by %s to finish (%s; waited %.0f s, giving up "
                            "after %.0f s)", self.label, self._describe(self.record()), self.path,
                            now - start, wait_s)
                last_log = now
            time.sleep(0.2)
        self._clear_dead_owner()

    def claim(self) -> None:
        self.file.seek(0)
        self.file.truncate()
        self.file.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}))
        self.file.flush()

    def release(self) -> None:
        """After a build that ended (built or failed): nothing is left half-done."""
        self.file.seek(0)
        self.file.truncate()
        self.file.flush()
        self.close()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()  # drops the flock
            self.file = None
