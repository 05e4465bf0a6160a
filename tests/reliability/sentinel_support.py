"""A Redis Sentinel deployment of our own for the failover tests: a primary with AOF, one replica and three
sentinels (quorum 2, down-after 1 s), all redis-server processes on free loopback ports.

The sentinels enter TILT only after a stall of TILT_TRIGGER_MS, not Sentinel's 2 s. A sentinel whose timer stalls
past the trigger (a loaded or paused host) acts on nothing for 30 s; by then the replica's link to the dead primary
has been down longer than 10 x down-after, so Sentinel never promotes it: with down-after 1 s, no failover at all
(reproduced by SIGSTOPping the sentinels for 2.5 s after a kill: `test_failover.py`). A production down-after of 30 s
leaves 300 s of room."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from redis import Redis

from tests.reliability.support import RedisServer, free_port

SERVICE = "batcher-ha"
QUORUM = 2
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 5000
TILT_TRIGGER_MS = 10_000  # Sentinel's own: 2000 (SENTINEL DEBUG, Redis >= 7.0)
AOF = ("--appendonly", "yes", "--appendfsync", "everysec")


class SentinelCluster:
    """`nodes[0]` starts as the primary; `primary()` asks the sentinels which node is it now."""

    def __init__(self, directory: Path, sentinels: int = 3) -> None:
        self.directory = Path(directory)
        first = RedisServer(self.directory / "node0", *AOF)
        self.nodes = [first, RedisServer(self.directory / "node1", *AOF, "--replicaof", "127.0.0.1", str(first.port))]
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self.sentinels: list[subprocess.Popen] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def start(self) -> SentinelCluster:
        for node in self.nodes:
            node.start()
        self.wait_replicated(self.nodes[0])
        for i, port in enumerate(self.sentinel_ports):
            directory = self.directory / f"sentinel{i}"
            directory.mkdir(parents=True, exist_ok=True)
            config = directory / "sentinel.conf"
            config.write_text(f"port {port}\nbind 127.0.0.1\ndir {directory}\n"
                              f"sentinel monitor {SERVICE} 127.0.0.1 {self.nodes[0].port} {QUORUM}\n"
                              f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
                              f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}\n")
            log = (directory / "sentinel.log").open("a")
            self.sentinels.append(subprocess.Popen(["redis-server", str(config), "--sentinel"], stdout=log,
                                                   stderr=subprocess.STDOUT))
        self.wait_sentinels_agree(self.nodes[0])
        for port in self.sentinel_ports:
            Redis(port=port).execute_command("SENTINEL", "DEBUG", "tilt-trigger", TILT_TRIGGER_MS)
        return self

    def primary(self) -> RedisServer:
        """The node the sentinels name as primary now."""
        for port in self.sentinel_ports:
            try:
                host, primary_port = Redis(port=port, socket_timeout=1).sentinel_get_master_addr_by_name(SERVICE)
            except Exception:  # noqa: BLE001  (a sentinel still starting)
                continue
            return next(n for n in self.nodes if n.port == int(primary_port))
        raise AssertionError("no sentinel answers")

    def wait_sentinels_agree(self, node: RedisServer, timeout: float = 30) -> None:
        """Until every sentinel names `node` primary and sees the other sentinels and the replica."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                states = [Redis(port=p, socket_timeout=1).sentinel_master(SERVICE) for p in self.sentinel_ports]
                if all(s["port"] == node.port and s["num-other-sentinels"] == len(self.sentinel_ports) - 1
                       and s["num-slaves"] >= 1 for s in states):
                    return
            except Exception:  # noqa: BLE001
                pass
            assert time.monotonic() < deadline, "the sentinels did not agree on the primary"
            time.sleep(0.1)

    def wait_replicated(self, primary: RedisServer, timeout: float = 30) -> None:
        """Until `primary` has every other live node as an online replica."""
        deadline = time.monotonic() + timeout
        live = sum(1 for n in self.nodes if n is not primary and n.process is not None)
        while True:
            try:
                info = primary.connection().info("replication")
                online = sum(1 for k, v in info.items() if k.startswith("slave") and v.get("state") == "online")
                if info["role"] == "master" and online >= live:
                    return
            except Exception:  # noqa: BLE001
                pass
            assert time.monotonic() < deadline, f"the replicas of {primary.port} did not come online"
            time.sleep(0.1)

    def kill_primary(self) -> RedisServer:
        """SIGKILL the primary (a crash: what it did not replicate is lost); return it."""
        primary = self.primary()
        primary.stop(signal.SIGKILL)
        return primary

    def wait_failover(self, old: RedisServer, timeout: float = 30) -> RedisServer:
        deadline = time.monotonic() + timeout
        while True:
            new = self.primary()
            if new is not old:
                return new
            assert time.monotonic() < deadline, f"no failover; the sentinels' logs end:\n{self.log_tails()}"
            time.sleep(0.05)

    def log_tails(self, lines: int = 15) -> str:
        tails = []
        for i in range(len(self.sentinel_ports)):
            log = (self.directory / f"sentinel{i}" / "sentinel.log").read_text().splitlines()
            events = [line for line in log if "saved on disk" not in line]
            tails.append(f"sentinel{i}:\n" + "\n".join(events[-lines:]))
        return "\n".join(tails)

    def rejoin(self, node: RedisServer) -> None:
        """Restart a killed node; the sentinels make it a replica of the new primary."""
        node.start()
        self.wait_replicated(self.primary(), timeout=60)

    def stop(self) -> None:
        for process in self.sentinels:
            if process.poll() is None:
                process.kill()
                process.wait()
        for node in self.nodes:
            node.stop(signal.SIGKILL)
