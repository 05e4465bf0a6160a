"""Prometheus finds every worker, and the Grafana dashboard queries only metrics the workers expose."""

from __future__ import annotations

import json
import re

import yaml
from prometheus_client import CollectorRegistry

from rqbatcher.jobs.keys import DEFAULT_QUEUE
from rqbatcher.workers.job_worker.engine_metrics import EngineMetrics
from tests.deploy.deploy_files import DEPLOY, WORKER_DNS_NAME
from tests.fake_engine import FakeEngine


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
