"""The checkout's benchmarks/ on a tiny model: `python -m benchmarks.compare` runs batcher's systems and the
transformers peers on equal terms, they agree on greedy tokens, and each is set against the roofline."""

import json

import pytest
import torch
from click.testing import CliRunner

from benchmarks import compare as cmp
from benchmarks.roofline import ModelCost, Roofline, cache_note, last_level_cache_bytes
from rqbatcher.config import EngineConfig
from rqbatcher.workers.bench.system import System
from tests.test_bench import WORKLOAD, tiny_config

SYSTEMS = ("batcher:static", "batcher:continuous", "batcher:continuous:no-prefix-caching", *cmp.QUICK_PEERS)


@pytest.fixture(scope="module")
def comparison(tiny_model_dir):
    systems = [cmp.parse_system(s) for s in SYSTEMS]
    return cmp.compare(WORKLOAD, "tiny", systems, systems[0], tiny_config(tiny_model_dir), threads=1)


def test_batcher_and_the_peers_generate_the_same_greedy_tokens(comparison):
    report = comparison.report
    assert [s.system for s in report.systems] == list(SYSTEMS)
    for s in report.systems:
        assert s.generated_tokens == sum(w.max_tokens for w in WORKLOAD), s.system
        assert s.mismatched_requests == [], s.system
    peers = [s for s in report.systems if not s.system.startswith("batcher:")]
    assert {(s.cached_tokens, s.prefix_hit_rate) for s in peers} == {(None, None)}  # the peers do not say


def test_every_system_is_set_against_the_roofline(comparison):
    figures = {f.system: f for f in comparison.figures}
    assert list(figures) == list(SYSTEMS)
    for f in figures.values():
        assert 0 < f.mfu < 1 and 0 < f.pct_of_limit <= 100, f.system
        in_process = f.system.startswith("batcher:")
        assert (f.lone_decode_step_s is not None) == (in_process or f.system == "hf-naive"), f.system
    cached, uncached = comparison.report.system("batcher:continuous"), comparison.report.system(
        "batcher:continuous:no-prefix-caching")
    useful = {name: figures[name].model_gflop_s * run.wall_s for name, run in (
        ("batcher:continuous", cached), ("batcher:continuous:no-prefix-caching", uncached))}
    assert useful["batcher:continuous"] < useful["batcher:continuous:no-prefix-caching"]  # it skipped the prefix
    table = comparison.table()
    assert "% limit" in table and "roofline limit" in table and "weight-read floor" in table
    # a tiny model's weights fit in any CPU's last-level cache, wherever the CPU reports one
    assert ("fit in this CPU's last-level cache" in table) == (comparison.cache_bytes is not None)
    as_json = json.loads(json.dumps(comparison.to_dict()))
    assert as_json["roofline"]["limit_s"] > 0 and as_json["report"]["baseline"] == "batcher:static"


def test_peers_and_batcher_systems_are_named_as_on_the_command_line():
    assert cmp.parse_system("hf-cb") == cmp.Peer("hf-cb")
    assert cmp.parse_system("batcher:static@redis") == System("static", through_redis=True)
    assert cmp.parse_system("hf-cb:no-prefix-caching") == cmp.Peer("hf-cb").without_prefix_caching()
    assert cmp.Peer("hf-naive").without_prefix_caching().name == "hf-naive"
    assert cmp.parse_system("llama-server:no-prefix-caching").name == "llama-server:no-prefix-caching"
    for bad in ("vllm", "hf-cb@redis", "hf-naive:no-prefix-caching", "hf-cb:no-batch-invariant", "llama-server@redis"):
        with pytest.raises(ValueError, match=f"unknown {bad}.*the peers are hf-cb"):
            cmp.parse_system(bad)
    assert "llama-server" not in cmp.QUICK_PEERS  # it builds llama.cpp for minutes: tests/test_llama_server_peer.py


def test_the_command_line_writes_json_and_plot(tiny_model_dir, tmp_path):
    pytest.importorskip("matplotlib")
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps({"id": w.id, "prompt_len": w.prompt_len, "max_tokens": w.max_tokens,
                                            "arrival_s": 0.0}) + "\n" for w in WORKLOAD[:3]))
    result = CliRunner().invoke(cmp.main, [
        "--model", str(tiny_model_dir("llama")), "--workload", str(workload), "--max-num-seqs", "2",
        "--kv-cache-bytes", str(1 << 20), "--dtype", "float32", "--systems", "batcher:continuous,hf-naive",
        "--baseline", "hf-naive", "--no-prefix-caching", "--json", str(tmp_path / "r.json"),
        "--plot", str(tmp_path / "r.png")])
    assert result.exit_code == 0, result.output
    assert "batcher:continuous:no-prefix-caching" in result.output and "x hf-naive" in result.output
    systems = json.loads((tmp_path / "r.json").read_text())["report"]["systems"]
    assert [s["system"] for s in systems] == ["batcher:continuous:no-prefix-caching", "hf-naive"]
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = CliRunner().invoke(cmp.main, ["--workload", "skew-small", "--systems", "hf-cb", "--baseline", "hf-naive"])
    assert result.exit_code != 0 and "not among --systems" in result.output


def test_hf_baselines_ignore_the_models_eos(tiny_model_dir):
    """Workloads generate exactly max_tokens: the model's default EOS must not end a row early."""
    from benchmarks.peers import load_hf_model, run_hf_naive

    model = load_hf_model(EngineConfig(model=str(tiny_model_dir("llama")), dtype="float32"))
    first = run_hf_naive(model, WORKLOAD[:1], 384).tokens["r0"]
    model.generation_config.eos_token_id = first[0]
    assert run_hf_naive(model, WORKLOAD[:1], 384).tokens["r0"] == first


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
    assert cost.weight_bytes == 4 * (cost.matmul_params + cost.head_params)  # float32


def test_model_cost_of_int8_weights_counts_the_same_weights_at_a_byte_each(tiny_model_dir):
    """An engine on --quantization int8 (the LM head too) has the float model's FLOPs, and a decode step reads a byte
    per weight plus a float32 scale per output."""
    from transformers import AutoModelForCausalLM

    from rqbatcher.workers.model.int8_linear import quantize_linears

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"))
    full = ModelCost.of(model)
    quantize_linears(model, on_native=False)
    int8 = ModelCost.of(model)
    assert (int8.matmul_params, int8.head_params) == (full.matmul_params, full.head_params)
    outputs = 2 * (64 + 32 + 32 + 64 + 128 + 128 + 64) + 384
    assert int8.weight_bytes == full.matmul_params + full.head_params + 4 * outputs


def test_roofline_counts_the_decode_steps_any_scheduler_needs_and_the_flops():
    cost = ModelCost(matmul_params=1000, head_params=500, attention_flops_per_key=10, kv_values_per_key=4,
                     weight_bytes=1500 * 2)
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


def test_the_job_rate_bench_runs_every_job_through_a_real_worker():
    from benchmarks.job_rate import QUEUE, rate
    from benchmarks.private_redis import private_redis

    with private_redis() as connection:
        assert rate(connection, jobs=40, tokens=3, slots=8) > 0
        finished = connection.zcard(f"rq:finished:{QUEUE}")
        assert finished == 40 and connection.llen(f"rq:queue:{QUEUE}") == 0


def test_the_last_level_cache_is_the_largest_level_linux_reports(tmp_path):
    for index, (level, size) in enumerate([(1, "48K"), (1, "32K"), (2, "2048K"), (3, "307200K")]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "level").write_text(f"{level}\n")
        (tmp_path / f"index{index}" / "size").write_text(f"{size}\n")
    assert last_level_cache_bytes(tmp_path) == 300 << 20
    (tmp_path / "index3" / "size").write_text("1M\n")
    assert last_level_cache_bytes(tmp_path) == 1 << 20
    assert last_level_cache_bytes(tmp_path / "none") is None


def test_weights_that_fit_in_the_cache_are_noted_and_others_are_not():
    assert "135 MB" in cache_note(135_000_000, 300 << 20) and "315 MB" in cache_note(135_000_000, 300 << 20)
    assert cache_note(540_000_000, 300 << 20) is None
    assert cache_note(135_000_000, None) is None
