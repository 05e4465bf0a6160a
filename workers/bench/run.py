"""`batcher bench`: one workload through several systems, in one process, on equal terms.

Systems (`rqbatcher.workers.bench.system`): `batcher:continuous` and `batcher:static` (this engine, run here step by
step, or through Redis and a worker with `@redis`, with or without prefix caching), and the transformers
baselines `hf-cb`, `hf-static`, `hf-naive` (`rqbatcher.workers.bench.peers`), and llama.cpp's `llama-server`
(`workers.bench.llama_server`; skipped, with the reason, where it cannot be built). They run one after the other with
the same weights, slots, page size, token budget and threads; each is warmed up first and freed after.
Metrics come from `rqbatcher.workers.bench.report`.
"""

from __future__ import annotations

import gc
import time
from dataclasses import replace
from pathlib import Path

import torch

from rqbatcher.config import EngineConfig
from rqbatcher.schema import GenerationRequest, SamplingParams
from rqbatcher.workers.bench.llama_server import SystemUnavailable
from rqbatcher.workers.bench.record import PeakRss, SystemRun, by_arrival, wait_until
from rqbatcher.workers.bench.report import BenchReport, environment, system_report
from rqbatcher.workers.bench.roofline import ModelCost, Roofline, lone_decode_step_s, matmul_probe, read_bandwidth
from rqbatcher.workers.bench.system import System
from rqbatcher.workers.bench.workload import WorkloadRequest, shared_prefix_tokens
from rqbatcher.workers.engine.engine import Engine, build_engine
from rqbatcher.workers.model.precision import DTYPES, resolve_dtype
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


def run_system(system: System, config: EngineConfig, workload: list[WorkloadRequest],
               redis_url: str | None = None, threads: int = 1) -> tuple[SystemRun, ModelCost]:
    """Load the model for one system, run the workload, and return the run and the model's cost."""
    config = system.engine_config(config)
    if system.kind == "batcher":
        engine = build_engine(config)
        if not system.through_redis:
            run = run_batcher(engine, workload, system.name)
            run.lone_decode_step_s = lone_decode_step_s(engine)
            return run, ModelCost.of(engine.runner.model)
        from rqbatcher.client import connect
        from rqbatcher.workers.bench.through_redis import run_batcher_redis

        engine.warm_up()
        vocab = engine.loaded.vocab_size
        run = run_batcher_redis(engine, workload, system.name, connect(redis_url),
                                lambda item: workload_request(item, vocab))
        return run, ModelCost.of(engine.runner.model)

    from rqbatcher.workers.bench import peers
    from rqbatcher.workers.model.runner import num_kv_blocks

    model = peers.load_hf_model(config)
    vocab = model.get_output_embeddings().weight.shape[0]
    if system.kind == "llama-server":
        from rqbatcher.workers.bench.llama_server import run_llama_server
        from rqbatcher.workers.model.loading import resolve

        cost = ModelCost.of(model)
        del model  # the server loads its own copy
        return run_llama_server(workload, vocab, Path(resolve(config.model)), config, threads, system.name), cost
    if system.kind == "hf-cb":
        num_blocks = min(num_kv_blocks(model, config), peers.workload_blocks(workload, config.block_size))
        run = peers.run_hf_cb(model, workload, vocab, config, num_blocks, system.name)
    elif system.kind == "hf-static":
        run = peers.run_hf_static(model, workload, vocab, config.max_num_seqs)
    else:
        run = peers.run_hf_naive(model, workload, vocab)
    return run, ModelCost.of(model)


def run_bench(workload: list[WorkloadRequest], name: str, systems: list[System], baseline: System,
              config: EngineConfig, threads: int, redis_url: str | None = None) -> BenchReport:
    """Run every system on the workload and compare them against `baseline` (one of `systems`)."""
    if baseline not in systems:
        raise ValueError(f"the baseline {baseline} must be one of the systems run: {', '.join(map(str, systems))}")
    torch.set_num_threads(threads)
    device = resolve_device(config.device)
    config = replace(config, dtype=resolve_dtype(config.dtype, device))  # every system runs in the same dtype
    dtype = DTYPES[config.dtype]
    probe, read = matmul_probe(dtype, str(device)), read_bandwidth(str(device))
    runs: dict[System, SystemRun] = {}
    skipped: dict[str, str] = {}
    cost = None
    for system in systems:
        try:
            runs[system], cost = run_system(system, config, workload, redis_url, threads)
        except SystemUnavailable as exc:
            if system == baseline:
                raise
            skipped[system.name] = str(exc)
        gc.collect()
    # the better of before and after: the device at its best, so that the limit is a bound
    probe, read = max(probe, matmul_probe(dtype, str(device))), max(read, read_bandwidth(str(device)))
    roofline = Roofline.of(workload, cost, dtype, config.max_num_seqs, probe, read)
    device_name, versions = environment(device)
    report = BenchReport(workload=name, model=config.model, dtype=config.dtype, threads=threads, device=device_name,
                         versions=versions, probe_gflop_s=probe / 1e9, baseline=baseline.name,
                         requests=len(workload), prompt_tokens=sum(w.prompt_len for w in workload),
                         shared_prefix_tokens=shared_prefix_tokens(workload), roofline=roofline, skipped=skipped)
    report.systems = [system_report(runs[s], workload, cost, probe, runs[baseline], roofline,
                                    report.shared_prefix_tokens) for s in systems if s in runs]
    return report
