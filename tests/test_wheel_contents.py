"""What the wheel ships: the package and `batcher bench` with its workloads, and nothing that runs only from a
checkout (benchmarks/: experiments, peers, the llama.cpp builder, the roofline, plots; tests/: the fake engines)."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKOUT_ONLY = ("benchmarks", "tests")
BUILD_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def shipped(tmp_path_factory) -> list[str]:
    """The file names in a wheel built from this checkout, with every build output kept out of the checkout."""
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(out),
                            "build", "--build-base", str(out / "build"),
                            "bdist_wheel", "--bdist-dir", str(out / "bdist"), "--dist-dir", str(out / "dist")],
                           cwd=ROOT, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
                           env={**os.environ, "BATCHER_KERNELS_AT_INSTALL": "0"})
    assert built.returncode == 0, built.stderr
    (wheel,) = (out / "dist").glob("rqbatcher-*.whl")
    with zipfile.ZipFile(wheel) as contents:
        return contents.namelist()


def test_batcher_bench_ships_with_its_workloads(shipped):
    assert "rqbatcher/workers/bench/run.py" in shipped and "rqbatcher/workers/entrypoints.py" in shipped
    assert "rqbatcher/workers/bench/workloads/skew-small.jsonl" in shipped


def test_nothing_that_runs_only_from_a_checkout_ships(shipped):
    tops = {name.partition("/")[0] for name in shipped}
    assert {top for top in tops if top != "rqbatcher" and not top.endswith(".dist-info")} == set()
    checkout_only = {path.name for folder in CHECKOUT_ONLY for path in (ROOT / folder).glob("*.py")} - {"__init__.py"}
    assert "letter_engine.py" in checkout_only and "llama_server.py" in checkout_only
    assert sorted(name for name in shipped if name.rpartition("/")[2] in checkout_only) == []
    assert [name for name in shipped if "experiments" in name or name.endswith("schemas/suite.jsonl")] == []
