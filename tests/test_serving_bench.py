"""The serving bench's pure parts (benchmarks/serving_report.py, and the guidellm command line of
serving.py): a guidellm 0.8.1 JSON report, cut down to the fields the bench reads, into rows and tables."""

import json
from pathlib import Path

import pytest

from benchmarks import serving_report as sr
from benchmarks.serving import SERVED, Settings, gguf_name, guidellm_command


def distribution(count: int, p50: float = 0.0, p99: float = 0.0, mean: float = 0.0) -> dict:
    return {"count": count, "mean": mean, "percentiles": {"p50": p50, "p99": p99}}


def request(start: float, ttft_s: float | None, prompt: str, output: str = "text") -> dict:
    first = None if ttft_s is None else start + ttft_s
    return {"request_args": json.dumps({"body": {"model": SERVED, "prompt": prompt, "max_tokens": 4}}),
            "response_id": f"cmpl-job-{prompt}", "output": output,
            "info": {"timings": {"request_start": start, "first_token_iteration": first}}}


def benchmark(strategy: dict, ok: int, errored: int, cut: int, ttft=(100.0, 180.0), itl=(20.0, 31.0),
              tokens_per_s=55.5, requests=()) -> dict:
    return {"config": {"strategy": strategy}, "duration": 40.2,
            "metrics": {"request_totals": {"successful": ok, "errored": errored, "incomplete": cut, "total": None},
                        "time_to_first_token_ms": {"successful": distribution(ok, *ttft)},
                        "inter_token_latency_ms": {"successful": distribution(ok, *itl)},
                        "output_tokens_per_second": {"total": distribution(999, mean=tokens_per_s),
                                                     "successful": distribution(999, mean=1.0)},
                        "prompt_token_count": {"successful": distribution(ok, mean=256.0)},
                        "output_token_count": {"successful": distribution(ok, mean=64.0)}},
            "requests": {"successful": list(requests), "errored": [], "incomplete": []}}


REPORT = {"benchmarks": [
    benchmark({"type_": "concurrent", "streams": 1}, 3, 0, 1, requests=[
        request(20.0, 0.25, "second"), request(10.0, 0.5, "first"), request(30.0, None, "no text", output="")]),
    benchmark({"type_": "concurrent", "streams": 4}, 9, 1, 2, ttft=(400.0, 1234.5), tokens_per_s=120.04),
]}
SWEEP = {"benchmarks": [benchmark({"type_": "synchronous"}, 5, 0, 0),
                        benchmark({"type_": "throughput", "max_concurrency": 16}, 0, 0, 16),
                        benchmark({"type_": "constant", "rate": 0.3125}, 6, 0, 1)]}


def test_a_report_becomes_one_level_per_benchmark_in_order():
    rows = sr.levels(REPORT)
    assert [r.label for r in rows] == ["concurrent@1", "concurrent@4"]
    first, second = rows
    assert (first.successful, first.errored, first.incomplete) == (3, 0, 1)
    assert (second.ttft_p50, second.ttft_p99, second.itl_p50, second.itl_p99) == (400.0, 1234.5, 20.0, 31.0)
    assert second.output_tokens_per_s == 120.04  # the whole window's (status "total"), as guidellm's console shows
    assert (first.prompt_tokens_mean, first.output_tokens_mean, first.duration_s) == (256.0, 64.0, 40.2)


def test_a_sweep_is_labelled_by_strategy_and_a_benchmark_with_no_success_has_no_percentiles():
    rows = sr.levels(SWEEP)
    assert [r.label for r in rows] == ["synchronous", "throughput", "constant@0.31/s"]
    assert rows[1].ttft_p50 is None and rows[1].itl_p99 is None and rows[1].incomplete == 16


def test_the_concurrency_1_requests_come_back_in_the_order_sent_without_the_ones_that_had_no_text():
    sent = sr.sent_requests(REPORT, "concurrent@1")
    assert [(r.body["prompt"], r.response_id, round(r.ttft_ms, 3)) for r in sent] == [
        ("first", "cmpl-job-first", 500.0), ("second", "cmpl-job-second", 250.0)]
    with pytest.raises(KeyError):
        sr.sent_requests(REPORT, "concurrent@2")


def test_added_ttft_pairs_the_same_prompts():
    added = sr.added_ttft([30.0, 50.0, 41.0], [10.0, 12.0, 30.0])
    assert added == {"requests": 3, "gateway_ttft_ms_p50": 41.0, "engine_ttft_ms_p50": 12.0,
                     "added_ms_p50_of_differences": 20.0, "added_ms_min_max": [11.0, 38.0]}


def test_side_by_side_pairs_levels_and_says_when_the_peer_is_missing():
    ours = sr.levels(REPORT)
    peer = sr.levels({"benchmarks": [benchmark({"type_": "concurrent", "streams": 1}, 4, 0, 0, ttft=(90.0, 95.5),
                                               tokens_per_s=60.0)]})
    table = sr.side_by_side(ours, peer).splitlines()
    assert table[0].startswith("| level (batcher / llama-server) | TTFT p50 ms |") and table[1] == "|" + "---|" * 7
    assert table[2] == ("| concurrent@1 | 100 / 90.0 | 180 / 95.5 | 20.0 / 20.0 | 31.0 / 31.0 | 55.5 / 60.0 | "
                        "3 / 0 / 1; 4 / 0 / 0 |")
    assert table[3].startswith("| concurrent@4 | 400 / – | 1,234 / – |") and table[3].endswith("9 / 1 / 2; 0 / 0 / 0 |")
    alone = sr.side_by_side(ours, None).splitlines()
    assert alone[0].startswith("| level (batcher alone) |") and alone[3] == \
        "| concurrent@4 | 400 | 1,234 | 20.0 | 31.0 | 120.0 | 9 / 1 / 2 |"


def test_per_server_lists_every_strategy_of_every_server():
    table = sr.per_server({"batcher": sr.levels(SWEEP), "llama-server": sr.levels(SWEEP)[:1]}).splitlines()
    assert len(table) == 2 + 4 and table[3] == "| batcher | throughput | – | – | – | – | 55.5 | 0 / 0 / 16 |"
    assert table[5].startswith("| llama-server | synchronous | 100 | 180 |")


def test_the_guidellm_command_line():
    s = Settings(Path("/models/smol"), "float32", 1, 8, 512, (1, 2, 4, 8), 4, 40.0, 256, 64)
    concurrent = guidellm_command("http://127.0.0.1:8000", "concurrent", s, Path("/tmp/c.json"))
    assert concurrent[1:4] == ["-m", "guidellm", "run"]
    assert concurrent[concurrent.index("--backend") + 1] == (
        f"kind=openai_http,target=http://127.0.0.1:8000,model={SERVED},request_format=/v1/completions,"
        "extras.body.temperature=0")
    assert concurrent[concurrent.index("--profile"):concurrent.index("--profile") + 5] == [
        "--profile", "kind=concurrent,streams=1", "--override", "profile.streams", "1,2,4,8"]
    assert "kind=max_duration,seconds=40" in concurrent and "kind=huggingface_auto,model=/models/smol" in concurrent
    assert "kind=synthetic_text,prompt_tokens=256,output_tokens=64" in concurrent
    assert concurrent[concurrent.index("--output") + 1] == "kind=json,path=/tmp/c.json"
    sweep = guidellm_command("http://127.0.0.1:8000", "sweep", s, Path("/tmp/s.json"))
    assert sweep[sweep.index("--profile") + 1] == "kind=sweep,sweep_size=4,max_concurrency=16"
    # each profile its own prompts: the sweep must not find the concurrent run's in a prefix cache
    assert concurrent[concurrent.index("--seed") + 1] != sweep[sweep.index("--seed") + 1]


def test_the_report_names_the_gguf_llama_server_ran():
    assert gguf_name({"dtype": "bfloat16"}) == "bf16"
    assert gguf_name({"dtype": "float32", "quantization": "int8", "llama_gguf": ""}) == "q8_0"
    assert gguf_name({"dtype": "float32", "quantization": "int8", "llama_gguf": "q4_k_m"}) == "q4_k_m"
