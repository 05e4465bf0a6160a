"""Metrics of `batcher bench`, derived the same way from every system's `SystemRun`.

- throughput: generated, prompt, and prompt plus generated ("total") tokens over the wall time of the run;
- prefix hits: prompt tokens a system found in its prefix cache, over the workload's shared prefix tokens
  (what a perfect cache would skip: every shared prefix after its first request), where the system says;
- latency: time to first token (from arrival) and inter-token gaps, from per-token timestamps;
- slot occupancy: sequences doing useful work per step, over the system's slots;
- model FLOP utilisation: the model's useful FLOPs (no padding, no recompute, no prefix found in the
  cache) per second, over a matmul probe measured in the same process, dtype and thread count;
- % of the roofline limit (`rqbatcher.workers.bench.roofline`): the shortest wall time any system could take, over
  this system's; and a lone sequence's decode step against the weight-read floor;
- correctness: every system's greedy tokens against the baseline's, with every difference listed.
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass, field

import torch

from rqbatcher.workers.bench.record import SystemRun
from rqbatcher.workers.bench.roofline import ModelCost, Roofline
from rqbatcher.workers.bench.workload import WorkloadRequest

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
    model_gflop_s: float
    mfu: float
    pct_of_limit: float  # the roofline limit over this wall time, in percent (0-100)
    lone_decode_step_s: float | None  # a decode step with one sequence running, where measured
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
    probe_gflop_s: float
    baseline: str
    requests: int
    prompt_tokens: int
    shared_prefix_tokens: int  # prompt tokens a perfect prefix cache would not compute
    roofline: Roofline
    systems: list[SystemReport] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # system -> why it could not run here

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
                  f"{'RSS MB':>8}{'MFU':>6}{'% limit':>8}{'prefix hits':>12}  greedy tokens")
        shared = (f"{self.shared_prefix_tokens} of them in shared prefixes after their first request"
                  if self.shared_prefix_tokens else "no shared prefixes")
        lines = [f"{self.workload}: {self.requests} requests, {self.prompt_tokens} prompt tokens ({shared}); "
                 f"model {self.model} in {self.dtype}; {self.threads} thread(s) on {self.device}; matmul probe "
                 f"{self.probe_gflop_s:.0f} GFLOP/s; " + ", ".join(f"{k} {v}" for k, v in self.versions.items()),
                 f"{self.roofline.describe()} (at {self.roofline.slots} slots)", header]
        for s in self.systems:
            agree = "baseline" if s.system == self.baseline else (
                "agree" if not s.mismatched_requests else f"DIFFER in {len(s.mismatched_requests)} requests")
            hits = "-" if s.prefix_hit_rate is None else f"{s.prefix_hit_rate:.0%}"
            lines.append(
                f"{s.system:<{width}}{s.generated_tok_s:>10.1f}{s.generated_tok_s / base:>{ratio_width - 1}.2f}x"
                f"{s.prompt_tok_s:>13.1f}{s.total_tok_s:>12.1f}"
                f"{ms(s.ttft_s, 'p50') + '/' + ms(s.ttft_s, 'p99') + '/' + ms(s.ttft_s, 'max'):>22}"
                f"{ms(s.itl_s, 'p50') + '/' + ms(s.itl_s, 'p99') + '/' + ms(s.itl_s, 'max'):>21}"
                f"{s.mean_occupancy:>11.2f}{s.peak_rss_mb:>8.0f}{s.mfu:>6.0%}{s.pct_of_limit:>7.0f}%"
                f"{hits:>12}  {agree}")
        floor = self.roofline.weight_read_s
        for s in self.systems:
            if s.lone_decode_step_s is not None:
                lines.append(f"{s.system}: a lone sequence's decode step takes {s.lone_decode_step_s * 1e3:.3g} ms, "
                             f"{s.lone_decode_step_s / floor:.3g}x the weight-read floor ({floor * 1e3:.3g} ms)")
        for s in self.systems:
            for m in s.mismatched_requests:
                lines.append(f"  ! {s.system} request {m['id']}: greedy tokens differ from {self.baseline} "
                             f"from token {m['first_difference']}")
            lines.extend(f"  note: {n}" for n in s.notes)
        lines.extend(f"  skipped {name}: {why}" for name, why in self.skipped.items())
        return "\n".join(lines)


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def system_report(run: SystemRun, workload: list[WorkloadRequest], cost: ModelCost, probe_flop_s: float,
                  baseline: SystemRun, roofline: Roofline, shared_prefix_tokens: int) -> SystemReport:
    arrival = {w.id: w.arrival_s for w in workload}
    generated = sum(len(t) for t in run.tokens.values())
    prompt = sum(w.prompt_len for w in workload)
    cached = run.cached_tokens or {}
    total_cached = None if run.cached_tokens is None else sum(cached.values())
    ttft = [times[0] - arrival[rid] for rid, times in run.token_times.items() if times]
    itl = [b - a for times in run.token_times.values() for a, b in zip(times, times[1:])]
    stamps = sorted(t for times in run.token_times.values() for t in times)
    flops = sum(cost.request_flops(w.prompt_len, len(run.tokens.get(w.id, [])), cached.get(w.id, 0))
                for w in workload)
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
        model_gflop_s=flops / run.wall_s / 1e9, mfu=flops / run.wall_s / probe_flop_s,
        pct_of_limit=roofline.pct_of_limit(run.wall_s), lone_decode_step_s=run.lone_decode_step_s,
        preemptions=run.preemptions, mismatched_requests=mismatched, notes=run.notes,
        cumulative_tokens=[(t, i + 1) for i, t in enumerate(stamps)], occupancy=run.steps,
    )


def environment(device: torch.device) -> tuple[str, dict]:
    """The device in words, and the versions that produced the figures."""
    import transformers

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = _cpu_name() or platform.processor() or platform.machine()
    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "python": platform.python_version()}
    return f"{device.type} ({name})", versions


def _cpu_name() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None
