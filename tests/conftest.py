import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded in tests; fail fast instead of retrying
# Triton kernels on CPU tensors run in triton's interpreter, which `@triton.jit` reads when a kernel is defined
# (rqbatcher.kernels.triton_kernels, imported on first use). `make gpu-check` sets it to 0 to run them on the GPU.
os.environ.setdefault("TRITON_INTERPRET", "1")
# A test run builds the CPU kernels its sources need, as `make setup` does (a worker never builds unless asked):
# after an edit of kernels/csrc, the kernel tests rebuild rather than skip to torch's kernels.
os.environ.setdefault("BATCHER_BUILD_KERNELS", "1")

import pytest  # noqa: E402

from tests.tiny_models import FAMILIES, build_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Build each tiny model family once per test session: tiny_model_dir("llama") -> Path."""
    built = {}

    def get(family: str = "llama"):
        if family not in built:
            built[family] = build_tiny_model(family, tmp_path_factory.mktemp(f"tiny-{family}"))
        return built[family]

    return get


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    return request.param


def pytest_collection_modifyitems(config, items):
    """The long variants (`@pytest.mark.slow`) run only when asked for with a marker expression (`pytest -m slow`,
    `-m triton`), as tests/reliability/conftest.py does for its own."""
    if config.getoption("markexpr"):
        return
    skip = pytest.mark.skip(reason="a long variant: run it with `pytest -m slow`")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
