"""lm-evaluation-harness through the gateway, int8 weights against full precision: lm-eval's `local-completions`
backend scores the same multiple-choice loglikelihood task against a real `batcher serve` and `batcher worker` in
--dtype, then in --dtype with `--quantization int8`.

    python -m benchmarks.int8_lm_eval [--model smollm2] [--dtype auto] [--threads 1] [--json report.json]

- The task is our own, from the held-out text (benchmarks/data/held_out.txt, in no training set): for each sentence
  after a paragraph's first, the context is the paragraph up to it, and the choices are that sentence and three
  others from far away in the text (the right one at a rotating place). A model that reads the context picks the
  sentence that follows it; one that does not is right a quarter of the time.
- `--dtype auto` is resolved once here, as a worker would resolve it, and both workers get the result.
- One redis-server of the bench's own, one gateway, one worker at a time (--threads torch threads); lm-eval sends
  --concurrent requests at once, so the worker batches them as it would any load.
- Reported per run: lm-eval's accuracy and length-normalised accuracy, its wall time; and between the two runs: the
  per-choice loglikelihood difference (mean and largest), and the documents whose pick is the same.

About 4 minutes at one thread on SmolLM2-135M on a 2-core AMD EPYC.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

import click

from benchmarks.bench_worker import start_worker
from benchmarks.gateway_cost import QUEUE, _start_gateway, stop_processes
from benchmarks.private_redis import start_redis_server
from benchmarks.serving import SERVED, wait_until_served
from rqbatcher.config import DEFAULT_MODEL, DTYPES, QUANTIZATION_INT8, QUANTIZATION_NONE
from rqbatcher.workers.bench.report import cpu_name
from rqbatcher.workers.model.loading import resolve

HELD_OUT = Path(__file__).parent / "data" / "held_out.txt"
TASK = "batcher_held_out_next_sentence"
CHOICES = 4
DEFAULT_CONCURRENT = 8
TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {docs}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""


def documents(text: str) -> list[dict]:
    """One document per sentence after its paragraph's first: the paragraph so far, and that sentence among
    CHOICES - 1 others taken evenly spaced from the rest of the text."""
    paragraphs = [re.split(r"(?<=[.!?])\s+", p.strip()) for p in text.split("\n\n") if p.strip()]
    sentences = [s for p in paragraphs for s in p]
    docs, index = [], 0
    for paragraph in paragraphs:
        for place in range(len(paragraph)):
            if place:
                label = len(docs) % CHOICES
                others = [sentences[(index + k * len(sentences) // CHOICES) % len(sentences)]
                          for k in range(1, CHOICES)]
                choices = others[:label] + [paragraph[place]] + others[label:]
                docs.append({"question": " ".join(paragraph[:place]), "choices": [f" {c}" for c in choices],
                             "label": label})
            index += 1
    return docs


def write_choice_task(folder: Path, task: str, docs: list[dict]) -> None:
    """lm-eval's multiple-choice task `task` in `folder` (its `include_path`), from documents of `question`,
    `choices` and `label` (the right choice's index); scored by accuracy and length-normalised accuracy."""
    path = folder / f"{task}.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / f"{task}.yaml").write_text(TASK_YAML.format(task=task, docs=path))


def loglikelihoods(results: dict, task: str) -> dict[int, list[float]]:
    """Each document's loglikelihood of each choice, from `simple_evaluate(..., log_samples=True)`."""
    return {s["doc_id"]: [r[0] for r in s["filtered_resps"]] for s in results["samples"][task]}


def evaluate(base: str, model_dir: Path, task_dir: Path, concurrent: int) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model="local-completions", tasks=[TASK], batch_size=1, log_samples=True,
        model_args=(f"model={SERVED},base_url={base}/v1/completions,tokenizer={model_dir},"
                    f"tokenizer_backend=huggingface,tokenized_requests=False,num_concurrent={concurrent},"
                    "max_retries=1"),
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False))


def one_run(redis_url: str, base: str, settings: dict, quantization: str, directory: Path, task_dir: Path) -> dict:
    """lm-eval against a worker of `quantization`, started for it and stopped after."""
    log = directory / f"worker-{quantization}.log"
    worker = start_worker(redis_url, QUEUE, str(settings["model_dir"]), settings["dtype"], settings["threads"],
                          settings["concurrent"], log, "--served-model-name", SERVED, "--quantization", quantization)
    try:
        wait_until_served(base, worker, log)
        started = time.perf_counter()
        results = evaluate(base, settings["model_dir"], task_dir, settings["concurrent"])
        seconds = time.perf_counter() - started
    finally:
        stop_processes([worker])
    scores = results["results"][TASK]
    return {"acc": scores["acc,none"], "acc_norm": scores["acc_norm,none"], "seconds": seconds,
            "loglikelihoods": loglikelihoods(results, TASK)}


def compare(full: dict, int8: dict) -> dict:
    """How far int8's per-choice loglikelihoods are from full precision's, and how often the pick is the same."""
    gaps = [abs(a - b) for doc, values in full.items() for a, b in zip(values, int8[doc])]
    same = sum(max(range(CHOICES), key=v.__getitem__) == max(range(CHOICES), key=int8[d].__getitem__)
               for d, v in full.items())
    return {"mean_abs_difference": statistics.fmean(gaps), "max_abs_difference": max(gaps), "same_pick": same,
            "documents": len(full)}


def run(model: str, dtype: str, threads: int, concurrent: int) -> dict:
    import torch

    from rqbatcher.workers.model.precision import resolve_dtype

    torch.set_num_threads(threads)
    dtype = resolve_dtype(dtype, torch.device("cpu"))  # once, so that both workers run the same
    settings = {"model_dir": Path(resolve(model)), "dtype": dtype, "threads": threads, "concurrent": concurrent}
    processes = []
    with tempfile.TemporaryDirectory(prefix="int8-lm-eval-") as folder:
        directory = Path(folder)
        task_dir = directory / "task"
        task_dir.mkdir()
        docs = documents(HELD_OUT.read_text())
        write_choice_task(task_dir, TASK, docs)
        os.environ.setdefault("HF_DATASETS_CACHE", str(directory / "datasets"))
        try:
            redis_server, redis_url = start_redis_server(directory)
            processes.append(redis_server)
            gateway, base = _start_gateway(redis_url, directory / "gateway.log")
            processes.append(gateway)
            runs = {q: one_run(redis_url, base, settings, q, directory, task_dir)
                    for q in (QUANTIZATION_NONE, QUANTIZATION_INT8)}
        finally:
            stop_processes(processes)
    return {"cpu": cpu_name(), "model": model, "dtype": dtype, "threads": threads, "concurrent": concurrent,
            "documents": len(docs), "choices": CHOICES, "runs": runs,
            "difference": compare(runs[QUANTIZATION_NONE]["loglikelihoods"],
                                  runs[QUANTIZATION_INT8]["loglikelihoods"])}


def table(report: dict) -> str:
    full, int8, gap = report["runs"][QUANTIZATION_NONE], report["runs"][QUANTIZATION_INT8], report["difference"]
    return "\n".join([
        f"{report['model']} in {report['dtype']} on {report['cpu']}, {report['threads']} thread(s); lm-eval "
        f"local-completions, {report['concurrent']} concurrent; {report['documents']} documents x "
        f"{report['choices']} choices", "",
        f"| | {report['dtype']} | {report['dtype']} + int8 |", "|---|---|---|",
        f"| accuracy | {full['acc']:.3f} | {int8['acc']:.3f} |",
        f"| length-normalised accuracy | {full['acc_norm']:.3f} | {int8['acc_norm']:.3f} |",
        f"| per-choice loglikelihood, int8 against full precision | - | mean |diff| {gap['mean_abs_difference']:.4f}, "
        f"largest {gap['max_abs_difference']:.4f} |",
        f"| documents with the same pick | - | {gap['same_pick']}/{gap['documents']} |",
        f"| lm-eval's wall time | {full['seconds']:.0f} s | {int8['seconds']:.0f} s |"])


@click.command()
@click.option("--model", default=DEFAULT_MODEL, show_default=True, help="A local folder, a hub id or smollm2.")
@click.option("--dtype", type=click.Choice(DTYPES), default="auto", show_default=True,
              help="The full-precision dtype, and the int8 run's activations.")
@click.option("--threads", type=click.IntRange(1), default=1, show_default=True, help="The worker's torch threads.")
@click.option("--concurrent", type=click.IntRange(1), default=DEFAULT_CONCURRENT, show_default=True,
              help="lm-eval's requests at once (and the worker's slots).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the report as JSON.")
def main(model: str, dtype: str, threads: int, concurrent: int, json_path: str | None) -> None:
    report = run(model, dtype, threads, concurrent)
    click.echo(table(report))
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
