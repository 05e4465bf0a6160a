"""A workload through fresh engines in one process, the formats and thread counts taking turns: ratios between
formats (int8 against bf16) and thread counts that a host's drift between processes does not move. On shared 2-vCPU
hosts the same `batcher bench` run's pace moved by up to 1.2x within minutes, int8's most (docs/benchmark-log.md).

    python -m benchmarks.alternated --workload summarise [--model smollm2] [--formats auto,auto:int8]
                                    [--threads 1,2] [--rounds 2]

A format is `dtype` or `dtype:quantization`, as in `benchmarks.lone_step`. Each round runs every (format, threads)
pair once, the order reversed every other round, each on an engine built as `batcher bench` builds one
(`batcher:continuous`, prefix caching on; `auto` settled once, as `batcher bench` settles it) and freed after. Prints
each run's total tokens per second (prompt plus generated over the run's wall time, as `batcher bench` counts them),
then per round each format's against the first format's at the same threads, and each thread count's against the first
count's in the same format.
"""

from __future__ import annotations

import gc
import itertools

import click

from rqbatcher.config import DEFAULT_MODEL, DEFAULT_QUANTIZATION, EngineConfig
from rqbatcher.workers.bench.report import cpu_name, system_report
from rqbatcher.workers.bench.run import run_batcher, shared_settings
from rqbatcher.workers.bench.system import System
from rqbatcher.workers.bench.workload import WorkloadError, WorkloadRequest, load_workload, shared_prefix_tokens
from rqbatcher.workers.engine.engine import build_engine

SYSTEM = System.parse("batcher:continuous")  # `batcher bench`'s default system


def total_tok_s(config: EngineConfig, threads: int, workload: list[WorkloadRequest]) -> float:
    """One run of the workload on a fresh engine of `config` at `threads`: prompt plus generated tokens a second."""
    config, _ = shared_settings(config, threads)
    run = run_batcher(build_engine(SYSTEM.engine_config(config)), workload, SYSTEM.name)
    return system_report(run, workload, run, shared_prefix_tokens(workload)).total_tok_s


def alternate(workload: list[WorkloadRequest], configs: dict[str, EngineConfig], threads: list[int],
              rounds: int) -> list[dict[tuple[str, int], float]]:
    """Each round's total tokens/s per (format, threads), the pairs run in turn, reversed every other round. `configs`
    should have their dtype resolved (`resolved`): `auto` is a start-up race that each run could settle anew."""
    pairs = list(itertools.product(configs, threads))
    results = []
    for index in range(rounds):
        order = pairs if index % 2 == 0 else pairs[::-1]
        result = {}
        for spec, count in order:
            result[spec, count] = total_tok_s(configs[spec], count, workload)
            gc.collect()  # the engine just run, before the next one loads
        results.append(result)
    return results


def resolved(configs: dict[str, EngineConfig], threads: int) -> dict[str, EngineConfig]:
    """The configs with `dtype="auto"` settled once, at `threads`, as `batcher bench` settles it for its systems."""
    return {spec: shared_settings(config, threads)[0] for spec, config in configs.items()}


def table(results: list[dict[tuple[str, int], float]], formats: list[str], threads: list[int]) -> str:
    """Markdown: a row per round and thread count, each format's tokens/s, its ratio to the first format's, and
    (from the second thread count on) its ratio to the first thread count's."""
    head = ["round", "threads", *formats, *[f"{spec} / {formats[0]}" for spec in formats[1:]]]
    if len(threads) > 1:
        head += [f"{spec}: against {threads[0]} thread(s)" for spec in formats]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for index, result in enumerate(results, 1):
        for count in threads:
            cells = [str(index), str(count), *[f"{result[spec, count]:,.1f}" for spec in formats]]
            cells += [f"{result[spec, count] / result[formats[0], count]:.2f}x" for spec in formats[1:]]
            if len(threads) > 1:
                cells += [f"{result[spec, count] / result[spec, threads[0]]:.2f}x" for spec in formats]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _formats(ctx, param, value: str) -> dict[str, EngineConfig]:
    configs = {}
    for spec in value.split(","):
        dtype, _, quantization = spec.partition(":")
        try:
            configs[spec] = EngineConfig(model=ctx.params.get("model", DEFAULT_MODEL), dtype=dtype or "auto",
                                         quantization=quantization or DEFAULT_QUANTIZATION)
        except ValueError as exc:
            raise click.BadParameter(f"{spec}: {exc}") from None
    return configs


def _thread_counts(ctx, param, value: str) -> list[int]:
    try:
        counts = [int(part) for part in value.split(",")]
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of thread counts") from None
    if any(count < 1 for count in counts):
        raise click.BadParameter("thread counts are at least 1")
    return counts


@click.command()
@click.option("--workload", required=True, help="A workload file, or one `batcher bench` bundles.")
@click.option("--model", default=DEFAULT_MODEL, show_default=True, is_eager=True,
              help="A local model folder, a GGUF file or 'smollm2', as `batcher bench` takes it.")
@click.option("--formats", "configs", default="auto,auto:int8", show_default=True, callback=_formats,
              help="dtype or dtype:quantization, comma-separated; ratios are to the first")
@click.option("--threads", "threads", default="1,2", show_default=True, callback=_thread_counts,
              help="torch thread counts, comma-separated; ratios are to the first")
@click.option("--rounds", type=click.IntRange(1), default=2, show_default=True)
def main(workload: str, model: str, configs: dict[str, EngineConfig], threads: list[int], rounds: int) -> None:
    """Run a workload in several formats and thread counts, in turn in one process, round after round; print each
    round's tokens/s and ratios."""
    try:
        items = load_workload(workload)
    except WorkloadError as exc:
        raise click.BadParameter(str(exc), param_hint="--workload") from None
    configs = resolved(configs, threads[0])
    results = alternate(items, configs, threads, rounds)
    runs = ", ".join(f"{spec} = {config.dtype} weights {config.quantization}" for spec, config in configs.items())
    click.echo(f"{workload} on {cpu_name()}, {model} ({runs}): total tokens/s (prompt plus generated), {rounds} "
               "round(s) alternated in one process")
    click.echo(table(results, list(configs), threads))


if __name__ == "__main__":
    main()
