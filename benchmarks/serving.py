"""Online serving through the gateway: guidellm (vLLM's load generator, unmodified) against `batcher serve` and
against llama.cpp's `llama-server`, on the same model, dtype, slots and threads.

    python -m benchmarks.serving --levels 1,2,4,8 --sweep-size 4 --seconds 40 --threads 1 --slots 8 \
        --prompt-tokens 128 --output-tokens 32 --dtype float32 [--json report.json]

- batcher: a redis-server of the bench's own, one `batcher worker` (`--max-num-seqs` SLOTS, `OMP_NUM_THREADS`
  THREADS, the model in --dtype) and one `batcher serve`; guidellm talks to the gateway.
- llama-server: built once into the cache (benchmarks/llama_server.py), the same checkpoint converted to a GGUF
  of the same dtype (Q8_0 with `--quantization int8`; `--llama-gguf` names another type, e.g. q4_k_m), `--parallel`
  SLOTS, `--threads`/`--threads-batch` THREADS, `--batch-size`/`--ubatch-size` the worker's token budget. Where it
  cannot be built or started, batcher runs alone and the report says why.
- guidellm runs as its CLI (`GUIDELLM__MAX_WORKER_PROCESSES=1`: one asyncio worker process carries every stream),
  text completions (`/v1/completions`, so that both servers see the same prompt tokens), streamed, greedy, synthetic
  prompts of --prompt-tokens with --output-tokens each (`ignore_eos`), the tokenizer read from the model's folder,
  offline. Profiles: `concurrent` at each level, then `sweep` (synchronous, throughput at up to 2 x SLOTS streams,
  then constant rates between), each with its own data seed (the same for both servers), each benchmark cut after
  --seconds (requests still running then are counted as cut, not in the percentiles).
- what the gateway and Redis add to the first token, request by request at concurrency 1, against two references:
  the worker's own engine TTFT of the same job (its result's `timings.ttft_s`, from admitting the job to the first
  token, read from Redis by the job id in the response id), and an engine in this process (`build_engine`, the same
  dtype, slots and threads, after the servers have stopped) running the same prompts again (`first_token_time -
  arrival_time`, median of ENGINE_REPEATS runs each). The second moves with the machine's load between the two.

Everything shares the machine's cores: the worker's thread(s), the gateway, Redis and guidellm (llama-server's run
has only itself and guidellm). Prints markdown tables, and the whole report as JSON with --json.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import click

from benchmarks import serving_report as report
from benchmarks.bench_worker import start_worker
from benchmarks.gateway_cost import QUEUE, _start_gateway, _wait, stop_all, stop_processes
from benchmarks.llama_server import GGUF_CHOICES, gguf_type
from benchmarks.private_redis import free_port, start_redis_server
from rqbatcher.config import DTYPES, QUANTIZATION_NONE, QUANTIZATIONS
from rqbatcher.workers.bench.report import cpu_name

SERVED = "bench-model"  # the name both servers answer to
READY_S = 300  # a worker loads torch and the model on a busy machine
GUIDELLM_SLACK_S = 120  # per benchmark, beyond its --seconds: guidellm's start-up and its report
CONTEXT_ROUNDING = 256
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
SEEDS = {"concurrent": 42, "sweep": 4242, "throughput": 4243, "constant": 4244}  # guidellm's data seeds: the
# same prompts for both servers (or every setting of benchmarks/scheduling_matrix.py)
ENGINE_REPEATS = 3  # times each prompt runs on the in-process engine (its median is taken)


@dataclass(frozen=True)
class Settings:
    model_dir: Path
    dtype: str
    threads: int
    slots: int
    budget: int  # tokens of one step: the worker's --max-num-batched-tokens, llama-server's batch size
    levels: tuple[int, ...]
    sweep_size: int
    seconds: float
    prompt_tokens: int
    output_tokens: int
    rates: tuple[float, ...] = ()  # requests a second of the `constant` profile
    quantization: str = QUANTIZATION_NONE  # int8: the worker's --quantization, and llama-server on a Q8_0 GGUF
    llama_gguf: str = ""  # llama-server's GGUF type where not the one matching the worker's (llama_server.gguf_type)


def guidellm_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "GUIDELLM__MAX_WORKER_PROCESSES": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def profile_args(kind: str, s: Settings) -> list[str]:
    if kind == "concurrent":
        return ["--profile", f"kind=concurrent,streams={s.levels[0]}",
                "--override", "profile.streams", ",".join(map(str, s.levels))]
    if kind == "constant":
        return ["--profile", f"kind=constant,rate={s.rates[0]:g},max_concurrency={2 * s.slots}",
                "--override", "profile.rate", ",".join(f"{r:g}" for r in s.rates)]
    if kind == "throughput":
        return ["--profile", f"kind=throughput,max_concurrency={2 * s.slots}"]
    return ["--profile", f"kind=sweep,sweep_size={s.sweep_size},max_concurrency={2 * s.slots}"]


def guidellm_command(target: str, kind: str, s: Settings, output: Path) -> list[str]:
    """Each profile has its own seed: a sweep run after the concurrent one would otherwise send the same prompts
    again, and find them in the server's prefix cache (guidellm starts each prompt with its benchmark's and its
    own index, a few tokens, less than a KV block)."""
    return [sys.executable, "-m", "guidellm", "run",
            "--backend", f"kind=openai_http,target={target},model={SERVED},request_format=/v1/completions,"
                         "extras.body.temperature=0",  # greedy on both: sampling costs the same
            *profile_args(kind, s),
            "--constraint", f"kind=max_duration,seconds={s.seconds:g}",
            "--tokenizer", f"kind=huggingface_auto,model={s.model_dir}",
            "--data", f"kind=synthetic_text,prompt_tokens={s.prompt_tokens},output_tokens={s.output_tokens}",
            "--seed", f"kind=static,value={SEEDS[kind]}",
            "--output", f"kind=json,path={output}",
            "--disable-console-interactive"]


def run_guidellm(target: str, kind: str, s: Settings, directory: Path, server: str) -> dict:
    output = directory / f"{server}-{kind}.json"
    command = guidellm_command(target, kind, s, output)
    click.echo(f"{server}, {kind}: {' '.join(command[1:])}", err=True)
    benchmarks = {"concurrent": len(s.levels), "constant": len(s.rates), "throughput": 1}.get(kind, s.sweep_size)
    with (directory / f"{server}-{kind}.log").open("w") as log:
        done = subprocess.run(command, env=guidellm_env(), stdout=log, stderr=subprocess.STDOUT,
                              timeout=benchmarks * (s.seconds + GUIDELLM_SLACK_S))
    if done.returncode != 0 or not output.exists():
        tail = (directory / f"{server}-{kind}.log").read_text()[-3000:]
        raise RuntimeError(f"guidellm exited with {done.returncode} against {server}:\n{tail}")
    return json.loads(output.read_text())


def warm(base: str, s: Settings) -> None:
    """One request to the end before guidellm's first, so that no level pays a first request's costs."""
    import httpx

    body = {"model": SERVED, "prompt": "Tell me about queues. " * (s.prompt_tokens // 5), "max_tokens": 8,
            "temperature": 0.0}
    httpx.post(f"{base}/v1/completions", json=body, timeout=600).raise_for_status()


def wait_until_served(base: str, worker: subprocess.Popen, log: Path) -> None:
    """Until the gateway at `base` lists SERVED (the worker's heartbeat has reached it); the worker's log where it
    exits first."""
    def served() -> bool:
        import httpx

        assert worker.poll() is None, log.read_text()[-2000:]
        return SERVED in [m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]]

    _wait(served, READY_S, "the worker")


def bench_batcher(s: Settings, directory: Path) -> dict:
    processes = []
    try:
        redis_server, redis_url = start_redis_server(directory)
        processes.append(redis_server)
        gateway, base = _start_gateway(redis_url, directory / "gateway.log")
        processes.append(gateway)
        processes.append(start_worker(redis_url, QUEUE, str(s.model_dir), s.dtype, s.threads, s.slots,
                                      directory / "worker.log", "--served-model-name", SERVED,
                                      "--max-num-batched-tokens", str(s.budget), "--quantization", s.quantization))

        wait_until_served(base, processes[-1], directory / "worker.log")
        warm(base, s)
        reports = {}
        for kind in _kinds(s):
            reports[kind] = run_guidellm(base, kind, s, directory, report.BATCHER)
            if kind == "concurrent" and 1 in s.levels:  # now: RQ keeps a job's result for minutes only
                reports["worker_ttft_ms"] = worker_ttfts(redis_url, report.sent_requests(reports[kind],
                                                                                         "concurrent@1"))
        return reports
    finally:
        stop_processes(processes)


def _kinds(s: Settings) -> list[str]:
    return (["concurrent"] if s.levels else []) + (["sweep"] if s.sweep_size else [])


def bench_llama_server(s: Settings, directory: Path, build_jobs: int) -> dict:
    from benchmarks.llama_server import gguf_checkpoint, server_binary, start_server

    binary = server_binary(build_jobs)
    gguf = gguf_checkpoint(s.model_dir, gguf_name(s.__dict__), build_jobs)
    per_slot = -(-(s.prompt_tokens * 2 + s.output_tokens) // CONTEXT_ROUNDING) * CONTEXT_ROUNDING  # room to spare
    port = free_port()
    server, note = start_server([str(binary), "-m", str(gguf), "--alias", SERVED, "--host", "127.0.0.1",
                                 "--port", str(port), "--parallel", str(s.slots), "--threads", str(s.threads),
                                 "--threads-batch", str(s.threads), "--ctx-size", str(per_slot * s.slots),
                                 "--batch-size", str(s.budget), "--ubatch-size", str(s.budget), "--no-webui"],
                                port, directory / "llama-server.log")
    if note:
        print(note, file=sys.stderr)
    base = f"http://127.0.0.1:{port}"
    try:
        warm(base, s)
        return {kind: run_guidellm(base, kind, s, directory, report.LLAMA) for kind in _kinds(s)}
    finally:
        stop_processes([server])


def worker_ttfts(redis_url: str, sent: list[report.Sent]) -> list[float]:
    """The worker's own time to first token of each request (its engine's, from admitting the job to the first
    token: the result's `timings.ttft_s`), read from Redis by the job id in the response id."""
    from rqbatcher.client import Client
    from rqbatcher.openai.generation_answer import COMPLETION_ID_PREFIX

    client = Client(redis_url, queue=QUEUE)
    return [client.result(r.response_id.removeprefix(COMPLETION_ID_PREFIX), timeout=30).timings.ttft_s * 1000
            for r in sent]


def engine_ttfts(s: Settings, bodies: list[dict]) -> list[float]:
    """Each body's prompt on an in-process engine, ENGINE_REPEATS times in turn (no prefix cache, so that a repeat
    computes the whole prompt again): the median ms from `add` (before tokenizing, as the worker stamps its
    admission) to its first token."""
    import torch

    from rqbatcher.config import EngineConfig
    from rqbatcher.openai.generation_body import COMPLETIONS_URL, parse_body
    from rqbatcher.workers.engine.engine import build_engine

    torch.set_num_threads(s.threads)
    engine = build_engine(EngineConfig(model=str(s.model_dir), dtype=s.dtype, device="cpu", max_num_seqs=s.slots,
                                       max_num_batched_tokens=s.budget, prefix_caching=False,
                                       quantization=s.quantization))
    engine.warm_up()
    requests = [parse_body({k: v for k, v in body.items() if k != "model"}, COMPLETIONS_URL,
                           extra_fields=("stream_options",)).model_copy(update={"service_class": "interactive"})
                for body in bodies]  # interactive: as the worker takes a gateway's request
    times: list[list[float]] = [[] for _ in requests]
    for round_ in range(ENGINE_REPEATS + 1):  # round 0 warms the engine up on prompts of this length
        for i, request in enumerate(requests if round_ else requests[:1]):
            engine.add(f"ttft-{round_}-{i}", request, arrival_time=time.monotonic())
            first = None
            while first is None:
                first = next((o for o in engine.step() if o.first_token_time is not None), None)
            if round_:
                times[i].append((first.first_token_time - first.arrival_time) * 1000)
            engine.abort(f"ttft-{round_}-{i}")
            while engine.has_work():
                engine.step()
    return [statistics.median(t) for t in times]


def machine() -> dict:
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        pass
    import torch

    from benchmarks.llama_server import LLAMA_CPP_PYTHON_VERSION

    versions = {"torch": torch.__version__, "llama_cpp_python": LLAMA_CPP_PYTHON_VERSION}
    try:
        from importlib.metadata import version

        versions["guidellm"] = version("guidellm")
    except Exception:  # noqa: BLE001  (not installed: the run fails later, saying so)
        pass
    return {"cpu": cpu_name(), "cpus": os.cpu_count(), "flags": [f for f in CPU_FLAGS if f in flags], **versions,
            "load_average": os.getloadavg()[0]}  # of one minute: the cores are shared


def run(s: Settings, systems: tuple[str, ...], build_jobs: int, keep_logs: bool) -> dict:
    directory = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    out: dict = {"machine": machine(), "settings": {**s.__dict__, "model_dir": str(s.model_dir)}, "servers": {}}
    started = time.monotonic()
    try:
        if report.BATCHER in systems:
            reports = bench_batcher(s, directory)
            out["servers"][report.BATCHER] = {k: [r.as_dict() for r in report.levels(reports[k])] for k in _kinds(s)}
            if "worker_ttft_ms" in reports:
                sent = report.sent_requests(reports["concurrent"], "concurrent@1")
                gateway = [r.ttft_ms for r in sent]
                out["added_ttft"] = {"worker": report.added_ttft(gateway, reports["worker_ttft_ms"]),
                                     "engine": report.added_ttft(gateway, engine_ttfts(s, [r.body for r in sent]))}
        if report.LLAMA in systems:
            try:
                reports = bench_llama_server(s, directory, build_jobs)
                out["servers"][report.LLAMA] = {k: [r.as_dict() for r in report.levels(v)] for k, v in reports.items()}
            except Exception as exc:  # noqa: BLE001  (no cmake, a failed build or start: batcher's rows stand alone)
                out["skipped"] = {report.LLAMA: f"{type(exc).__name__}: {exc}"}
        out["minutes"] = round((time.monotonic() - started) / 60, 1)
        out["machine"]["load_average_before_after"] = [out["machine"].pop("load_average"), os.getloadavg()[0]]
        return out
    finally:
        stop_all([], directory, keep_logs)


def gguf_name(settings: dict) -> str:
    """The GGUF type llama-server ran, from a report's settings."""
    return settings.get("llama_gguf") or gguf_type(settings["dtype"], settings.get("quantization", QUANTIZATION_NONE))


def markdown(out: dict) -> str:
    m, s = out["machine"], out["settings"]
    rows = {server: [report.Level(**r) for kind in v.values() for r in kind] for server, v in out["servers"].items()}
    lines = [f"Machine: {m['cpu']}, {m['cpus']} CPUs, flags {', '.join(m['flags']) or 'none of note'}; torch "
             f"{m['torch']}, guidellm {m.get('guidellm')}, llama.cpp of llama-cpp-python {m['llama_cpp_python']}; "
             f"load average before / after: {' / '.join(f'{x:.2f}' for x in m.get('load_average_before_after', []))}",
             f"Model {Path(s['model_dir']).name} in {s['dtype']}"
             f"{' on int8 weights' if s.get('quantization') == 'int8' else ''} (llama-server: {gguf_name(s)}), "
             f"{s['slots']} slots, {s['threads']} thread(s), "
             f"prompts of {s['prompt_tokens']} tokens, {s['output_tokens']} out, {s['seconds']:g} s a benchmark; "
             f"{out.get('minutes')} min in all", ""]
    for server, reason in out.get("skipped", {}).items():
        lines += [f"{server} did not run: {reason}", ""]
    ours = [r for r in rows.get(report.BATCHER, []) if r.kind == "concurrent"]
    peer = [r for r in rows.get(report.LLAMA, []) if r.kind == "concurrent"] if report.LLAMA in rows else None
    if ours:
        lines += [report.side_by_side(ours, peer), ""]
    elif peer:
        lines += [report.per_server({report.LLAMA: peer}), ""]
    sweeps = {server: [r for r in v if r.kind != "concurrent"] for server, v in rows.items()}
    if any(sweeps.values()):
        lines += [report.per_server({k: v for k, v in sweeps.items() if v}), ""]
    for against, a in out.get("added_ttft", {}).items():
        what = ("the worker's own engine TTFT of the same job (its result's timings.ttft_s)" if against == "worker"
                else f"an in-process engine's TTFT on the same prompts afterwards (median of {ENGINE_REPEATS})")
        lines.append(f"- Added to the first token by the gateway, Redis and the worker's loop, against {what}: "
                     f"**{a['added_ms_p50_of_differences']} ms** p50 of {a['requests']} requests at concurrency 1 "
                     f"(min {a['added_ms_min_max'][0]}, max {a['added_ms_min_max'][1]}); through the gateway p50 "
                     f"{a['gateway_ttft_ms_p50']} ms, the engine p50 {a['engine_ttft_ms_p50']} ms")
    return "\n".join(lines)


def _levels(value: str) -> tuple[int, ...]:
    return tuple(int(x) for x in value.split(",") if x.strip())


@click.command()
@click.option("--model", default="smollm2", show_default=True, help="A local model folder, or smollm2.")
@click.option("--dtype", type=click.Choice([d for d in DTYPES if d != "auto"]), default="float32", show_default=True)
@click.option("--quantization", type=click.Choice(QUANTIZATIONS), default=QUANTIZATION_NONE, show_default=True,
              help="int8: the worker on int8 weights, llama-server on a Q8_0 GGUF of the same checkpoint.")
@click.option("--llama-gguf", type=click.Choice(GGUF_CHOICES),
              help="llama-server's GGUF type (default: the worker's dtype, or Q8_0 for int8).")
@click.option("--threads", type=click.IntRange(1), default=1, show_default=True,
              help="The worker's torch threads, llama-server's --threads and --threads-batch, the engine's.")
@click.option("--slots", type=click.IntRange(1), default=8, show_default=True,
              help="The worker's --max-num-seqs, llama-server's --parallel.")
@click.option("--budget", type=click.IntRange(1), default=512, show_default=True,
              help="Tokens of a step: --max-num-batched-tokens, llama-server's --batch-size and --ubatch-size.")
@click.option("--levels", default="1,2,4,8", show_default=True, help="Concurrency levels ('': none).")
@click.option("--sweep-size", type=click.IntRange(0), default=4, show_default=True,
              help="Benchmarks of the sweep (0: no sweep; else at least 2).")
@click.option("--seconds", type=click.FloatRange(1), default=40, show_default=True, help="Length of each benchmark.")
@click.option("--prompt-tokens", type=click.IntRange(1), default=128, show_default=True)
@click.option("--output-tokens", type=click.IntRange(1), default=32, show_default=True)
@click.option("--systems", default=f"{report.BATCHER},{report.LLAMA}", show_default=True)
@click.option("--build-jobs", type=click.IntRange(1), default=2, show_default=True,
              help="cmake's jobs, when llama-server is built (once).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write the report here.")
@click.option("--keep-logs", is_flag=True, help="Keep the servers' and guidellm's logs and reports.")
def main(model, dtype, quantization, llama_gguf, threads, slots, budget, levels, sweep_size, seconds, prompt_tokens,
         output_tokens, systems, build_jobs, json_path, keep_logs) -> None:
    """guidellm against batcher's gateway and llama-server: a markdown table per profile (JSON with --json)."""
    if sweep_size == 1:
        raise click.BadParameter("a sweep has at least 2 benchmarks (or 0: none)", param_hint="--sweep-size")
    from rqbatcher.workers.model.loading import resolve

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers and guidellm on the way out
    settings = Settings(Path(resolve(model)), dtype, threads, slots, budget, _levels(levels), sweep_size, seconds,
                        prompt_tokens, output_tokens, quantization=quantization, llama_gguf=llama_gguf or "")
    out = run(settings, tuple(x.strip() for x in systems.split(",")), build_jobs, keep_logs)
    if json_path:
        json_path.write_text(json.dumps(out, indent=1))
    click.echo(markdown(out))


if __name__ == "__main__":
    main()
