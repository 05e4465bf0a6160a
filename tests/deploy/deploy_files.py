"""The deploy files as the tests of tests/deploy read them: compose.yaml, the Kubernetes manifests and Prometheus'
scrape config, and the names they share.

No container engine runs here, so the files are checked for structure; `docker compose config`
(or the older `docker-compose config`) validates compose.yaml where one of them is installed.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = ROOT / "compose.yaml"
GPU_WORKERS = ("worker-gpu-0", "worker-gpu-1")
WORKERS = ("worker", *GPU_WORKERS)
SENTINELS = ("sentinel-1", "sentinel-2", "sentinel-3")
HA_SERVICES = ("redis-replica", *SENTINELS, "worker-ha", "gateway-ha", "webhooks-ha")
WORKER_DNS_NAME = "worker"
GATEWAY_DNS_NAME = "gateway-metrics"
MIN_GRACE_S = 60


def flag(args: list[str], name: str) -> str:
    """The value that follows `name` in an argument list."""
    assert name in args, f"{name} missing from {args}"
    return str(args[args.index(name) + 1])


def seconds(duration: str) -> int:
    """A compose duration such as '120s' or '2m30s', in seconds."""
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", duration)
    assert parts and duration, f"not a duration: {duration!r}"
    h, m, s = (int(p or 0) for p in parts.groups())
    return 3600 * h + 60 * m + s


def dockerfile_stages() -> list[str]:
    return re.findall(r"^FROM \S+ AS (\S+)$", (DEPLOY / "Dockerfile").read_text(), flags=re.MULTILINE)


def serve_flags() -> set[str]:
    from rqbatcher.cli.serve_commands import serve

    return {opt for param in serve.params for opt in param.opts}


def webhook_worker_command(args: list[str]) -> None:
    """Check that `args` (a container's, after the image's `batcher` entrypoint) run `batcher webhooks worker` with
    options it has."""
    import click

    from rqbatcher.cli import main

    assert args[:2] == ["webhooks", "worker"], args
    worker = main.commands["webhooks"].commands["worker"]
    assert isinstance(worker, click.Command)
    known = {opt for param in worker.params for opt in param.opts}
    assert {a for a in args[2:] if a.startswith("--")} <= known, args
