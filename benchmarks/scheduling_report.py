"""The scheduling matrix's pure parts: the settings it compares, its rows, the table, and the verdicts against
issue 43's targets (no process, no model: tests/test_scheduling_matrix.py feeds them recorded figures).

A row is one workload's figures for one class of its requests (or one rate of a guidellm sweep) under one setting;
times are in seconds, throughput in tokens a second.

A comparison of the default with the target off that misses by less than the run's noise says so: the noise of a
figure is how far apart the rounds of one setting measured it (the larger of the two settings' spreads). On a
shared machine two runs of one schedule differ by more than the target's margin (doc-qa's throughput by up to 20%
between two rounds on 2 vCPUs), so such a miss does not tell the settings apart; a miss beyond the noise does."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

DEFAULT, TARGET_OFF = "default", "target-off"
SMALL_BUDGET, LARGE_BUDGET = 128, 2048
SETTINGS: dict[str, dict[str, float]] = {  # setting -> its step policy, as EngineConfig's fields
    DEFAULT: {},
    TARGET_OFF: {"step_time_target": 0},
    f"budget-{SMALL_BUDGET}": {"step_time_target": 0, "max_num_batched_tokens": SMALL_BUDGET},
    f"budget-{LARGE_BUDGET}": {"step_time_target": 0, "max_num_batched_tokens": LARGE_BUDGET},
}
SKEW_SMALL, SUMMARISE, DOC_QA, INTERACTIVE = "skew-small", "summarise", "doc-qa", "interactive"
BEHIND_BATCH, FLOOD, SWEEP = "behind-batch", "flood", "guidellm-sweep"
IN_PROCESS = (SKEW_SMALL, SUMMARISE, DOC_QA, INTERACTIVE)
THROUGH_GATEWAY = (BEHIND_BATCH, FLOOD, SWEEP)
WORKLOADS = IN_PROCESS + THROUGH_GATEWAY
THROUGHPUT_RATIO = 0.98  # of the target-off run, at the default
PREFIX_HITS = 0.99  # doc-qa's, at the default
BEHIND_BATCH_P50_S, BEHIND_BATCH_MAX_S = 0.5, 1.5  # beyond idle
FLOOD_P50_S, FLOOD_MAX_S = 1.0, 2.0  # beyond idle, each of B's streams


@dataclass(frozen=True)
class Row:
    workload: str
    setting: str
    label: str  # the class of the requests measured, or a sweep's rate
    tok_s: float | None = None  # prompt plus generated in process; streamed output through the gateway
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    itl_p50: float | None = None
    itl_p99: float | None = None
    prefix_hits: float | None = None  # of the workload's shared prefix tokens
    ttft_each: list[float] = field(default_factory=list)  # every request's, where each is judged
    idle_ttft_p50: float | None = None  # the same request alone, through the same gateway
    position: int = 0  # of a sweep's rate, in the order run
    rounds: list[dict] = field(default_factory=list)  # each round's judged figures (JUDGED), where several ran

    def as_dict(self) -> dict:
        return asdict(self)


def worker_options(setting: str) -> list[str]:
    """A setting as `batcher worker` options: {"step_time_target": 0} -> ["--step-time-target", "0"]."""
    return [part for name, value in SETTINGS[setting].items() for part in (f"--{name.replace('_', '-')}", str(value))]


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank percentile `q` (0 to 1) of `values`, as `batcher bench` reports them."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def streams_row(workload: str, setting: str, label: str, ttfts: list[float], idle_p50: float) -> Row:
    """A row of streams timed through the gateway: their times to first token against the same stream alone."""
    return Row(workload, setting, label, ttft_p50=percentile(ttfts, 0.5), ttft_p99=percentile(ttfts, 0.99),
               ttft_each=[round(t, 3) for t in ttfts], idle_ttft_p50=idle_p50)


def _find(rows: list[Row], workload: str, setting: str, label: str | None = None) -> list[Row]:
    return [r for r in rows if r.workload == workload and r.setting == setting and label in (None, r.label)]


JUDGED = ("tok_s", "ttft_p50", "itl_p99")  # the figures a comparison of two settings judges


def _verdict(target: str, met: bool | None, figures: str, noise: bool = False) -> dict:
    """`noise`: missed by less than the run's noise."""
    return {"target": target, "met": met, "figures": figures, "within_noise": noise and not met}


def _noise(a: Row, b: Row, figure: str) -> float | None:
    """How far apart the rounds of one setting measured `figure`: the larger of the two rows' spreads (None with
    one round)."""
    spreads = [max(values) - min(values) for row in (a, b)
               if len(values := [r[figure] for r in row.rounds if r.get(figure) is not None]) > 1]
    return max(spreads, default=None)


def _within_noise(misses: list[tuple[float, float | None]]) -> bool:
    """Whether every (miss, noise) is a miss smaller than its noise."""
    return bool(misses) and all(noise is not None and miss <= noise for miss, noise in misses)


def verdicts(rows: list[Row]) -> list[dict]:
    """Each of issue 43's targets the rows can judge: met (True/False), with the figures it was judged on. A
    target whose rows are missing (a workload or setting not run) is left out."""
    out = []
    for workload in (SKEW_SMALL, SUMMARISE, DOC_QA):
        ours, off = _find(rows, workload, DEFAULT), _find(rows, workload, TARGET_OFF)
        if ours and off and ours[0].tok_s and off[0].tok_s:
            ratio = ours[0].tok_s / off[0].tok_s
            miss = THROUGHPUT_RATIO * off[0].tok_s - ours[0].tok_s
            out.append(_verdict(f"{workload}: tok/s at the default >= {THROUGHPUT_RATIO}x the target off",
                                ratio >= THROUGHPUT_RATIO, f"{ratio:.3f}x",
                                _within_noise([(miss, _noise(ours[0], off[0], "tok_s"))])))
    docs, docs_off = _find(rows, DOC_QA, DEFAULT), _find(rows, DOC_QA, TARGET_OFF)
    if docs and docs[0].prefix_hits is not None:
        out.append(_verdict(f"doc-qa: prefix hits at the default >= {PREFIX_HITS:.0%}",
                            docs[0].prefix_hits >= PREFIX_HITS, f"{docs[0].prefix_hits:.1%}"))
    if docs and docs_off and docs[0].ttft_p50 is not None and docs_off[0].ttft_p50 is not None:
        out.append(_verdict("doc-qa: TTFT p50 at the default <= the target off's",
                            docs[0].ttft_p50 <= docs_off[0].ttft_p50,
                            f"{docs[0].ttft_p50:.3f} s against {docs_off[0].ttft_p50:.3f} s",
                            _within_noise([(docs[0].ttft_p50 - docs_off[0].ttft_p50,
                                            _noise(docs[0], docs_off[0], "ttft_p50"))])))
    for workload, p50_s, max_s in ((BEHIND_BATCH, BEHIND_BATCH_P50_S, BEHIND_BATCH_MAX_S),
                                   (FLOOD, FLOOD_P50_S, FLOOD_MAX_S)):
        for row in _find(rows, workload, DEFAULT):
            idle, each = row.idle_ttft_p50, row.ttft_each
            out.append(_verdict(f"{workload}: TTFT p50 <= idle + {p50_s:g} s, every one <= idle + {max_s:g} s",
                                statistics.median(each) <= idle + p50_s and max(each) <= idle + max_s,
                                f"idle {idle:.2f} s; each {', '.join(f'{t:.2f}' for t in each)} s"))
    off_at = {r.label: r for r in _find(rows, SWEEP, TARGET_OFF)}  # the same rates under every setting
    pairs = [(a, off_at[a.label]) for a in _find(rows, SWEEP, DEFAULT) if a.label in off_at]
    pairs = [(a, b) for a, b in pairs if None not in (a.tok_s, b.tok_s, a.itl_p99, b.itl_p99)]
    if pairs:
        out.append(_verdict("sweep: output tok/s at every rate >= the target off's",
                            all(a.tok_s >= b.tok_s for a, b in pairs),
                            "; ".join(f"{a.tok_s:.1f} vs {b.tok_s:.1f}" for a, b in pairs),
                            _within_noise([(b.tok_s - a.tok_s, _noise(a, b, "tok_s")) for a, b in pairs
                                           if a.tok_s < b.tok_s])))
        out.append(_verdict("sweep: ITL p99 at every rate <= the target off's",
                            all(a.itl_p99 <= b.itl_p99 for a, b in pairs),
                            "; ".join(f"{a.itl_p99 * 1000:.0f} vs {b.itl_p99 * 1000:.0f} ms" for a, b in pairs),
                            _within_noise([(a.itl_p99 - b.itl_p99, _noise(a, b, "itl_p99")) for a, b in pairs
                                           if a.itl_p99 > b.itl_p99])))
    return out


def _cell(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def table(rows: list[Row]) -> str:
    """Markdown: one line per workload, class and setting, the settings of a workload side by side."""
    lines = ["| workload | class / rate | setting | tok/s | TTFT p50 s | TTFT p99 s | ITL p50 ms | ITL p99 ms "
             "| prefix hits |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    order = {name: i for i, name in enumerate(WORKLOADS)}
    settings = {name: i for i, name in enumerate(SETTINGS)}
    for r in sorted(rows, key=lambda r: (order.get(r.workload, len(order)), r.workload, r.position,
                                         settings.get(r.setting, len(settings)), r.label)):
        hits = "-" if r.prefix_hits is None else f"{r.prefix_hits:.0%}"
        lines.append(f"| {r.workload} | {r.label} | {r.setting} | {_cell(r.tok_s, digits=1)} | {_cell(r.ttft_p50)} "
                     f"| {_cell(r.ttft_p99)} | {_cell(r.itl_p50, 1000, 0)} | {_cell(r.itl_p99, 1000, 0)} | {hits} |")
    return "\n".join(lines)


def verdict_lines(found: list[dict]) -> str:
    marks = {True: "met", False: "MISSED", None: "-"}
    return "\n".join(f"- {marks[v['met']]}{' by less than the noise' if v.get('within_noise') else ''}: "
                     f"{v['target']} ({v['figures']})" for v in found)
