"""The scheduling matrix of issue 43: every workload under every step-policy setting, through the same worker code,
in one run and one table. Every later scheduler change is judged on it.

    python -m benchmarks.scheduling_matrix [--workloads skew-small,doc-qa,...] [--settings default,target-off,...]
        [--threads 1] [--dtype auto] [--quick] [--rounds 2] [--json matrix.json]

Workloads (every request interactive, the class a gateway's or a client's request has by default):
- skew-small, summarise, doc-qa: the bundled `batcher bench` workloads, in this process through the engine, as
  `batcher bench` runs them (prompt plus generated tok/s, TTFT and ITL from arrival, prefix hits);
- interactive: a pure-interactive load of long prompts that share nothing, arriving one every ARRIVAL_GAP_S, in
  this process likewise;
- behind-batch, flood, guidellm-sweep: through a real `batcher serve` and `batcher worker` (SLOTS slots) on a Redis
  of the run's own, with the `openai` SDK and guidellm (benchmarks/mixed_load.py and benchmarks/serving.py):
  five streams at once behind tenant A's batch; tenant A's flood of chat requests, then tenant B's streams one
  after another, each judged; a guidellm sweep of streamed text completions at constant rates, the same for every
  setting: `rates` steps up to the rate guidellm's `throughput` profile reaches under the target off (the
  reference, run first in the first round), so that each rate's row compares the settings at the same offered load.
With --rounds N, each in-process workload, and the gateway's part as a whole, runs N rounds of every setting, the
settings' order reversed each round (A B, B A, ...), and each row keeps its round of best throughput (the streams
behind the batch and the flood: of the least wait over idle), as the issue's own figures were taken: on a shared
machine one round's ratio between two settings that schedule alike is as much noise as policy.
Settings (benchmarks/scheduling_report.py): the default, the target off, and the target off with two fixed token
budgets. The verdicts judge the default against issue 43's targets.

--quick (the whole matrix in minutes on 2 cores) shrinks: the in-process workloads to their first QUICK_REQUESTS
requests (doc-qa: every question of its first QUICK_DOCUMENTS documents), the interactive load to
QUICK.interactive requests, the batch's and the flood's requests to QUICK.tokens tokens, the flood to QUICK.flood
requests over QUICK.connections connections, and the sweep to QUICK.rates rates of QUICK.seconds s each (the batch
keeps its lines: it is cancelled once the streams behind it have their first tokens).
"""

from __future__ import annotations

import json
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import click

from benchmarks import mixed_load, serving
from benchmarks.bench_worker import start_worker
from benchmarks.gateway_cost import _start_gateway, _wait, stop_all, stop_processes
from benchmarks.private_redis import start_redis_server
from benchmarks.scheduling_report import (
    BEHIND_BATCH,
    DOC_QA,
    FLOOD,
    IN_PROCESS,
    INTERACTIVE,
    JUDGED,
    SETTINGS,
    SWEEP,
    TARGET_OFF,
    THROUGH_GATEWAY,
    WORKLOADS,
    Row,
    streams_row,
    table,
    verdict_lines,
    verdicts,
    worker_options,
)
from rqbatcher.config import DTYPES

SLOTS = 32
SERVED = serving.SERVED
CLASS = "interactive"  # of every request measured, but the batch's and the flood's
QUICK_REQUESTS = 16
QUICK_DOCUMENTS = 2
INTERACTIVE_PROMPT_LEN, INTERACTIVE_MAX_TOKENS, ARRIVAL_GAP_S = 1024, 32, 0.25
BURST_STREAMS = 5  # the issue's: five streams at once behind the batch
B_STREAMS = 3  # tenant B's streams behind the flood, one after another
IDLE_REQUESTS = 5
SWEEP_PROMPT_TOKENS, SWEEP_OUTPUT_TOKENS = 128, 32
RATE_DIGITS = 3
CALIBRATION_S = 30.0  # the throughput profile's run: long enough to pass the first prefills of its streams
MIN_SWEEP_REQUESTS = 4  # requests that arrive at each rate of the sweep, however slow the rate


@dataclass(frozen=True)
class Sizes:
    interactive: int  # requests of the interactive load
    batch_lines: int
    tokens: int  # a batch line's and a flood request's
    small_lines: int  # tenant B's batch beside the burst
    flood: int
    connections: int
    rates: int  # of the sweep
    seconds: float  # of each sweep benchmark


FULL = Sizes(interactive=32, batch_lines=600, tokens=64, small_lines=10, flood=200, connections=100, rates=5,
             seconds=30)
QUICK = Sizes(interactive=8, batch_lines=600, tokens=32, small_lines=2, flood=80, connections=48, rates=3,
              seconds=10)


def interactive_load(n: int):
    from rqbatcher.workers.bench.workload import WorkloadRequest

    return [WorkloadRequest(i, f"i{i}", INTERACTIVE_PROMPT_LEN, INTERACTIVE_MAX_TOKENS, i * ARRIVAL_GAP_S)
            for i in range(n)]


def in_process_workload(name: str, sizes: Sizes, quick: bool) -> list:
    from rqbatcher.workers.bench.workload import load_workload

    if name == INTERACTIVE:
        return interactive_load(sizes.interactive)
    workload = load_workload(name)
    if not quick:
        return workload
    if name == DOC_QA:
        documents = list(dict.fromkeys(w.prefix_id for w in workload))[:QUICK_DOCUMENTS]
        return [w for w in workload if w.prefix_id in documents]
    return workload[:QUICK_REQUESTS]


def in_process_row(name: str, workload: list, setting: str, model: str, dtype: str, threads: int) -> Row:
    """The workload through the engine in this process, as `batcher bench` runs it, under `setting`."""
    from rqbatcher.config import EngineConfig
    from rqbatcher.workers.bench.run import run_bench
    from rqbatcher.workers.bench.system import System

    system = System("continuous")
    config = EngineConfig(model=model, dtype=dtype, device="cpu", max_num_seqs=SLOTS, **SETTINGS[setting])
    s = run_bench(workload, name, [system], system, config, threads).systems[0]
    return Row(name, setting, CLASS, tok_s=s.total_tok_s, ttft_p50=s.ttft_s["p50"], ttft_p99=s.ttft_s["p99"],
               itl_p50=s.itl_s["p50"], itl_p99=s.itl_s["p99"], prefix_hits=s.prefix_hit_rate)


def sweep_rates(base: str, s: serving.Settings, directory: Path) -> tuple[float, ...]:
    """`rates` steps up to the rate guidellm's `throughput` profile reaches (as many streams as twice the slots), in
    requests a second: its output tokens a second over a request's, since on a slow CPU few of its requests finish
    within its seconds. Every setting runs it before its sweep, so each sweep starts on a worker that has carried
    the same load (a worker fresh from lighter work ran the lowest rate's steps ~1.4x slower); the reference's
    rates are every setting's."""
    calibration = replace(s, seconds=max(s.seconds, CALIBRATION_S))
    reached = serving.run_guidellm(base, "throughput", calibration, directory, "batcher-calibration")
    output = reached["benchmarks"][0]["metrics"]["output_tokens_per_second"]["total"]["mean"]
    per_s = output / SWEEP_OUTPUT_TOKENS
    if per_s <= 0:
        raise click.ClickException(f"the calibration streamed no output token in {s.seconds} s: no sweep to run")
    return tuple(round(per_s * (i + 1) / s.sweep_size, RATE_DIGITS) for i in range(s.sweep_size))


def sweep_rows(base: str, setting: str, s: serving.Settings, directory: Path) -> list[Row]:
    """Each rate's row; a rate runs long enough for MIN_SWEEP_REQUESTS of its requests to arrive (a slow CPU's
    rates are a fraction of a request a second)."""
    s = replace(s, seconds=max(s.seconds, MIN_SWEEP_REQUESTS / min(s.rates)))
    levels = serving.report.levels(serving.run_guidellm(base, "constant", s, directory, f"batcher-{setting}"))
    ms = lambda v: None if v is None else v / 1000  # noqa: E731
    return [Row(SWEEP, setting, level.label, tok_s=level.output_tokens_per_s, ttft_p50=ms(level.ttft_p50),
                ttft_p99=ms(level.ttft_p99), itl_p50=ms(level.itl_p50), itl_p99=ms(level.itl_p99), position=i)
            for i, level in enumerate(levels)]


def gateway_rows(workloads: list[str], setting: str, model: str, dtype: str, threads: int, sizes: Sizes,
                 here: Path, rates: list[float]) -> list[Row]:
    """The gateway workloads under `setting`: a Redis, a worker and two gateways of their own (one with tenant
    A's and B's keys, one without for guidellm), logs in `here`. The first setting to run the sweep fills `rates`
    for the rest."""
    from rqbatcher.workers.model.loading import resolve

    here.mkdir()
    processes = []
    rows: list[Row] = []
    try:
        redis_server, redis_url = start_redis_server(here)
        processes.append(redis_server)
        processes.append(start_worker(redis_url, mixed_load.QUEUE, model, dtype, threads, SLOTS, here / "worker.log",
                                      "--served-model-name", SERVED, *worker_options(setting)))
        keyed, base = mixed_load._gateway(redis_url, here / "gateway.log")
        processes.append(keyed)
        _wait(lambda: SERVED in [m.id for m in mixed_load._sdk(base, mixed_load.KEY_A).models.list()],
              mixed_load.READY_S, f"the worker ({setting})")
        if BEHIND_BATCH in workloads:
            burst = mixed_load.bench_burst(base, SERVED, sizes.batch_lines, sizes.tokens, sizes.small_lines,
                                           IDLE_REQUESTS, BURST_STREAMS, rounds=1, gap_s=0)
            rows.append(streams_row(BEHIND_BATCH, setting, CLASS, burst["ttft_by_round_s"][0],
                                    burst["interactive_ttft_idle"]["p50_s"]))
        if FLOOD in workloads:
            flood = mixed_load.bench_flood(base, redis_url, SERVED, sizes.flood, sizes.tokens, B_STREAMS,
                                           sizes.connections)
            rows.append(streams_row(FLOOD, setting, f"{CLASS} (tenant B)", flood["b_ttft_each_s"],
                                    flood["interactive_ttft_idle"]["p50_s"]))
        if SWEEP in workloads:
            plain, plain_base = _start_gateway(redis_url, here / "gateway-guidellm.log")
            processes.append(plain)
            s = serving.Settings(Path(resolve(model)), dtype, threads, SLOTS, 0, (), sizes.rates, sizes.seconds,
                                 SWEEP_PROMPT_TOKENS, SWEEP_OUTPUT_TOKENS, rates)
            serving.warm(plain_base, s)
            calibrated = sweep_rates(plain_base, s, here)  # by every setting: the same load before each sweep
            if not rates:
                rates.extend(calibrated)
            rows += sweep_rows(plain_base, setting, replace(s, rates=tuple(rates)), here)
        return rows
    finally:
        stop_processes(processes)


def best_rounds(name: str, settings: list[str], rounds: int, run_one) -> list[Row]:
    """Each row's best over `rounds` rounds, the settings' order reversed every round. `run_one(setting, round_)`
    measures a setting's rows (one in process; through the gateway, one per workload and sweep rate)."""
    best: dict[tuple[str, str, str], Row] = {}  # in the first round's order
    measured: dict[tuple[str, str, str], list[dict]] = {}
    for round_ in range(rounds):
        for setting in settings if round_ % 2 == 0 else settings[::-1]:
            click.echo(f"{name}, {setting}, round {round_ + 1} of {rounds}", err=True)
            for row in run_one(setting, round_):
                click.echo(json.dumps(row.as_dict()), err=True)  # kept in the log should a later part fail
                key = (row.workload, row.setting, row.label)
                measured.setdefault(key, []).append({figure: getattr(row, figure) for figure in JUDGED})
                if key not in best or _better(row, best[key]):
                    best[key] = row
    return [replace(row, rounds=measured[key]) if rounds > 1 else row for key, row in best.items()]


def _better(row: Row, than: Row) -> bool:
    """Of more throughput; for streams judged by their first tokens alone, of the least wait over idle at worst."""
    if row.tok_s is not None or than.tok_s is not None:
        return (row.tok_s or 0) > (than.tok_s or 0)
    return max(row.ttft_each) - (row.idle_ttft_p50 or 0) < max(than.ttft_each) - (than.idle_ttft_p50 or 0)


def run(workloads: list[str], settings: list[str], model: str, dtype: str, threads: int, quick: bool,
        rounds: int, keep_logs: bool) -> dict:
    import torch

    from rqbatcher.workers.model.loading import resolve
    from rqbatcher.workers.model.precision import resolve_dtype

    sizes = QUICK if quick else FULL
    dtype = resolve_dtype(dtype, torch.device("cpu"))  # once: every setting runs in the same one
    directory = Path(tempfile.mkdtemp(prefix="bench-scheduling-"))
    started, rows = time.monotonic(), []
    try:
        for name in [w for w in IN_PROCESS if w in workloads]:  # each workload's settings back to back: same noise
            workload = in_process_workload(name, sizes, quick)
            rows += best_rounds(name, settings, rounds, lambda setting, _: [
                in_process_row(name, workload, setting, str(resolve(model)), dtype, threads)])
        through_gateway, rates = [w for w in THROUGH_GATEWAY if w in workloads], []
        reference_first = sorted(settings, key=lambda s: s != TARGET_OFF)  # the sweep's rates are its
        if through_gateway:
            rows += best_rounds(", ".join(through_gateway), reference_first, rounds, lambda setting, round_:
                                gateway_rows(through_gateway, setting, model, dtype, threads, sizes,
                                             directory / f"{setting}-{round_ + 1}", rates))
    finally:
        stop_all([], directory, keep_logs)
    return {"machine": serving.machine(), "model": model, "dtype": dtype, "threads": threads, "slots": SLOTS,
            "quick": quick, "rounds": rounds, "sizes": asdict(sizes), "settings": {s: SETTINGS[s] for s in settings},
            "sweep_rates_per_s": rates,
            "minutes": round((time.monotonic() - started) / 60, 1), "rows": [r.as_dict() for r in rows],
            "verdicts": verdicts(rows)}


def markdown(out: dict) -> str:
    m = out["machine"]
    head = (f"{m['cpu']}, {m['cpus']} CPUs ({', '.join(m['flags']) or 'no flags of note'}), torch {m['torch']}; "
            f"{out['model']} in {out['dtype']}, {out['threads']} thread(s), {out['slots']} slots"
            f"{', --quick' if out['quick'] else ''}, each row the best of {out['rounds']} alternated round(s); "
            f"{out['minutes']} min")
    return "\n\n".join([head, table([Row(**r) for r in out["rows"]]), verdict_lines(out["verdicts"])])


def _names(choices: tuple[str, ...], option: str):
    def parse(_ctx, _param, value: str) -> list[str]:
        names = [v.strip() for v in value.split(",") if v.strip()]
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise click.BadParameter(f"unknown {', '.join(unknown) or 'nothing'}; choose from {', '.join(choices)}",
                                     param_hint=option)
        return names

    return parse


@click.command()
@click.option("--workloads", default=",".join(WORKLOADS), show_default=True, callback=_names(WORKLOADS, "--workloads"))
@click.option("--settings", default=",".join(SETTINGS), show_default=True, callback=_names(tuple(SETTINGS),
                                                                                              "--settings"))
@click.option("--model", default="smollm2", show_default=True, help="A local model folder, or smollm2.")
@click.option("--dtype", type=click.Choice(DTYPES), default="auto", show_default=True)
@click.option("--threads", type=click.IntRange(1), default=1, show_default=True,
              help="Torch threads of the in-process engine and of the worker.")
@click.option("--quick", is_flag=True,
              help=f"Smaller sizes, the whole matrix in minutes on 2 cores: the first {QUICK_REQUESTS} requests of "
                   f"skew-small and summarise, doc-qa's first {QUICK_DOCUMENTS} documents, {QUICK.interactive} "
                   f"interactive requests, batch lines and a {QUICK.flood}-request flood over {QUICK.connections} "
                   f"connections of {QUICK.tokens} tokens, {QUICK.rates} sweep rates of "
                   f"{QUICK.seconds:g} s.")
@click.option("--rounds", type=click.IntRange(1), default=1, show_default=True,
              help="Rounds of each in-process workload and of the gateway's part, the settings' order reversed each "
                   "round; each row keeps its best round.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write the report here.")
@click.option("--keep-logs", is_flag=True, help="Keep the workers', gateways' and guidellm's logs.")
def main(workloads, settings, model, dtype, threads, quick, rounds, json_path, keep_logs) -> None:
    """Every workload under every setting: a markdown table and the verdicts against issue 43's targets."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out
    out = run(workloads, settings, model, dtype, threads, quick, rounds, keep_logs)
    if json_path:
        json_path.write_text(json.dumps(out, indent=1))
    click.echo(markdown(out))


if __name__ == "__main__":
    main()
