"""The names this package installs are its own (the registry's `batcher`, `workers` and `kernels` belong to others),
and the newest transformers, which requires Hugging Face's `kernels`, serves a model beside it, from a checkout too.
"""

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from packaging.version import Version

from tests.engine_helpers import engine_for, greedy, reference_tokens, run_all

ROOT = Path(__file__).resolve().parents[1]
OUR_NAME = "rqbatcher"
OTHERS_NAMES = ("batcher", "workers", "kernels")  # distributions on the package registry that are not ours
KERNELS_REQUIRED_FROM = Version("5.25")  # the first transformers that requires Hugging Face's `kernels`


def test_the_distribution_installs_one_top_level_name_of_its_own():
    provided = {name for name, dists in importlib.metadata.packages_distributions().items() if OUR_NAME in dists}
    assert importlib.metadata.distribution(OUR_NAME).metadata["Name"] == OUR_NAME
    assert provided == {OUR_NAME}, provided
    assert not set(OTHERS_NAMES) & provided


def test_transformers_is_not_held_below_its_newest_release():
    (requirement,) = re.findall(r'^\s*"(transformers\b[^"]*)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert "<" not in requirement and "~=" not in requirement and "==" not in requirement, requirement


@pytest.mark.skipif(Version(transformers.__version__) < KERNELS_REQUIRED_FROM,
                    reason="this transformers predates its requirement of Hugging Face's kernels")
def test_the_kernels_name_is_hugging_faces_even_where_the_checkout_is_on_the_path():
    """From the checkout's root (as `python -m rqbatcher` or pytest run there), the folder kernels/ is found first by
    the name `kernels`; transformers must still get Hugging Face's distribution, and ours stays importable."""
    code = ("import kernels, transformers.modeling_utils, rqbatcher.kernels.attention as ours\n"
            "print(kernels.__file__); print(ours.__file__); print(hasattr(kernels, 'kernelize'))")
    shown = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    theirs, ours, has_hub_api = shown.stdout.split()
    installed = importlib.metadata.distribution("kernels").locate_file("kernels")
    assert Path(theirs).resolve().is_relative_to(Path(installed).resolve()), theirs
    assert Path(ours).resolve() == ROOT / "kernels" / "attention.py"
    assert has_hub_api == "True"


def test_a_model_runs_on_the_engine_beside_the_installed_transformers(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    engine = engine_for(model_dir)
    prompts = {"a": [5, 9, 13, 40], "b": [7, 7, 8]}
    for request_id, prompt in prompts.items():
        engine.add(request_id, greedy(prompt, 6))
    finals = run_all(engine)
    for request_id, prompt in prompts.items():
        assert finals[request_id].token_ids == reference_tokens(model_dir, prompt, 6)
