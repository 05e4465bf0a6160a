"""lm-evaluation-harness scores a model served by batcher as it scores the model itself: its `local-completions` backend
against a real `batcher serve` and `batcher worker` (fp32), on a multiple-choice loglikelihood task of our own from
local files, equals its Hugging Face backend on the same tiny model: every per-sample loglikelihood within 1e-3, and
the accuracy exactly.

It scores a continuation with `echo`, `logprobs` and `max_tokens` 1 on /v1/completions, and reads the prompt's logprobs
(workers/engine/logprobs.py) past the context's length."""

from __future__ import annotations

import pytest

from benchmarks.int8_lm_eval import loglikelihoods, write_choice_task
from tests.e2e.gateway_pool import serving
from tests.tiny_models import build_tiny_model

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.tasks import TaskManager  # noqa: E402

pytestmark = pytest.mark.timeout(300)
QUEUE = "lm-eval"
MODEL = "tiny-eval"
TASK = "batcher_tiny_choice"
LOGLIKELIHOOD_TOLERANCE = 1e-3
# Multiple-choice questions of our own (none from the tiny models' training text): sums, colours, opposites
ADDENDS = [(2, 3), (4, 1), (6, 2), (3, 3), (5, 4), (1, 7), (2, 6), (8, 1), (4, 4), (3, 5)]
OPPOSITES = [("hot", "cold"), ("up", "down"), ("left", "right"), ("day", "night"), ("big", "small"),
             ("early", "late"), ("open", "closed"), ("fast", "slow"), ("wet", "dry"), ("light", "dark")]


def documents() -> list[dict]:
    docs = []
    for i, (a, b) in enumerate(ADDENDS):
        wrong = [a + b + 1, a + b + 2, abs(a - b)]
        choices = [f" {n}" for n in wrong[: i % 3] + [a + b] + wrong[i % 3 :]]
        docs.append({"question": f"Question: what is {a} plus {b}\nAnswer:", "choices": choices, "label": i % 3})
    for i, (word, opposite) in enumerate(OPPOSITES):
        others = [w for _, w in OPPOSITES if w != opposite][i % 5 : i % 5 + 2]
        choices = [f" {w}" for w in others[: i % 3] + [opposite] + others[i % 3 :]]
        docs.append({"question": f"Question: the opposite of {word} is\nAnswer:", "choices": choices,
                     "label": i % 3})
    return docs


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm-eval-task")
    write_choice_task(folder, TASK, documents())
    return folder


@pytest.fixture(scope="module")
def served(e2e_redis, tmp_path_factory):
    """A tiny Llama served in fp32 by a worker and a gateway without keys (lm-eval's local-completions sends none):
    (its directory, the completions url)."""
    model_dir = build_tiny_model("llama", tmp_path_factory.mktemp("lm-eval-model"))
    with serving(e2e_redis, model_dir, tmp_path_factory.mktemp("lm-eval-logs"), QUEUE, MODEL, (), 4) as (base, _):
        yield model_dir, f"{base}/v1/completions"


def evaluate(task_dir, model: str, model_args: str) -> dict:
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], batch_size=1, device="cpu",
                                   log_samples=True,
                                   task_manager=TaskManager(include_path=str(task_dir), include_defaults=False))


def test_lm_eval_through_the_gateway_equals_its_hugging_face_backend(served, task_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    model_dir, completions_url = served
    reference = evaluate(task_dir, "hf", f"pretrained={model_dir},dtype=float32")
    through = evaluate(task_dir, "local-completions",
                       f"model={MODEL},base_url={completions_url},tokenizer={model_dir},tokenizer_backend=huggingface,"
                       "tokenized_requests=False,num_concurrent=1,max_retries=1")
    expected, got = loglikelihoods(reference, TASK), loglikelihoods(through, TASK)
    assert sorted(got) == sorted(expected) == list(range(len(documents())))
    for doc_id, values in expected.items():
        assert got[doc_id] == pytest.approx(values, abs=LOGLIKELIHOOD_TOLERANCE), doc_id
    assert through["results"][TASK]["acc,none"] == reference["results"][TASK]["acc,none"]
