"""`batcher bench`: one workload through this engine's systems, in one process, on equal terms.

Systems (`rqbatcher.workers.bench.system`): `batcher:continuous` and `batcher:static`, run here step by step, or
through Redis and a worker with `@redis`, with or without prefix caching. They run one after the other with the same
weights, slots, page size, token budget and threads; each is warmed up first and freed after. Metrics come from
`rqbatcher.workers.bench.report`. The peers and the roofline are compared from a checkout
(`python -m benchmarks.compare`, which runs these systems through `run_on_engine`).
"""

from __future__ import annotations

import gc
import time
from dataclasses import replace

import torch

from rqbatcher.config import EngineConfig
from rqbatcher.schema import GenerationRequest, SamplingParams
from rqbatcher.workers.bench.record import PeakRss, SystemRun, by_arrival, wait_until
from rqbatcher.workers.bench.report import BenchReport, bench_report
from rqbatcher.workers.bench.system import System
from rqbatcher.workers.bench.workload import WorkloadRequest
from rqbatcher.workers.engine.engine import Engine, build_engine
from rqbatcher.workers.model.precision import resolve_dtype
from rqbatcher.workers.model.runner import resolve_device


def workload_request(item: WorkloadRequest, vocab_size: int) -> GenerationRequest:
    return GenerationRequest(prompt_token_ids=item.prompt_token_ids(vocab_size),
                             sampling=SamplingParams(max_tokens=item.max_tokens, ignore_eos=True))


def run_batcher(engine: Engine, workload: list[WorkloadRequest], name: str) -> SystemRun:
    """Drive the engine step by step; every step's outputs are stamped when the step returns."""
    run = SystemRun(name, slots=engine.config.max_num_seqs, token_times={w.id: [] for w in workload},
                    cached_tokens={})
    vocab = engine.loaded.vocab_size
    engine.warm_up()
    pending = by_arrival(workload)
    with PeakRss() as rss:
        start = time.perf_counter()
        while pending or engine.has_work():
            now = time.perf_counter() - start
            while pending and pending[0].arrival_s <= now:
                item = pending.pop(0)
                engine.add(item.id, workload_request(item, vocab))
            if not engine.has_work():
                wait_until(start, pending[0].arrival_s)
                continue
            outputs = engine.step()
            t = time.perf_counter() - start
            for out in outputs:
                run.token_times[out.request_id].extend([t] * len(out.new_token_ids))
                if out.finished:
                    run.tokens[out.request_id] = out.token_ids
                    run.cached_tokens[out.request_id] = out.num_cached_tokens
            run.steps.append((t, engine.last_step.num_seqs))
            run.preemptions += engine.last_step.num_preempted
        run.wall_s = time.perf_counter() - start
    run.peak_rss_bytes = rss.peak
    return run


def run_on_engine(system: System, engine: Engine, workload: list[WorkloadRequest],
                  redis_url: str | None = None) -> SystemRun:
    """Run the workload on an engine built with `system.engine_config`: in this process, or through Redis."""
    if not system.through_redis:
        return run_batcher(engine, workload, system.name)
    from rqbatcher.client import connect
    from rqbatcher.workers.bench.through_redis import run_batcher_redis

    engine.warm_up()
    vocab = engine.loaded.vocab_size
    return run_batcher_redis(engine, workload, system.name, connect(redis_url),
                             lambda item: workload_request(item, vocab))


def shared_settings(config: EngineConfig, threads: int) -> tuple[EngineConfig, torch.device]:
    """The settings every system runs with (`dtype="auto"` resolved once) and the device, with `threads` set."""
    torch.set_num_threads(threads)
    device = resolve_device(config.device)
    return replace(config, dtype=resolve_dtype(config.dtype, device)), device


def run_bench(workload: list[WorkloadRequest], name: str, systems: list[System], baseline: System,
              config: EngineConfig, threads: int, redis_url: str | None = None) -> BenchReport:
    """Run every system on the workload and compare them against `baseline` (one of `systems`)."""
    if baseline not in systems:
        raise ValueError(f"the baseline {baseline} must be one of the systems run: {', '.join(map(str, systems))}")
    config, device = shared_settings(config, threads)
    runs = {}
    for system in systems:
        runs[system.name] = run_on_engine(system, build_engine(system.engine_config(config)), workload, redis_url)
        gc.collect()
    return bench_report(name, workload, runs, baseline.name, config, threads, device)
