"""Metrics of `batcher bench`, derived the same way from every system's `SystemRun`.

- throughput: generated, prompt, and prompt plus generated ("total") tokens over the wall time of the run;
- prefix hits: prompt tokens a system found in its prefix cache, over the workload's shared prefix tokens
  (what a perfect cache would skip: every shared prefix after its first request), where the system says;
- latency: time to first token (from arrival) and inter-token gaps, from per-token timestamps;
- slot occupancy: sequences doing useful work per step, over the system's slots;
- correctness: every system's greedy tokens against the baseline's, with every difference listed.
Model FLOP utilisation and the roofline are measured from a checkout (`python -m benchmarks.compare`).
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass, field

import torch

from rqbatcher.config import DEFAULT_QUANTIZATION, EngineConfig
from rqbatcher.workers.bench.record import SystemRun
from rqbatcher.workers.bench.workload import WorkloadRequest, shared_prefix_tokens

MB = 1 << 20


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]

    return {"p50": at(0.50), "p99": at(0.99), "max": ordered[-1]}


@dataclass
class SystemReport:
    system: str
    wall_s: float
    generated_tokens: int
    generated_tok_s: float
    prompt_tok_s: float
    total_tok_s: float  # prompt plus generated
    cached_tokens: int | None  # prompt tokens found in the prefix cache; None where the system does not say
    prefix_hit_rate: float | None  # cached_tokens over the workload's shared prefix tokens
    ttft_s: dict
    itl_s: dict
    slots: int
    mean_batch: float
    mean_occupancy: float
    peak_rss_mb: float
    preemptions: int
    mismatched_requests: list[dict]  # [{"id", "first_difference"}] against the baseline's tokens
    notes: list[str]
    cumulative_tokens: list[tuple[float, int]]  # for the plot
    occupancy: list[tuple[float, int]]  # (step end, sequences in it)


@dataclass
class BenchReport:
    workload: str
    model: str
    dtype: str
    threads: int
    device: str
    versions: dict
    baseline: str
    requests: int
    prompt_tokens: int
    shared_prefix_tokens: int  # prompt tokens a perfect prefix cache would not compute
    quantization: str = DEFAULT_QUANTIZATION  # of the linears' weights (EngineConfig.quantization)
    systems: list[SystemReport] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def system(self, name: str) -> SystemReport:
        return next(s for s in self.systems if s.system == name)

    @property
    def all_agree(self) -> bool:
        return not any(s.mismatched_requests for s in self.systems)

    def table(self) -> str:
        base = self.system(self.baseline).generated_tok_s
        ms = lambda d, k: "-" if d[k] is None else f"{d[k] * 1000:.0f}"  # noqa: E731
        width = max(20, *(len(s.system) + 2 for s in self.systems))
        ratio_width = max(24, len(self.baseline) + 4)
        header = (f"{'system':<{width}}{'gen tok/s':>10}{'x ' + self.baseline:>{ratio_width}}{'prompt tok/s':>13}"
                  f"{'total tok/s':>12}{'TTFT ms p50/p99/max':>22}{'ITL ms p50/p99/max':>21}{'occupancy':>11}"
                  f"{'RSS MB':>8}{'prefix hits':>12}  greedy tokens")
        shared = (f"{self.shared_prefix_tokens} of them in shared prefixes after their first request"
                  if self.shared_prefix_tokens else "no shared prefixes")
        lines = [f"{self.workload}: {self.requests} requests, {self.prompt_tokens} prompt tokens ({shared}); "
                 f"model {self.model} in {self.dtype}"
                 + (f" with {self.quantization} weights" if self.quantization != DEFAULT_QUANTIZATION else "")
                 + f"; {self.threads} thread(s) on {self.device}; "
                 + ", ".join(f"{k} {v}" for k, v in self.versions.items()), header]
        for s in self.systems:
            agree = "baseline" if s.system == self.baseline else (
                "agree" if not s.mismatched_requests else f"DIFFER in {len(s.mismatched_requests)} requests")
            hits = "-" if s.prefix_hit_rate is None else f"{s.prefix_hit_rate:.0%}"
            lines.append(
                f"{s.system:<{width}}{s.generated_tok_s:>10.1f}{s.generated_tok_s / base:>{ratio_width - 1}.2f}x"
                f"{s.prompt_tok_s:>13.1f}{s.total_tok_s:>12.1f}"
                f"{ms(s.ttft_s, 'p50') + '/' + ms(s.ttft_s, 'p99') + '/' + ms(s.ttft_s, 'max'):>22}"
                f"{ms(s.itl_s, 'p50') + '/' + ms(s.itl_s, 'p99') + '/' + ms(s.itl_s, 'max'):>21}"
                f"{s.mean_occupancy:>11.2f}{s.peak_rss_mb:>8.0f}{hits:>12}  {agree}")
        for s in self.systems:
            for m in s.mismatched_requests:
                lines.append(f"  ! {s.system} request {m['id']}: greedy tokens differ from {self.baseline} "
                             f"from token {m['first_difference']}")
            lines.extend(f"  note: {n}" for n in s.notes)
        return "\n".join(lines)


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def system_report(run: SystemRun, workload: list[WorkloadRequest], baseline: SystemRun,
                  shared_prefix_tokens: int) -> SystemReport:
    arrival = {w.id: w.arrival_s for w in workload}
    generated = sum(len(t) for t in run.tokens.values())
    prompt = sum(w.prompt_len for w in workload)
    cached = run.cached_tokens or {}
    total_cached = None if run.cached_tokens is None else sum(cached.values())
    ttft = [times[0] - arrival[rid] for rid, times in run.token_times.items() if times]
    itl = [b - a for times in run.token_times.values() for a, b in zip(times, times[1:])]
    stamps = sorted(t for times in run.token_times.values() for t in times)
    mismatched = []
    for w in workload:
        at = first_difference(run.tokens.get(w.id, []), baseline.tokens.get(w.id, []))
        if at is not None:
            mismatched.append({"id": w.id, "first_difference": at})
    mean_batch = sum(n for _, n in run.steps) / len(run.steps) if run.steps else 0.0
    return SystemReport(
        system=run.system, wall_s=run.wall_s, generated_tokens=generated,
        generated_tok_s=generated / run.wall_s, prompt_tok_s=prompt / run.wall_s,
        total_tok_s=(prompt + generated) / run.wall_s, cached_tokens=total_cached,
        prefix_hit_rate=total_cached / shared_prefix_tokens if total_cached is not None and shared_prefix_tokens
        else None,
        ttft_s=percentiles(ttft), itl_s=percentiles(itl), slots=run.slots, mean_batch=mean_batch,
        mean_occupancy=mean_batch / run.slots, peak_rss_mb=run.peak_rss_bytes / MB,
        preemptions=run.preemptions, mismatched_requests=mismatched, notes=run.notes,
        cumulative_tokens=[(t, i + 1) for i, t in enumerate(stamps)], occupancy=run.steps,
    )


def bench_report(name: str, workload: list[WorkloadRequest], runs: dict[str, SystemRun], baseline: str,
                 config: EngineConfig, threads: int, device: torch.device) -> BenchReport:
    """The report of `runs` (system name -> run, in the order run) on `workload`, against `baseline`'s tokens."""
    device_name, versions = environment(device)
    shared = shared_prefix_tokens(workload)
    report = BenchReport(workload=name, model=config.model, dtype=config.dtype, threads=threads, device=device_name,
                         versions=versions, baseline=baseline, requests=len(workload),
                         prompt_tokens=sum(w.prompt_len for w in workload), shared_prefix_tokens=shared,
                         quantization=config.quantization)
    report.systems = [system_report(run, workload, runs[baseline], shared) for run in runs.values()]
    return report


def environment(device: torch.device) -> tuple[str, dict]:
    """The device in words, and the versions that produced the figures."""
    import transformers

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = cpu_name() or platform.processor() or platform.machine()
    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "python": platform.python_version()}
    return f"{device.type} ({name})", versions


def cpu_name() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None
