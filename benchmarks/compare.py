"""`batcher bench`'s systems against the peers, with the roofline, from a checkout:

    python -m benchmarks.compare --workload skew-small --systems batcher:continuous,hf-cb,llama-server --threads 1

The peers: the transformers baselines `hf-cb`, `hf-static`, `hf-naive` (`benchmarks.peers`) and llama.cpp's
`llama-server` (`benchmarks.llama_server`; built on first use, skipped with the reason where it cannot be), on a
GGUF in the run's dtype (Q8_0 with `--quantization int8`) or in the type it is named with (`llama-server:q4_k_m`,
`llama-server:f32`...: several side by side). `hf-cb` and `llama-server` run with their prefix cache unless named
with `:no-prefix-caching`. The batcher systems are the
product's (`rqbatcher.workers.bench.system`), run as `batcher bench` runs them. On top of `batcher bench`'s report,
each system's model FLOP utilisation (its useful FLOPs per second over a matmul probe measured in the same run) and
its % of the roofline limit (`benchmarks.roofline`), and a lone sequence's decode step against the weight-read floor.
"""

from __future__ import annotations

import gc
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import click

from benchmarks.llama_server import GGUF_CHOICES, SystemUnavailable
from benchmarks.roofline import (
    ModelCost,
    Roofline,
    cache_note,
    last_level_cache_bytes,
    lone_decode_step_s,
    matmul_probe,
    read_bandwidth,
)
from rqbatcher.cli.options import engine_options, redis_url_option
from rqbatcher.config import EngineConfig
from rqbatcher.workers.bench.record import SystemRun
from rqbatcher.workers.bench.report import BenchReport, bench_report
from rqbatcher.workers.bench.run import run_on_engine, shared_settings
from rqbatcher.workers.bench.system import NO_PREFIX_CACHING_SUFFIX, System
from rqbatcher.workers.bench.workload import WorkloadRequest, load_workload, workload_path
from rqbatcher.workers.engine.engine import build_engine
from rqbatcher.workers.model.precision import DTYPES

HF_PEERS = ("hf-cb", "hf-static", "hf-naive")
LLAMA_SERVER = "llama-server"
PREFIX_CACHING_PEERS = ("hf-cb", LLAMA_SERVER)
# What the tests run: every peer that needs no build (llama-server builds llama.cpp for minutes)
QUICK_PEERS = (*HF_PEERS, f"hf-cb{NO_PREFIX_CACHING_SUFFIX}")


@dataclass(frozen=True)
class Peer:
    kind: str
    prefix_caching: bool = True
    gguf: str = ""  # llama-server's weights, one of GGUF_CHOICES; "" for the type matching batcher's run

    @classmethod
    def parse(cls, name: str) -> Peer | None:
        """`hf-cb`, `llama-server:q4_k_m:no-prefix-caching`...; None where `name` names no peer."""
        kind = name.removesuffix(NO_PREFIX_CACHING_SUFFIX)
        caching = kind == name
        kind, _, gguf = kind.partition(":")
        if gguf and (kind != LLAMA_SERVER or gguf not in GGUF_CHOICES):
            return None
        if kind in (*HF_PEERS, LLAMA_SERVER) and (caching or kind in PREFIX_CACHING_PEERS):
            return cls(kind, caching, gguf)
        return None

    @property
    def name(self) -> str:
        gguf = f":{self.gguf}" if self.gguf else ""
        return self.kind + gguf + ("" if self.prefix_caching else NO_PREFIX_CACHING_SUFFIX)

    def without_prefix_caching(self) -> Peer:
        return replace(self, prefix_caching=False) if self.kind in PREFIX_CACHING_PEERS else self

    def __str__(self) -> str:
        return self.name


def parse_system(name: str) -> System | Peer:
    """A peer or a batcher system; ValueError names both kinds."""
    peer = Peer.parse(name)
    if peer is not None:
        return peer
    try:
        return System.parse(name)
    except ValueError as exc:
        raise ValueError(f"{exc}; the peers are {', '.join((*HF_PEERS, LLAMA_SERVER))}, "
                         f"{' and '.join(PREFIX_CACHING_PEERS)} take {NO_PREFIX_CACHING_SUFFIX}, and "
                         f"{LLAMA_SERVER} a GGUF type: {', '.join(GGUF_CHOICES)}") from None


@dataclass
class RooflineFigures:
    """One system's run against the roofline."""

    system: str
    model_gflop_s: float  # useful FLOPs: no padding, no recompute, no prefix found in the cache
    mfu: float
    pct_of_limit: float  # the roofline limit over this wall time, in percent (0-100)
    lone_decode_step_s: float | None  # a decode step with one sequence running, where measured


@dataclass
class Comparison:
    report: BenchReport
    probe_gflop_s: float
    roofline: Roofline
    figures: list[RooflineFigures] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # system -> why it could not run here
    cache_bytes: int | None = None  # the CPU's last-level cache, where the run was on a CPU that reports it

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        floor = self.roofline.weight_read_s
        lines = [self.report.table(), f"matmul probe {self.probe_gflop_s:.0f} GFLOP/s; {self.roofline.describe()} "
                                      f"(at {self.roofline.slots} slots)",
                 f"{'system':<40}{'model GFLOP/s':>14}{'MFU':>6}{'% limit':>8}"]
        lines += [f"{f.system:<40}{f.model_gflop_s:>14.1f}{f.mfu:>6.0%}{f.pct_of_limit:>7.0f}%" for f in self.figures]
        lines += [f"{f.system}: a lone sequence's decode step takes {f.lone_decode_step_s * 1e3:.3g} ms, "
                  f"{f.lone_decode_step_s / floor:.3g}x the weight-read floor ({floor * 1e3:.3g} ms)"
                  for f in self.figures if f.lone_decode_step_s is not None]
        note = cache_note(self.roofline.weight_bytes, self.cache_bytes)
        lines += [f"  note: {note}"] if note and any(f.lone_decode_step_s is not None for f in self.figures) else []
        lines += [f"  skipped {name}: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)


def run_peer(peer: Peer, config: EngineConfig, workload: list[WorkloadRequest],
             threads: int) -> tuple[SystemRun, ModelCost, float | None]:
    """The peer's run, the model's cost, and a lone decode step where the peer measures one."""
    from benchmarks import peers
    from rqbatcher.workers.model.runner import num_kv_blocks

    config = replace(config, prefix_caching=peer.prefix_caching)
    model = peers.load_hf_model(config)
    vocab = model.get_output_embeddings().weight.shape[0]
    cost = ModelCost.of(model)
    if peer.kind == LLAMA_SERVER:
        from benchmarks.llama_server import run_llama_server
        from rqbatcher.workers.model.loading import resolve

        del model  # the server loads its own copy
        return (run_llama_server(workload, vocab, Path(resolve(config.model)), config, threads, peer.name, peer.gguf),
                cost, None)
    if peer.kind == "hf-cb":
        num_blocks = min(num_kv_blocks(model, config), peers.workload_blocks(workload, config.block_size))
        return peers.run_hf_cb(model, workload, vocab, config, num_blocks, peer.name), cost, None
    if peer.kind == "hf-static":
        return peers.run_hf_static(model, workload, vocab, config.max_num_seqs), cost, None
    run = peers.run_hf_naive(model, workload, vocab)
    return run, cost, peers.lone_decode_gap_s(run)


def run_system(system: System | Peer, config: EngineConfig, workload: list[WorkloadRequest], redis_url: str | None,
               threads: int) -> tuple[SystemRun, ModelCost, float | None]:
    if isinstance(system, Peer):
        return run_peer(system, config, workload, threads)
    engine = build_engine(system.engine_config(config))
    run = run_on_engine(system, engine, workload, redis_url)
    return run, ModelCost.of(engine.runner.model), None if system.through_redis else lone_decode_step_s(engine)


def compare(workload: list[WorkloadRequest], name: str, systems: list[System | Peer], baseline: System | Peer,
            config: EngineConfig, threads: int, redis_url: str | None = None) -> Comparison:
    """Run every system on the workload; the report against `baseline` and each system against the roofline."""
    if baseline not in systems:
        raise ValueError(f"the baseline {baseline} must be one of the systems run: {', '.join(map(str, systems))}")
    config, device = shared_settings(config, threads)
    dtype = DTYPES[config.dtype]
    probe, read = matmul_probe(dtype, str(device)), read_bandwidth(str(device))
    runs, lone, skipped, cost = {}, {}, {}, None
    for system in systems:
        try:
            runs[system.name], system_cost, lone[system.name] = run_system(system, config, workload, redis_url,
                                                                           threads)
            if cost is None or not isinstance(system, Peer):  # batcher's model: int8 weights where it runs them
                cost = system_cost
        except SystemUnavailable as exc:
            if system == baseline:
                raise
            skipped[system.name] = str(exc)
        gc.collect()
    # the better of before and after: the device at its best, so that the limit is a bound
    probe, read = max(probe, matmul_probe(dtype, str(device))), max(read, read_bandwidth(str(device)))
    roofline = Roofline.of(workload, cost, dtype, config.max_num_seqs, probe, read)
    comparison = Comparison(bench_report(name, workload, runs, baseline.name, config, threads, device), probe / 1e9,
                            roofline, skipped=skipped,
                            cache_bytes=last_level_cache_bytes() if device.type == "cpu" else None)
    for run in runs.values():
        cached = run.cached_tokens or {}
        flops = sum(cost.request_flops(w.prompt_len, len(run.tokens.get(w.id, [])), cached.get(w.id, 0))
                    for w in workload)
        comparison.figures.append(RooflineFigures(run.system, flops / run.wall_s / 1e9, flops / run.wall_s / probe,
                                                  roofline.pct_of_limit(run.wall_s), lone[run.system]))
    return comparison


def _systems(ctx, param, value):
    try:
        return [parse_system(s.strip()) for s in value.split(",") if s.strip()]
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@click.command()
@engine_options
@click.option("--workload", required=True, help="A workload file, or one `batcher bench` bundles.")
@click.option("--systems", callback=_systems, default="batcher:continuous,hf-cb", show_default=True,
              help="Comma-separated systems to run, in order: batcher's (as `batcher bench` names them) and the "
                   f"peers {', '.join((*HF_PEERS, LLAMA_SERVER))}.")
@redis_url_option
@click.option("--baseline", help="The system the ratios are against (default: the first one).")
@click.option("--threads", type=click.IntRange(1), default=1, show_default=True, help="torch CPU threads.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the full comparison as JSON.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False),
              help="Write a PNG: slot occupancy (static against continuous) and tokens over time (needs matplotlib).")
def main(engine_config, workload, systems, redis_url, baseline, threads, json_path, plot_path):
    """Run a workload through batcher's systems and the peers on equal terms; print the tables."""
    def as_run(system):
        """The system as this invocation runs it, after --no-prefix-caching."""
        return system if engine_config.prefix_caching else system.without_prefix_caching()

    systems = list(dict.fromkeys(map(as_run, systems)))
    try:
        baseline = as_run(parse_system(baseline)) if baseline else systems[0]
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--baseline") from None
    if baseline not in systems:
        raise click.BadParameter(f"{baseline} is not among --systems", param_hint="--baseline")
    comparison = compare(load_workload(workload), workload_path(workload).stem, systems, baseline, engine_config,
                         threads, redis_url)
    click.echo(comparison.table())
    if json_path:
        Path(json_path).write_text(json.dumps(comparison.to_dict(), indent=1))
    if plot_path:
        from benchmarks.plot import plot_report

        plot_report(comparison.report, plot_path)


if __name__ == "__main__":
    main()
