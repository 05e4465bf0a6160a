"""What int8 weights (`--quantization int8`) cost in quality: the model in float32 against the same model on int8
weights (`rqbatcher.workers.model.int8_linear`).

    python -m benchmarks.int8_quality [--model smollm2] [--threads 1] [--text FILE] [--json int8-quality.json]

- perplexity over a held-out text (benchmarks/data/held_out.txt: original everyday prose, in no training set by
  construction; or --text, any UTF-8 file), in windows of --window tokens, each scored on its own (the first token of
  a window predicts nothing); transformers' forward of the model, once with its own linears and once with
  `quantize_linears` applied. The bundled text is 2,375 of SmolLM2's tokens: too few to tell changes of a few tenths
  of a percent apart (x's scales as powers of two scored +0.82% against +0.78% on it, +1.29% against +0.65% over
  24,576 tokens of docs/*.md), so score a longer text of your own before trusting such a difference;
- the most likely next token at each position of the text (teacher-forced), the same or not in both;
- greedy agreement through the engine (`build_engine`, float32, then float32 with `quantization="int8"`): the first
  --prompts requests of the bundled summarise workload, --max-tokens tokens each (EOS ignored), all at once; the
  fraction of generated tokens equal at the same position, and where each request's tokens first differ. The
  workload's prompts are random token ids, where a model's top two next tokens are often within 0.1 logit of each
  other: greedy tokens part early at the first such near tie and rarely meet again, so this is the harsher figure;
- the bytes of the quantized linears' weights in both forms.
Prints a markdown table with the CPU, and the whole report as JSON with --json. About 2 minutes at one thread on
SmolLM2-135M on a 2-core AMD EPYC with the native int8 kernel, about 4 where only torch's reference runs the int8
linears (5.3 s against 2.3 s for a 512-token window, 374 against 37 ms for one row).
"""

from __future__ import annotations

import copy
import json
import math
import statistics
import time
from pathlib import Path

import click
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rqbatcher.config import DEFAULT_MODEL, QUANTIZATION_INT8, QUANTIZATION_NONE, EngineConfig
from rqbatcher.schema import GenerationRequest, SamplingParams
from rqbatcher.workers.bench.report import cpu_name
from rqbatcher.workers.bench.workload import load_workload
from rqbatcher.workers.engine.engine import build_engine
from rqbatcher.workers.model.int8_linear import native_int8, quantizable, quantize_linears
from rqbatcher.workers.model.loading import resolve

HELD_OUT = Path(__file__).parent / "data" / "held_out.txt"
WORKLOAD = "summarise"
DEFAULT_WINDOW = 512
DEFAULT_PROMPTS = 8
DEFAULT_MAX_TOKENS = 64
MB = 1 << 20


def perplexity(model: torch.nn.Module, ids: list[int], window: int) -> tuple[float, torch.Tensor]:
    """exp of the mean negative log-likelihood of every token but each window's first, windows scored apart; and the
    model's most likely next token at each of those positions."""
    total, count, top = 0.0, 0, []
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, window):
            chunk = torch.tensor([ids[start : start + window]])
            if chunk.shape[1] < 2:
                break
            logits = model(input_ids=chunk).logits[0, :-1].float()
            total += torch.nn.functional.cross_entropy(logits, chunk[0, 1:], reduction="sum").item()
            count += chunk.shape[1] - 1
            top.append(logits.argmax(-1))
    return math.exp(total / count), torch.cat(top)


def weight_megabytes(model: torch.nn.Module) -> dict[str, float]:
    """The quantized linears' weights: float32 bytes before, int8 weights plus scales after."""
    linears = quantizable(model)
    float_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    int8_bytes = sum(m.weight.numel() + 4 * m.weight.shape[0] for m in linears)  # the scales are float32 per row
    return {"float32": float_bytes / MB, "int8": int8_bytes / MB}


def generate(model_path: str, quantization: str, prompts: list[list[int]], max_tokens: int) -> tuple[list, float]:
    """Every prompt's greedy tokens on one engine, all added at once; and the wall time of the run."""
    engine = build_engine(EngineConfig(model=model_path, dtype="float32", quantization=quantization,
                                       max_num_seqs=len(prompts)))
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add(f"p{i}", GenerationRequest(prompt_token_ids=prompt, sampling=sampling))
    finals = {}
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.token_ids
    return [finals[f"p{i}"] for i in range(len(prompts))], time.perf_counter() - started


def agreement(exact: list[list[int]], approximate: list[list[int]]) -> dict:
    same = sum(a == b for x, y in zip(exact, approximate) for a, b in zip(x, y))
    total = sum(len(x) for x in exact)
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(exact, approximate)]
    return {"identical_tokens": same / total, "identical_requests": sum(x == y for x, y in zip(exact, approximate)),
            "first_difference": first, "median_first_difference": statistics.median(first)}


class TextError(ValueError):
    """A text that perplexity cannot be scored on."""


def text_ids(tokenizer, text: Path) -> list[int]:
    """The token ids of the UTF-8 file `text`, at least 2 of them."""
    try:
        ids = tokenizer(text.read_text(encoding="utf-8"))["input_ids"]
    except UnicodeDecodeError as exc:
        raise TextError(f"{text} is not UTF-8 text ({exc})") from None
    if len(ids) < 2:
        raise TextError(f"{text} has {len(ids)} token(s): perplexity needs at least 2")
    return ids


def run(model: str, threads: int, window: int, num_prompts: int, max_tokens: int, text: Path = HELD_OUT) -> dict:
    torch.set_num_threads(threads)
    path = resolve(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = text_ids(tokenizer, text)
    float_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    megabytes = weight_megabytes(float_model)
    int8_model = copy.deepcopy(float_model)
    linears = quantize_linears(int8_model)
    timings, scores, top = {}, {}, {}
    for name, candidate in ((QUANTIZATION_NONE, float_model), (QUANTIZATION_INT8, int8_model)):
        started = time.perf_counter()
        scores[name], top[name] = perplexity(candidate, ids, window)
        timings[name] = time.perf_counter() - started
    vocab = float_model.get_output_embeddings().weight.shape[0]  # what `batcher bench` draws the prompts' ids below
    del float_model, int8_model
    prompts = [w.prompt_token_ids(vocab) for w in load_workload(WORKLOAD)[:num_prompts]]
    exact, exact_s = generate(path, QUANTIZATION_NONE, prompts, max_tokens)
    approximate, approximate_s = generate(path, QUANTIZATION_INT8, prompts, max_tokens)
    return {"cpu": cpu_name(), "threads": threads, "model": model, "torch": torch.__version__,
            "int8_kernel": "native kernel" if native_int8(torch.device("cpu")) else "torch reference",
            "quantized_linears": linears, "text": text.name, "text_tokens": len(ids), "window": window,
            "perplexity": scores, "perplexity_s": timings,
            "next_token_agreement": (top[QUANTIZATION_NONE] == top[QUANTIZATION_INT8]).float().mean().item(),
            "linear_weights_mb": megabytes,
            "greedy": {"workload": WORKLOAD, "prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)),
                       "max_tokens": max_tokens, **agreement(exact, approximate),
                       "engine_s": {QUANTIZATION_NONE: exact_s, QUANTIZATION_INT8: approximate_s}}}


def table(report: dict) -> str:
    ppl, greedy, mb, secs = (report["perplexity"], report["greedy"], report["linear_weights_mb"],
                             report["perplexity_s"])
    change = ppl[QUANTIZATION_INT8] / ppl[QUANTIZATION_NONE] - 1
    lines = [f"{report['model']} on {report['cpu']}, {report['threads']} thread(s), torch {report['torch']}; "
             f"int8 linears on the {report['int8_kernel']} ({report['quantized_linears']} linears)", "",
             "| | float32 | int8 |", "|---|---|---|",
             f"| perplexity ({report['text_tokens']} tokens of {report['text']}, windows of {report['window']}) | "
             f"{ppl[QUANTIZATION_NONE]:.3f} | {ppl[QUANTIZATION_INT8]:.3f} ({change:+.2%}) |",
             f"| most likely next token, teacher-forced on the text | - | "
             f"{report['next_token_agreement']:.1%} the same as float32's |",
             f"| greedy tokens identical ({greedy['prompts']} {greedy['workload']} prompts x {greedy['max_tokens']}) "
             f"| - | {greedy['identical_tokens']:.1%} ({greedy['identical_requests']}/{greedy['prompts']} requests "
             f"whole; first difference at median token {greedy['median_first_difference']:g}) |",
             f"| quantized linears' weights | {mb['float32']:.0f} MB | {mb['int8']:.0f} MB |",
             f"| perplexity pass / engine run | {secs[QUANTIZATION_NONE]:.0f} s / "
             f"{greedy['engine_s'][QUANTIZATION_NONE]:.0f} s | {secs[QUANTIZATION_INT8]:.0f} s / "
             f"{greedy['engine_s'][QUANTIZATION_INT8]:.0f} s |"]
    return "\n".join(lines)


@click.command()
@click.option("--model", default=DEFAULT_MODEL, show_default=True,
              help="A local folder, a GGUF file, a hub id or smollm2.")
@click.option("--threads", type=click.IntRange(1), default=1, show_default=True, help="torch CPU threads.")
@click.option("--window", type=click.IntRange(2), default=DEFAULT_WINDOW, show_default=True,
              help="Tokens per perplexity window.")
@click.option("--prompts", "num_prompts", type=click.IntRange(1), default=DEFAULT_PROMPTS, show_default=True,
              help="Requests of the summarise workload for greedy agreement.")
@click.option("--max-tokens", type=click.IntRange(1), default=DEFAULT_MAX_TOKENS, show_default=True)
@click.option("--text", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=HELD_OUT,
              help="A UTF-8 text to score perplexity on.  [default: the bundled held-out text]")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the report as JSON.")
def main(model: str, threads: int, window: int, num_prompts: int, max_tokens: int, text: Path,
         json_path: str | None) -> None:
    try:
        report = run(model, threads, window, num_prompts, max_tokens, text)
    except TextError as exc:
        raise click.BadParameter(str(exc), param_hint="--text") from None
    click.echo(table(report))
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
