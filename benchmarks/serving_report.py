"""The serving bench's pure parts: guidellm's JSON report read into rows, the rows as markdown tables, and the time
the gateway and Redis add to the first token (no process, no model: tests/test_serving_bench.py runs them).

guidellm 0.8.1's report (`--output kind=json`) holds one entry per benchmark (a concurrency level, or one strategy
of a sweep) under `benchmarks`. Each has `config.strategy` (its kind and level), `metrics` (distributions with
`successful`, `errored`, `incomplete` and `total` parts, each with `percentiles`) and `requests` (every request
by status, with its body, timings and usage)."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass

BATCHER, LLAMA = "batcher", "llama-server"


@dataclass(frozen=True)
class Level:
    """One benchmark of a guidellm report: times in ms, throughput in tokens/s."""

    label: str  # concurrent@4, synchronous, throughput, constant@0.31/s
    kind: str
    successful: int
    errored: int
    incomplete: int
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    output_tokens_per_s: float | None
    prompt_tokens_mean: float | None
    output_tokens_mean: float | None
    duration_s: float

    def as_dict(self) -> dict:
        return asdict(self)


def strategy_label(strategy: dict) -> str:
    kind = strategy.get("type_", "?")
    if kind == "concurrent":
        return f"concurrent@{strategy['streams']}"
    if kind in ("constant", "poisson", "async"):
        return f"{kind}@{strategy['rate']:.2f}/s"
    return kind


def _percentile(metric: dict, name: str, part: str = "successful") -> float | None:
    summary = metric.get(part) or {}
    if not summary.get("count"):
        return None
    return summary["percentiles"][name]


def _mean(metric: dict, part: str = "successful") -> float | None:
    summary = metric.get(part) or {}
    return summary["mean"] if summary.get("count") else None


def levels(report: dict) -> list[Level]:
    """Every benchmark of a guidellm JSON report, in the order it ran."""
    rows = []
    for benchmark in report["benchmarks"]:
        metrics = benchmark["metrics"]
        totals = metrics["request_totals"]
        rows.append(Level(
            label=strategy_label(benchmark["config"]["strategy"]), kind=benchmark["config"]["strategy"]["type_"],
            successful=totals["successful"], errored=totals["errored"], incomplete=totals["incomplete"],
            ttft_p50=_percentile(metrics["time_to_first_token_ms"], "p50"),
            ttft_p99=_percentile(metrics["time_to_first_token_ms"], "p99"),
            itl_p50=_percentile(metrics["inter_token_latency_ms"], "p50"),
            itl_p99=_percentile(metrics["inter_token_latency_ms"], "p99"),
            # guidellm's "output tokens per second" (its console's): every token streamed within the benchmark's
            # window, finished requests or not, over the window
            output_tokens_per_s=_mean(metrics["output_tokens_per_second"], "total"),
            prompt_tokens_mean=_mean(metrics["prompt_token_count"]),
            output_tokens_mean=_mean(metrics["output_token_count"]),
            duration_s=benchmark["duration"]))
    return rows


@dataclass(frozen=True)
class Sent:
    """One successful request of a benchmark: its body, the server's response id, its TTFT in ms as guidellm takes
    it (from sending the request to the first streamed text)."""

    body: dict
    response_id: str | None
    ttft_ms: float


def sent_requests(report: dict, label: str) -> list[Sent]:
    """The successful requests of one benchmark, in the order they started. A request whose tokens had no text has
    no first token for guidellm, and is left out, as guidellm's TTFT leaves it out."""
    for benchmark in report["benchmarks"]:
        if strategy_label(benchmark["config"]["strategy"]) == label:
            done = sorted((r for r in benchmark["requests"]["successful"]
                           if r["info"]["timings"]["first_token_iteration"] is not None),
                          key=lambda r: r["info"]["timings"]["request_start"])
            return [Sent(json.loads(r["request_args"])["body"], r.get("response_id"),
                         (r["info"]["timings"]["first_token_iteration"] - r["info"]["timings"]["request_start"]) * 1000)
                    for r in done]
    raise KeyError(f"no benchmark {label} in the report")


def added_ttft(through_gateway_ms: list[float], engine_ms: list[float]) -> dict:
    """What the gateway, Redis and the worker's loop add to the engine's own time to first token, request by request
    (the same prompts in the same order): both medians, and the median of the per-request differences."""
    pairs = [g - e for g, e in zip(through_gateway_ms, engine_ms)]
    return {"requests": len(pairs), "gateway_ttft_ms_p50": round(statistics.median(through_gateway_ms), 1),
            "engine_ttft_ms_p50": round(statistics.median(engine_ms), 1),
            "added_ms_p50_of_differences": round(statistics.median(pairs), 1),
            "added_ms_min_max": [round(min(pairs), 1), round(max(pairs), 1)]}


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _rate(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def _pair(a, b, fmt) -> str:
    return f"{fmt(a)} / {fmt(b)}"


def side_by_side(ours: list[Level], peer: list[Level] | None, peer_name: str = LLAMA) -> str:
    """The concurrency levels both servers ran, one row each, every cell `batcher / peer`; without a peer, batcher's
    figures alone."""
    head = ["level", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "output tok/s",
            "done / errored / cut"]
    by_label = {row.label: row for row in peer or []}
    lines = []
    for row in ours:
        other = by_label.get(row.label) if peer is not None else None
        counts = f"{row.successful} / {row.errored} / {row.incomplete}"
        if peer is None:
            cells = [_ms(row.ttft_p50), _ms(row.ttft_p99), _ms(row.itl_p50), _ms(row.itl_p99),
                     _rate(row.output_tokens_per_s), counts]
        else:
            o = other or Level(row.label, row.kind, 0, 0, 0, None, None, None, None, None, None, None, 0.0)
            cells = [_pair(row.ttft_p50, o.ttft_p50, _ms), _pair(row.ttft_p99, o.ttft_p99, _ms),
                     _pair(row.itl_p50, o.itl_p50, _ms), _pair(row.itl_p99, o.itl_p99, _ms),
                     _pair(row.output_tokens_per_s, o.output_tokens_per_s, _rate),
                     f"{counts}; {o.successful} / {o.errored} / {o.incomplete}"]
        lines.append([row.label, *cells])
    title = f"batcher / {peer_name}" if peer is not None else "batcher alone"
    return _table([f"{head[0]} ({title})", *head[1:]], lines)


def per_server(results: dict[str, list[Level]]) -> str:
    """Every benchmark of every server, one row each (a sweep's rates are each server's own, so they do not pair)."""
    head = ["server", "strategy", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "output tok/s",
            "done / errored / cut"]
    lines = [[server, row.label, _ms(row.ttft_p50), _ms(row.ttft_p99), _ms(row.itl_p50), _ms(row.itl_p99),
              _rate(row.output_tokens_per_s), f"{row.successful} / {row.errored} / {row.incomplete}"]
             for server, rows in results.items() for row in rows]
    return _table(head, lines)


def _table(head: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(line) + " |" for line in lines]
    return "\n".join(out)
