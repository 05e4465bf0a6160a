"""The benchmark harness on a tiny model: every system runs, agrees on greedy tokens, and reports."""

import json
import random

import pytest
import torch
from click.testing import CliRunner

from rqbatcher.cli import main
from rqbatcher.config import EngineConfig
from rqbatcher.workers.bench.report import first_difference, percentiles
from rqbatcher.workers.bench.roofline import ModelCost, Roofline
from rqbatcher.workers.bench.run import run_bench
from rqbatcher.workers.bench.system import ALL_SYSTEMS, System
from rqbatcher.workers.bench.workload import WorkloadError, WorkloadRequest, load_workload, shared_prefix_tokens
from tests.jobs_support import claim_database, release_database

WORKLOAD = [WorkloadRequest(i, f"r{i}", prompt_len, max_tokens, 0.0)
            for i, (prompt_len, max_tokens) in enumerate([(9, 3), (21, 12), (5, 6), (14, 2), (30, 5)])]
# two more that share a 12-token prefix (three blocks of 4) with each other
WORKLOAD += [WorkloadRequest(5, "r5", 15, 4, 0.0, "doc", 12), WorkloadRequest(6, "r6", 13, 3, 0.0, "doc", 12)]


@pytest.fixture(scope="module")
def report(tiny_model_dir):
    """Every system, the @redis ones through a database of the real Redis that only this module uses."""
    config = EngineConfig(model=str(tiny_model_dir("llama")), max_num_seqs=2, max_num_batched_tokens=16,
                          block_size=4, kv_cache_bytes=1 << 20, dtype="float32")
    url, connection = claim_database()
    try:
        yield run_bench(WORKLOAD, "tiny", [System.parse(s) for s in ALL_SYSTEMS], System.parse("batcher:static"),
                        config, threads=1, redis_url=url)
        assert not connection.keys("batcher:stream:*"), "the @redis runs left their streams behind"
    finally:
        release_database(connection)


def test_every_system_generates_the_same_greedy_tokens(report):
    assert [s.system for s in report.systems] == list(ALL_SYSTEMS)
    for s in report.systems:
        assert s.generated_tokens == sum(w.max_tokens for w in WORKLOAD), s.system
        assert s.mismatched_requests == [], s.system
    assert report.all_agree


def test_prefix_hits_are_reported_against_the_shared_tokens(report):
    assert report.shared_prefix_tokens == 12
    for s in report.systems:
        if s.system.startswith("batcher:") and "no-prefix-caching" not in s.system:
            assert (s.cached_tokens, s.prefix_hit_rate) == (12, 1.0), s.system
        elif s.system.startswith("batcher:"):
            assert (s.cached_tokens, s.prefix_hit_rate) == (0, 0.0), s.system
        else:
            assert (s.cached_tokens, s.prefix_hit_rate) == (None, None), s.system
        assert s.total_tok_s == pytest.approx(s.prompt_tok_s + s.generated_tok_s)
    assert "prefix hits" in report.table() and "total tok/s" in report.table()
    cached, uncached = report.system("batcher:continuous"), report.system("batcher:continuous:no-prefix-caching")
    assert cached.model_gflop_s * cached.wall_s < uncached.model_gflop_s * uncached.wall_s  # it skipped the prefix


def test_metrics_are_derived_from_per_token_times(report):
    table = report.table()
    for s in report.systems:
        assert s.generated_tok_s > 0 and s.prompt_tok_s > 0
        assert 0 < s.mean_occupancy <= 1
        assert s.ttft_s["p50"] <= s.ttft_s["max"] and s.itl_s["p50"] <= s.itl_s["max"]
        assert s.cumulative_tokens[-1][1] == s.generated_tokens
        assert 0 < s.mfu < 1 and s.peak_rss_mb > 0
        assert 0 < s.pct_of_limit <= 100, s.system
        in_process = s.system.startswith("batcher:") and not s.system.endswith("@redis")
        assert (s.lone_decode_step_s is not None) == (in_process or s.system == "hf-naive")
        assert s.system in table
    assert report.system("batcher:static").mean_batch < report.system("batcher:continuous").mean_batch + 1e-9
    as_json = json.loads(json.dumps(report.to_dict()))
    assert as_json["baseline"] == "batcher:static" and as_json["dtype"] == "float32"
    assert as_json["roofline"]["limit_s"] > 0 and "pct_of_limit" in as_json["systems"][0]
    assert "% limit" in table and "roofline limit" in table and "weight-read floor" in table


def test_a_disagreement_is_reported():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_model_cost_counts_weights_and_attention(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"))
    cost = ModelCost.of(model)
    # 2 layers of q, k, v, o (64x64, 64x32, 64x32, 64x64) and gate, up, down (64x128 each); head 384x64
    assert cost.matmul_params == 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128)
    assert cost.head_params == 384 * 64
    assert cost.kv_values_per_key == 2 * 2 * 2 * 16  # keys and values, 2 layers, 2 KV heads of 16
    assert cost.decode_keys(3, 1) == 0 and cost.decode_keys(3, 3) == 4 + 5  # two decodes, over 4 and 5 keys
    assert cost.decode_keys(3, 3, shared=2) == 2 + 3
    assert cost.request_flops(1, 1) == 2 * cost.matmul_params + 2 * cost.head_params + cost.attention_flops_per_key
    # 3 fed tokens, the first 2 from the prefix cache: only the third goes through the weights, over 3 keys
    assert cost.request_flops(3, 1, cached=2) == (2 * cost.matmul_params + 2 * cost.head_params
                                                  + 3 * cost.attention_flops_per_key)


def test_roofline_counts_the_decode_steps_any_scheduler_needs_and_the_flops():
    cost = ModelCost(matmul_params=1000, head_params=500, attention_flops_per_key=10, kv_values_per_key=4)
    # outputs 12+3+6+2+5+4+3 = 35: at 2 slots, 18 steps; at 32 slots the longest output, 12
    for slots, steps in ((2, 18), (32, 12)):
        roofline = Roofline.of(WORKLOAD, cost, torch.bfloat16, slots, matmul_flop_s=1e9, read_bytes_s=3e6)
        # r6 need not compute the 12-token prefix it shares with r5, nor read it in its decodes
        shared = {w.id: 12 if w.id == "r6" else 0 for w in WORKLOAD}
        flops = sum(cost.request_flops(w.prompt_len, w.max_tokens, shared[w.id]) for w in WORKLOAD)
        keys = sum(sum(w.prompt_len + 1 + i - shared[w.id] for i in range(w.max_tokens - 1)) for w in WORKLOAD)
        assert roofline.decode_steps == steps and roofline.weight_bytes == 1500 * 2
        assert roofline.kv_read_bytes == keys * 4 * 2
        # the decodes' attention is bound by its reads here (8 bytes a key at 3 MB/s, against 10 FLOPs at 1 GFLOP/s)
        assert roofline.limit_s == pytest.approx(steps * 1e-3 + keys * 8 / 3e6 + (flops - keys * 10) / 1e9)
        assert roofline.pct_of_limit(2 * roofline.limit_s) == pytest.approx(50)


def test_systems_are_named_as_on_the_command_line():
    for name in ALL_SYSTEMS:
        assert System.parse(name).name == name
    assert System.parse("batcher:static@redis") == System("batcher", "static", through_redis=True)
    assert System.parse("batcher:continuous").via_redis().name == "batcher:continuous@redis"
    assert System.parse("hf-cb").via_redis() == System("hf-cb")
    assert System.parse("batcher:static:no-prefix-caching@redis") == System("batcher", "static", True, False)
    assert System.parse("batcher:continuous").without_prefix_caching().name == "batcher:continuous:no-prefix-caching"
    assert System.parse("hf-cb:no-prefix-caching") == System("hf-cb").without_prefix_caching()
    assert System("hf-naive").without_prefix_caching().name == "hf-naive"
    plain = System.parse("batcher:static:no-prefix-caching:no-batch-invariant@redis")
    assert plain == System("batcher", "static", True, False, batch_invariant=False)
    assert plain.name == "batcher:static:no-prefix-caching:no-batch-invariant@redis"
    assert not plain.engine_config(EngineConfig()).batch_invariant
    assert System.parse("batcher:static").engine_config(EngineConfig()).batch_invariant
    for bad in ("vllm", "batcher:eager", "hf-cb@redis", "batcher:static@redis@redis", "hf-naive:no-prefix-caching",
                "batcher:continuous@redis:no-prefix-caching", "hf-cb:no-batch-invariant",
                "batcher:static:no-batch-invariant:no-prefix-caching"):
        with pytest.raises(ValueError, match=f"unknown {bad}"):
            System.parse(bad)
    shared = EngineConfig(policy="continuous", block_size=8)
    run_as = System.parse("batcher:static:no-prefix-caching").engine_config(shared)
    assert (run_as.policy, run_as.prefix_caching, run_as.block_size) == ("static", False, 8)
    assert System("hf-cb").engine_config(shared) == shared


def test_shared_prefixes_are_drawn_as_the_shared_readme_says(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in [
        {"id": "a", "prompt_len": 6, "max_tokens": 2, "arrival_s": 0.0, "prefix_id": "d1", "prefix_len": 4},
        {"id": "b", "prompt_len": 5, "max_tokens": 2, "arrival_s": 0.0, "prefix_id": "d1", "prefix_len": 4},
        {"id": "c", "prompt_len": 3, "max_tokens": 2, "arrival_s": 0.0}]))
    a, b, c = load_workload(str(path))
    doc = random.Random("prefix:d1")
    prefix = [doc.randrange(100, 284) for _ in range(4)]
    own = random.Random(1)
    assert b.prompt_token_ids(384) == prefix + [own.randrange(100, 284)]
    assert a.prompt_token_ids(384)[:4] == prefix and a.prompt_token_ids(384)[4:] != b.prompt_token_ids(384)[4:]
    plain = random.Random(2)
    assert c.prompt_token_ids(384) == [plain.randrange(100, 284) for _ in range(3)]
    assert shared_prefix_tokens([a, b, c]) == 4
    for name in ("doc-qa", "system-prompt"):  # the bundled prefix workloads, as docs/benchmarks.md describes them
        items = load_workload(name)
        firsts = len({w.prefix_id for w in items})
        assert shared_prefix_tokens(items) == sum(w.prefix_len for w in items) - firsts * items[0].prefix_len
    assert shared_prefix_tokens(load_workload("doc-qa")) == 56 * 1024


@pytest.mark.parametrize("line,reason", [
    ({"id": "a", "prompt_len": 4, "max_tokens": 2, "prefix_id": "d"}, "prefix_id and prefix_len go together"),
    ({"id": "a", "prompt_len": 4, "max_tokens": 2, "prefix_id": "d", "prefix_len": 5}, "prefix_len must be"),
    ({"id": "a", "max_tokens": 2}, "missing 'prompt_len'"),
])
def test_a_malformed_workload_line_is_named(tmp_path, line, reason):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"id": "ok", "prompt_len": 3, "max_tokens": 1}) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(WorkloadError, match=f"bad.jsonl: request 2 is not a workload request: {reason}"):
        load_workload(str(path))
    result = CliRunner().invoke(main, ["bench", "--workload", str(path)])
    assert result.exit_code != 0 and "request 2" in result.output


def test_percentiles():
    assert percentiles([]) == {"p50": None, "p99": None, "max": None}
    assert percentiles([3.0, 1.0, 2.0]) == {"p50": 2.0, "p99": 3.0, "max": 3.0}


def test_cli_runs_systems_and_writes_json_and_plot(tiny_model_dir, tmp_path):
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps({"id": w.id, "prompt_len": w.prompt_len, "max_tokens": w.max_tokens,
                                            "arrival_s": 0.0}) + "\n" for w in WORKLOAD[:3]))
    pytest.importorskip("matplotlib")
    result = CliRunner().invoke(main, [
        "bench", "--model", str(tiny_model_dir("llama")), "--workload", str(workload), "--max-num-seqs", "2",
        "--kv-cache-bytes", str(1 << 20), "--dtype", "float32", "--systems", "batcher:continuous,hf-naive",
        "--baseline", "hf-naive", "--no-prefix-caching", "--json", str(tmp_path / "r.json"),
        "--plot", str(tmp_path / "r.png")])
    assert result.exit_code == 0, result.output
    assert "batcher:continuous:no-prefix-caching" in result.output and "x hf-naive" in result.output
    systems = json.loads((tmp_path / "r.json").read_text())["systems"]
    assert [s["system"] for s in systems] == ["batcher:continuous:no-prefix-caching", "hf-naive"]
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_refuses_an_unknown_system_or_baseline(tmp_path):
    result = CliRunner().invoke(main, ["bench", "--workload", "skew-small", "--systems", "vllm"])
    assert result.exit_code != 0 and "unknown vllm" in result.output
    result = CliRunner().invoke(main, ["bench", "--workload", "skew-small", "--systems", "hf-cb", "--baseline",
                                       "hf-naive"])
    assert result.exit_code != 0 and "not among --systems" in result.output


def test_hf_baselines_ignore_the_models_eos(tiny_model_dir):
    """Workloads generate exactly max_tokens: the model's default EOS must not end a row early."""
    from rqbatcher.workers.bench.peers import load_hf_model, run_hf_naive

    model = load_hf_model(EngineConfig(model=str(tiny_model_dir("llama")), dtype="float32"))
    first = run_hf_naive(model, WORKLOAD[:1], 384).tokens["r0"]
    model.generation_config.eos_token_id = first[0]
    assert run_hf_naive(model, WORKLOAD[:1], 384).tokens["r0"] == first


def test_the_job_rate_bench_runs_every_job_through_a_real_worker():
    from rqbatcher.workers.bench.experiments.job_rate import QUEUE, rate
    from rqbatcher.workers.bench.private_redis import private_redis

    with private_redis() as connection:
        assert rate(connection, jobs=40, tokens=3, slots=8) > 0
        finished = connection.zcard(f"rq:finished:{QUEUE}")
        assert finished == 40 and connection.llen(f"rq:queue:{QUEUE}") == 0
