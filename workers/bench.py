"""`batcher bench`: a workload file through the engine, with per-token timestamps.

Reports generated and prompt tokens/s, time to first token and inter-token latency
(p50, p99, max) and mean slot occupancy. Arrival times in the file are honoured.
"""

from __future__ import annotations

import platform
import time
from dataclasses import asdict, dataclass, field

import torch
import transformers

from batcher.schema import GenerationRequest, SamplingParams
from batcher.workload import WorkloadRequest
from workers.engine import Engine

WARMUP_PROMPT_LEN = 16
WARMUP_MAX_TOKENS = 2


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]

    return {"p50": at(0.50), "p99": at(0.99), "max": ordered[-1]}


@dataclass
class BenchReport:
    workload: str
    policy: str
    model: str
    threads: int
    device: str
    requests: int
    wall_s: float
    prompt_tokens: int
    generated_tokens: int
    generated_tok_s: float
    prompt_tok_s: float
    ttft_s: dict
    itl_s: dict
    mean_occupancy: float
    steps: int
    preemptions: int
    versions: dict = field(default_factory=dict)
    timeline: list = field(default_factory=list)  # [(t, running seqs, cumulative generated tokens)] per step

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        ms = lambda d, k: "-" if d[k] is None else f"{d[k] * 1000:.0f}"  # noqa: E731
        return (f"{self.workload} [{self.policy}] {self.requests} requests in {self.wall_s:.1f}s, "
                f"{self.threads} thread(s) on {self.device}\n"
                f"  generated {self.generated_tok_s:.1f} tok/s, prompt {self.prompt_tok_s:.1f} tok/s\n"
                f"  TTFT ms p50 {ms(self.ttft_s, 'p50')} p99 {ms(self.ttft_s, 'p99')} max {ms(self.ttft_s, 'max')}\n"
                f"  ITL  ms p50 {ms(self.itl_s, 'p50')} p99 {ms(self.itl_s, 'p99')} max {ms(self.itl_s, 'max')}\n"
                f"  mean slot occupancy {self.mean_occupancy:.2f}, {self.steps} steps, "
                f"{self.preemptions} preemptions")


def _request(item: WorkloadRequest, vocab_size: int) -> GenerationRequest:
    return GenerationRequest(prompt_token_ids=item.prompt_token_ids(vocab_size),
                             sampling=SamplingParams(max_tokens=item.max_tokens, ignore_eos=True))


def _warm_up(engine: Engine) -> None:
    engine.add("warmup", GenerationRequest(prompt_token_ids=[100] * WARMUP_PROMPT_LEN,
                                           sampling=SamplingParams(max_tokens=WARMUP_MAX_TOKENS, ignore_eos=True)))
    while engine.has_work():
        engine.step()


def run_bench(engine: Engine, workload: list[WorkloadRequest], name: str, threads: int) -> tuple[BenchReport, dict]:
    """Run the workload; return the report and each request's generated token ids."""
    vocab = engine.loaded.vocab_size
    _warm_up(engine)
    pending = sorted(workload, key=lambda w: w.arrival_s)
    arrival = {w.id: w.arrival_s for w in workload}
    token_times: dict[str, list[float]] = {w.id: [] for w in workload}
    tokens: dict[str, list[int]] = {}
    timeline, preemptions, generated = [], 0, 0
    start = time.perf_counter()
    while pending or engine.has_work():
        now = time.perf_counter() - start
        while pending and pending[0].arrival_s <= now:
            item = pending.pop(0)
            engine.add(item.id, _request(item, vocab))
        if not engine.has_work():
            time.sleep(max(0.0, pending[0].arrival_s - now))
            continue
        outputs = engine.step()
        t = time.perf_counter() - start
        for out in outputs:
            token_times[out.request_id].extend([t] * len(out.new_token_ids))
            generated += len(out.new_token_ids)
            if out.finished:
                tokens[out.request_id] = out.token_ids
        stats = engine.last_step
        preemptions += stats.num_preempted
        timeline.append((t, stats.num_seqs, generated))
    wall = time.perf_counter() - start
    ttft = [times[0] - arrival[rid] for rid, times in token_times.items() if times]
    itl = [b - a for times in token_times.values() for a, b in zip(times, times[1:])]
    cfg = engine.config
    report = BenchReport(
        workload=name, policy=cfg.policy, model=engine.loaded.name, threads=threads,
        device=str(engine.runner.device) + ("" if engine.runner.device.type == "cuda" else f" ({platform.processor() or platform.machine()})"),
        requests=len(workload), wall_s=wall,
        prompt_tokens=sum(w.prompt_len for w in workload), generated_tokens=generated,
        generated_tok_s=generated / wall, prompt_tok_s=sum(w.prompt_len for w in workload) / wall,
        ttft_s=percentiles(ttft), itl_s=percentiles(itl),
        mean_occupancy=sum(n for _, n, _ in timeline) / (len(timeline) * cfg.max_num_seqs) if timeline else 0.0,
        steps=len(timeline), preemptions=preemptions,
        versions={"torch": torch.__version__, "transformers": transformers.__version__,
                  "python": platform.python_version()},
        timeline=timeline,
    )
    return report, tokens
