"""compose.yaml: the local cluster's services agree with the code and with each other."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from rqbatcher.jobs.keys import DEFAULT_QUEUE
from tests.deploy.deploy_files import (
    COMPOSE_FILE,
    GATEWAY_DNS_NAME,
    GPU_WORKERS,
    HA_SERVICES,
    MIN_GRACE_S,
    ROOT,
    SENTINELS,
    WORKER_DNS_NAME,
    WORKERS,
    dockerfile_stages,
    flag,
    seconds,
    serve_flags,
    webhook_worker_command,
)


def test_compose_has_every_service(compose):
    assert set(compose["services"]) == {"redis", *WORKERS, "gateway", "webhooks", "producer", "rq-dashboard",
                                        "prometheus", "grafana", *HA_SERVICES}


def test_compose_redis_keeps_an_append_only_file(compose):
    redis = compose["services"]["redis"]
    assert flag(redis["command"], "--appendonly") == "yes"
    assert any(v.endswith(":/data") for v in redis["volumes"])
    assert redis["healthcheck"]["test"][-2:] == ["redis-cli", "ping"]


@pytest.mark.parametrize("name", WORKERS)
def test_compose_workers_drain_serve_metrics_and_share_a_dns_name(compose, name, metrics_port):
    worker = compose["services"][name]
    command = worker["command"]
    assert command[0] == "worker"
    assert flag(command, "--queue") == DEFAULT_QUEUE  # the producer submits to the default queue
    assert flag(command, "--metrics-port") == metrics_port
    assert flag(command, "--metrics-addr") == "0.0.0.0"
    assert worker["environment"]["BATCHER_REDIS_URL"].startswith("redis://redis:")
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
    assert worker["stop_signal"] == "SIGTERM"
    assert seconds(worker["stop_grace_period"]) >= MIN_GRACE_S
    assert worker["restart"] == "on-failure"  # a drained worker (exit 0) stays down
    assert f"127.0.0.1:{metrics_port}/metrics" in " ".join(worker["healthcheck"]["test"])
    assert WORKER_DNS_NAME in worker["networks"]["default"]["aliases"]


def test_compose_cpu_workers_by_default_gpu_workers_in_a_profile(compose):
    services = compose["services"]
    cpu = services["worker"]
    assert "profiles" not in cpu and cpu["deploy"]["replicas"] == 2
    assert flag(cpu["command"], "--device") == "cpu"
    device_ids = []
    for name in GPU_WORKERS:
        gpu = services[name]
        assert gpu["profiles"] == ["gpu"]
        assert flag(gpu["command"], "--device") == "cuda"
        assert gpu["build"]["args"]["TORCH_VARIANT"].startswith("cu")
        (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        device_ids += device["device_ids"]
    assert len(set(device_ids)) == len(GPU_WORKERS)  # one GPU each, never shared
    assert all("profiles" not in s for n, s in services.items() if n not in (*GPU_WORKERS, *HA_SERVICES))


def test_compose_producer_submits_the_bundled_samples_once(compose):
    producer = compose["services"]["producer"]
    assert producer["restart"] == "no"
    assert producer["command"][:2] == ["submit", "--file"]
    assert producer["depends_on"]["redis"]["condition"] == "service_healthy"
    assert producer["volumes"] == ["./batcher/data:/samples:ro"]
    assert producer["command"][2] == "/samples/samples.jsonl"
    assert (ROOT / "batcher" / "data" / "samples.jsonl").is_file()


def test_compose_dashboard_reads_json_jobs(compose):
    dashboard = compose["services"]["rq-dashboard"]
    assert "--json" in dashboard["command"]
    assert dashboard["build"]["target"] == "dashboard"


def test_compose_builds_stages_that_exist_and_mounts_files_that_exist(compose):
    stages = dockerfile_stages()
    for name, service in compose["services"].items():
        if "build" in service:
            assert service["build"]["dockerfile"] == "deploy/Dockerfile"
            assert service["build"]["target"] in stages, name
        for volume in service.get("volumes", []):
            host = volume.split(":")[0]
            if host.startswith("./"):
                assert (ROOT / host).exists(), f"{name} mounts missing {host}"
        for published in service.get("ports", []):
            assert published.startswith("127.0.0.1:"), f"{name} publishes {published} beyond loopback"


def test_compose_ha_profile_adds_a_replica_three_sentinels_and_a_pool_that_follows_the_primary(compose):
    from rqbatcher.jobs.connection import parse_sentinel_url

    services = compose["services"]
    assert all(services[name]["profiles"] == ["ha"] for name in HA_SERVICES)
    redis, replica = services["redis"], services["redis-replica"]
    for node in (redis, replica):  # either may be the primary after a failover
        assert flag(node["command"], "--appendonly") == "yes" and flag(node["command"], "--maxmemory-policy") == \
            "noeviction"
    assert replica["command"][replica["command"].index("--replicaof") + 1:][:2] == ["redis", "6379"]
    assert any(v.endswith(":/data") for v in replica["volumes"])
    monitored = set()
    for name in SENTINELS:
        config = services[name]["command"][-1]
        service, host, port, quorum = re.search(r"sentinel monitor (\S+) (\S+) (\d+) (\d+)", config).groups()
        assert (host, port) == ("redis", "6379") and int(quorum) == len(SENTINELS) // 2 + 1
        assert "--sentinel" in config and "announce-hostnames yes" in config
        monitored.add(service)
    (service,) = monitored
    for name, plain in (("worker-ha", "worker"), ("gateway-ha", "gateway"), ("webhooks-ha", "webhooks")):
        target = parse_sentinel_url(services[name]["environment"]["BATCHER_REDIS_URL"])
        assert target.service == service and sorted(target.sentinels) == [(s, 26379) for s in SENTINELS]
        assert services[name]["command"] == services[plain]["command"]
    assert services["gateway-ha"]["environment"]["BATCHER_API_KEYS"] == \
        services["gateway"]["environment"]["BATCHER_API_KEYS"]


def compose_command() -> list[str] | None:
    """`docker compose` where the plugin is installed, else the standalone `docker-compose`."""
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return [shutil.which("docker-compose")] if shutil.which("docker-compose") else None


@pytest.mark.parametrize("profile", [[], ["--profile", "gpu"], ["--profile", "ha"]], ids=["default", "gpu", "ha"])
def test_docker_compose_config_accepts_the_file(profile):
    command = compose_command()
    if command is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed")
    result = subprocess.run([*command, "-f", str(COMPOSE_FILE), *profile, "config", "-q"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr




def test_compose_gateway_listens_with_keys_on_loopback_and_is_health_checked(compose, gateway_port):
    gateway = compose["services"]["gateway"]
    command = gateway["command"]
    assert command[0] == "serve" and {a for a in command if a.startswith("--")} <= serve_flags()
    assert flag(command, "--host") == "0.0.0.0" and flag(command, "--port") == gateway_port
    assert flag(command, "--queue") == DEFAULT_QUEUE
    assert gateway["ports"] == [f"127.0.0.1:{gateway_port}:{gateway_port}"]
    assert re.fullmatch(r"\$\{BATCHER_API_KEYS:-\S+\}", gateway["environment"]["BATCHER_API_KEYS"])  # never keyless
    assert gateway["environment"]["BATCHER_REDIS_URL"].startswith("redis://redis:")
    assert f"127.0.0.1:{gateway_port}/health" in " ".join(gateway["healthcheck"]["test"])
    assert gateway["depends_on"]["redis"]["condition"] == "service_healthy"
    assert gateway["build"]["target"] == "gateway"
    assert GATEWAY_DNS_NAME in gateway["networks"]["default"]["aliases"]


def test_compose_delivers_webhooks_with_a_light_worker_that_stops_warm(compose):
    """Ended batches and background responses announce themselves on the outbox; only this service delivers them."""
    webhooks = compose["services"]["webhooks"]
    webhook_worker_command(webhooks["command"])
    assert webhooks["build"]["target"] == "gateway" and webhooks["image"] == compose["services"]["gateway"]["image"]
    assert webhooks["environment"]["BATCHER_REDIS_URL"] == compose["services"]["gateway"]["environment"][
        "BATCHER_REDIS_URL"]
    assert webhooks["depends_on"]["redis"]["condition"] == "service_healthy"
    assert webhooks["stop_signal"] == "SIGTERM" and seconds(webhooks["stop_grace_period"]) >= MIN_GRACE_S
    assert webhooks["restart"] == "unless-stopped"
