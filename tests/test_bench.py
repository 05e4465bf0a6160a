"""`batcher bench` on a tiny model: every system runs, agrees on greedy tokens, and reports."""

import json
import random
import sys

import pytest
from click.testing import CliRunner

from rqbatcher.cli import main
from rqbatcher.config import EngineConfig
from rqbatcher.errors import BatcherError
from rqbatcher.workers.bench.record import psutil
from rqbatcher.workers.bench.report import first_difference, percentiles
from rqbatcher.workers.bench.run import run_bench
from rqbatcher.workers.bench.system import ALL_SYSTEMS, System
from rqbatcher.workers.bench.workload import WorkloadError, WorkloadRequest, load_workload, shared_prefix_tokens
from tests.jobs_support import claim_database, release_database

WORKLOAD = [WorkloadRequest(i, f"r{i}", prompt_len, max_tokens, 0.0)
            for i, (prompt_len, max_tokens) in enumerate([(9, 3), (21, 12), (5, 6), (14, 2), (30, 5)])]
# two more that share a 12-token prefix (three blocks of 4) with each other
WORKLOAD += [WorkloadRequest(5, "r5", 15, 4, 0.0, "doc", 12), WorkloadRequest(6, "r6", 13, 3, 0.0, "doc", 12)]


def tiny_config(tiny_model_dir) -> EngineConfig:
    return EngineConfig(model=str(tiny_model_dir("llama")), max_num_seqs=2, max_num_batched_tokens=16, block_size=4,
                        kv_cache_bytes=1 << 20, dtype="float32")


@pytest.fixture(scope="module")
def report(tiny_model_dir):
    """Every system, the @redis ones through a database of the real Redis that only this module uses."""
    url, connection = claim_database()
    try:
        yield run_bench(WORKLOAD, "tiny", [System.parse(s) for s in ALL_SYSTEMS], System.parse("batcher:static"),
                        tiny_config(tiny_model_dir), threads=1, redis_url=url)
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
        if "no-prefix-caching" not in s.system:
            assert (s.cached_tokens, s.prefix_hit_rate) == (12, 1.0), s.system
        else:
            assert (s.cached_tokens, s.prefix_hit_rate) == (0, 0.0), s.system
        assert s.total_tok_s == pytest.approx(s.prompt_tok_s + s.generated_tok_s)
    assert "prefix hits" in report.table() and "total tok/s" in report.table()


def test_metrics_are_derived_from_per_token_times(report):
    table = report.table()
    for s in report.systems:
        assert s.generated_tok_s > 0 and s.prompt_tok_s > 0
        assert 0 < s.mean_occupancy <= 1
        assert s.ttft_s["p50"] <= s.ttft_s["max"] and s.itl_s["p50"] <= s.itl_s["max"]
        assert s.cumulative_tokens[-1][1] == s.generated_tokens
        assert s.peak_rss_mb > 0
        assert s.system in table
    assert report.system("batcher:static").mean_batch < report.system("batcher:continuous").mean_batch + 1e-9
    as_json = json.loads(json.dumps(report.to_dict()))
    assert as_json["baseline"] == "batcher:static" and as_json["dtype"] == "float32"
    assert [s["system"] for s in as_json["systems"]] == list(ALL_SYSTEMS)


def test_a_disagreement_is_reported():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_systems_are_named_as_on_the_command_line():
    for name in ALL_SYSTEMS:
        assert System.parse(name).name == name
    assert System.parse("batcher:static@redis") == System("static", through_redis=True)
    assert System.parse("batcher:continuous").via_redis().name == "batcher:continuous@redis"
    assert System.parse("batcher:static:no-prefix-caching@redis") == System("static", True, False)
    assert System.parse("batcher:continuous").without_prefix_caching().name == "batcher:continuous:no-prefix-caching"
    plain = System.parse("batcher:static:no-prefix-caching:no-batch-invariant@redis")
    assert plain == System("static", True, False, batch_invariant=False)
    assert plain.name == "batcher:static:no-prefix-caching:no-batch-invariant@redis"
    assert not plain.engine_config(EngineConfig()).batch_invariant
    assert System.parse("batcher:static").engine_config(EngineConfig()).batch_invariant
    for bad in ("vllm", "batcher:eager", "hf-cb", "batcher:static@redis@redis", "continuous",
                "batcher:continuous@redis:no-prefix-caching", "batcher:static:no-batch-invariant:no-prefix-caching"):
        with pytest.raises(ValueError, match=f"unknown {bad}"):
            System.parse(bad)
    with pytest.raises(ValueError, match="python -m benchmarks.compare"):  # where the peers went
        System.parse("hf-cb")
    shared = EngineConfig(policy="continuous", block_size=8)
    run_as = System.parse("batcher:static:no-prefix-caching").engine_config(shared)
    assert (run_as.policy, run_as.prefix_caching, run_as.block_size) == ("static", False, 8)


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


def test_cli_runs_systems_and_writes_json(tiny_model_dir, tmp_path):
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps({"id": w.id, "prompt_len": w.prompt_len, "max_tokens": w.max_tokens,
                                            "arrival_s": 0.0}) + "\n" for w in WORKLOAD[:3]))
    result = CliRunner().invoke(main, [
        "bench", "--model", str(tiny_model_dir("llama")), "--workload", str(workload), "--max-num-seqs", "2",
        "--kv-cache-bytes", str(1 << 20), "--dtype", "float32", "--systems", "batcher:continuous,batcher:static",
        "--baseline", "batcher:static", "--no-prefix-caching", "--json", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    assert "batcher:continuous:no-prefix-caching" in result.output and "x batcher:static" in result.output
    systems = json.loads((tmp_path / "r.json").read_text())["systems"]
    assert [s["system"] for s in systems] == ["batcher:continuous:no-prefix-caching",
                                              "batcher:static:no-prefix-caching"]
    assert all(s["generated_tokens"] == sum(w.max_tokens for w in WORKLOAD[:3]) for s in systems)


def test_cli_refuses_an_unknown_system_or_baseline(tmp_path):
    result = CliRunner().invoke(main, ["bench", "--workload", "skew-small", "--systems", "hf-cb"])
    assert result.exit_code != 0 and "unknown hf-cb" in result.output and "benchmarks.compare" in result.output
    result = CliRunner().invoke(main, ["bench", "--workload", "skew-small", "--systems", "batcher:static",
                                       "--baseline", "batcher:continuous"])
    assert result.exit_code != 0 and "not among --systems" in result.output


def test_without_psutil_the_bench_names_its_extra_before_loading_a_model(monkeypatch):
    monkeypatch.setitem(sys.modules, "psutil", None)  # as where it is not installed
    with pytest.raises(BatcherError, match=r"pip install 'rqbatcher\[bench\]'"):
        psutil()
    result = CliRunner().invoke(main, ["bench", "--workload", "skew-small", "--model", "no-such-model"])
    assert result.exit_code != 0 and "rqbatcher[bench]" in result.output
