"""The Kubernetes manifests and KEDA scaling agree with the code and with each other."""

from __future__ import annotations

import re

from tests.deploy.deploy_files import (
    DEPLOY,
    GATEWAY_DNS_NAME,
    MIN_GRACE_S,
    WORKER_DNS_NAME,
    flag,
    serve_flags,
    webhook_worker_command,
)


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
            ("Service", "gateway"), ("Service", GATEWAY_DNS_NAME), ("Deployment", "webhooks")} == set(k8s)


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


def test_k8s_delivers_webhooks_with_a_light_worker(k8s):
    deployment = k8s["Deployment", "webhooks"]
    assert deployment["spec"]["replicas"] >= 1  # fixed: the outbox and scheduled retries show in no queue length
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    webhook_worker_command(container["args"])
    (gateway,) = k8s["Deployment", "gateway"]["spec"]["template"]["spec"]["containers"]
    assert container["image"] == gateway["image"]  # no torch, no GPU
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["BATCHER_REDIS_URL"] == {e["name"]: e.get("value") for e in gateway["env"]}["BATCHER_REDIS_URL"]
    assert pod["terminationGracePeriodSeconds"] >= MIN_GRACE_S and pod["securityContext"]["runAsNonRoot"] is True
    assert deployment["spec"]["selector"]["matchLabels"] == deployment["spec"]["template"]["metadata"]["labels"]
