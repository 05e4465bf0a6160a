"""The deploy files parsed once per module, as fixtures for tests/deploy."""

from __future__ import annotations

import pytest
import yaml

from tests.deploy.deploy_files import COMPOSE_FILE, DEPLOY, GATEWAY_DNS_NAME


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
