"""A lone stream's decode step, in process, per dtype and weight format: the floor a single user sees; with
--batch N, a step of N streams at once (decode throughput at N slots).

    python -m benchmarks.lone_step [--model smollm2] [--threads 1] [--formats float32,float32:int8,auto,auto:int8]
                                   [--batch 1]

Each format (`dtype`, `dtype:quantization`, or `dtype:int8:variant` for one int8 kernel variant, `avx2` or
`avx512-vnni`, where this CPU's best runs otherwise) builds an engine (`build_engine`), runs one request of --tokens
tokens to warm it, then --rounds more one after another, and times every `engine.step()` past the prefills (the
--batch requests are added at once; the steps while any still prefills are left out); the formats take turns round
by round, so a noisy neighbour touches them alike. Prints the median step per format, its tokens per second and
its ratio to the first format's, and against its weight-read floor (the bytes its weights are stored in, over the
memory's read pace: `benchmarks.roofline`'s probe, the better of before and after), with the CPU and which int8
kernel ran (`isa`), and a note for each format whose weights fit in the CPU's last-level cache (its step can then
run under that floor). With --breakdown, one more round
per format times every call into the native kernels, and splits the mean step into the linears, the other native
kernels (attention, norms, rotary, KV writes) and the rest (Python, torch's own ops, the sampler).
"""

from __future__ import annotations

import collections
import contextlib
import statistics
import time
from unittest import mock

import click
import torch

from benchmarks.roofline import ModelCost, cache_note, last_level_cache_bytes, read_bandwidth
from rqbatcher.config import DEFAULT_MODEL, DEFAULT_QUANTIZATION, EngineConfig
from rqbatcher.kernels import native
from rqbatcher.schema import GenerationRequest, SamplingParams
from rqbatcher.workers.bench.report import cpu_name
from rqbatcher.workers.engine.engine import build_engine

PROMPT = list(range(100, 132))  # 32 token ids: the step times past the prefill are what is measured
# the extensions' own functions (the fused decoder calls some of them directly, not through `native`'s wrappers)
LINEARS = ("int8_linear", "amx_linear", "avx512_linear", "small_linear", "fp32_linear")
OTHER_KERNELS = ("paged_decode", "amx_decode", "amx_prefill", "avx512_prefill", "rms_norm", "add_rms_norm", "rotary_",
                 "silu_mul", "write_kv")


def extensions() -> list:
    """The native builds loaded here."""
    return [module for module in map(native.load, native.BUILDS) if module is not None]


class KernelClock:
    """Seconds spent in each native kernel while installed (`timing`), since the last `reset`."""

    def __init__(self) -> None:
        self.spent = collections.Counter()

    def reset(self) -> None:
        self.spent.clear()

    @contextlib.contextmanager
    def timing(self):
        with contextlib.ExitStack() as patches:
            for module in extensions():
                for name in LINEARS + OTHER_KERNELS:
                    if hasattr(module, name):
                        patches.enter_context(mock.patch.object(module, name, self._timed(name, getattr(module, name))))
            yield self

    def _timed(self, name: str, kernel):
        def call(*args, **kwargs):
            started = time.perf_counter()
            try:
                return kernel(*args, **kwargs)
            finally:
                self.spent[name] += time.perf_counter() - started
        return call


def int8_variant(isa: str):
    """Every int8 linear of the block runs kernel variant `isa` (this CPU's best where empty)."""
    kernels = native.load(native.INT8)
    if not isa or kernels is None:
        return contextlib.nullcontext()
    run = kernels.int8_linear
    return mock.patch.object(kernels, "int8_linear", lambda x, packed, wscale, bias, _isa="": run(x, packed, wscale,
                                                                                                  bias, isa))


def decode_steps(engine, tokens: int, batch: int, clock: KernelClock | None = None) -> list[float]:
    """The wall time of each step of `batch` requests at once, once every one has its first token (when `clock`
    starts too)."""
    sampling = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0)
    for i in range(batch):
        engine.add(f"r{i}", GenerationRequest(prompt_token_ids=[t + i for t in PROMPT], sampling=sampling))
    times, started_all = [], set()
    while engine.has_work():
        started = time.perf_counter()
        outputs = engine.step()
        if len(started_all) == batch:
            times.append(time.perf_counter() - started)
        if len(started_all) < batch:
            started_all |= {out.request_id for out in outputs}
            if clock and len(started_all) == batch:
                clock.reset()
    return times


@click.command()
@click.option("--model", default=DEFAULT_MODEL, show_default=True)
@click.option("--threads", default=1, show_default=True, help="torch threads")
@click.option("--formats", default="float32,float32:int8,auto,auto:int8", show_default=True,
              help="dtype or dtype:quantization, comma-separated; ratios are to the first")
@click.option("--tokens", default=64, show_default=True, help="tokens per request")
@click.option("--rounds", default=3, show_default=True)
@click.option("--batch", default=1, show_default=True, help="requests at once")
@click.option("--breakdown", is_flag=True, help="also split each format's step by where its time goes")
def main(model: str, threads: int, formats: str, tokens: int, rounds: int, batch: int, breakdown: bool) -> None:
    torch.set_num_threads(threads)
    read = read_bandwidth()
    engines, variants = {}, {}
    for spec in formats.split(","):
        dtype, quantization, variants[spec] = (spec.split(":") + ["", ""])[:3]
        engines[spec] = build_engine(EngineConfig(model=model, dtype=dtype, max_num_seqs=batch,
                                                  quantization=quantization or DEFAULT_QUANTIZATION))
        with int8_variant(variants[spec]):
            decode_steps(engines[spec], tokens, batch)  # warm
    steps = {spec: [] for spec in engines}
    for _ in range(rounds):
        for spec, engine in engines.items():
            with int8_variant(variants[spec]):
                steps[spec] += decode_steps(engine, tokens, batch)
    read = max(read, read_bandwidth())
    int8 = native.load(native.INT8)
    print(f"{cpu_name()}, {threads} torch thread(s), {batch} stream(s), int8 kernel: "
          f"{int8.isa(batch) if int8 else 'torch reference'}; memory read at {read / 1e9:.1f} GB/s")
    print("| format | decode step p50 ms | tok/s | step against the first | weight-read floor ms | step against its "
          "floor |\n|---|---:|---:|---:|---:|---:|")
    first, notes, cache_bytes = statistics.median(steps[next(iter(steps))]), [], last_level_cache_bytes()
    for spec, times in steps.items():
        weight_bytes = ModelCost.of(engines[spec].runner.model).weight_bytes
        median, floor = statistics.median(times), weight_bytes / read
        print(f"| {spec} | {1e3 * median:.1f} | {batch / median:.1f} | {median / first:.2f}x | {1e3 * floor:.1f} | "
              f"{median / floor:.2f}x |")
        notes += [f"{spec}: {note}" for note in [cache_note(weight_bytes, cache_bytes)] if note]
    if notes:
        print("\n" + "\n".join(notes))
    if breakdown:
        print("\n| format | step mean ms | linears | other native kernels | the rest |\n|---|---:|---:|---:|---:|")
        for spec, engine in engines.items():
            with int8_variant(variants[spec]), KernelClock().timing() as clock:
                times = decode_steps(engine, tokens, batch, clock)
            step, linears = sum(times), sum(clock.spent[name] for name in LINEARS)
            other = sum(clock.spent[name] for name in OTHER_KERNELS)
            print(f"| {spec} | {1e3 * step / len(times):.1f} | {1e3 * linears / len(times):.1f} | "
                  f"{1e3 * other / len(times):.1f} | {1e3 * (step - linears - other) / len(times):.1f} |")


if __name__ == "__main__":
    main()
