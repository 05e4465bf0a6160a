"""benchmarks/alternated.py: formats and thread counts taking turns in one process, and the ratios it prints."""

import json

from click.testing import CliRunner

from benchmarks import alternated
from rqbatcher.config import EngineConfig


def test_rounds_run_every_pair_and_reverse_their_order(monkeypatch):
    calls = []
    monkeypatch.setattr(alternated, "total_tok_s",
                        lambda config, threads, workload: calls.append((config.quantization, threads)) or 1.0)
    configs = {"auto:int8": EngineConfig(quantization="int8"), "auto": EngineConfig()}
    results = alternated.alternate([], configs, [1, 2], rounds=2)
    first = [("int8", 1), ("int8", 2), ("none", 1), ("none", 2)]
    assert calls == first + first[::-1]
    assert [set(result) for result in results] == [{(spec, n) for spec in configs for n in (1, 2)}] * 2


def test_the_table_gives_each_ratio_within_its_round():
    results = [{("int8", 1): 150.0, ("bf16", 1): 100.0, ("int8", 2): 270.0, ("bf16", 2): 190.0}]
    lines = alternated.table(results, ["int8", "bf16"], [1, 2]).splitlines()
    assert lines[0] == "| round | threads | int8 | bf16 | bf16 / int8 | int8: against 1 thread(s) | bf16: against 1 " \
                       "thread(s) |"
    assert lines[2] == "| 1 | 1 | 150.0 | 100.0 | 0.67x | 1.00x | 1.00x |"
    assert lines[3] == "| 1 | 2 | 270.0 | 190.0 | 0.70x | 1.80x | 1.90x |"


def test_a_tiny_model_runs_in_every_format(tiny_model_dir, tmp_path):
    workload = tmp_path / "tiny.jsonl"
    workload.write_text("\n".join(json.dumps({"id": f"r{i}", "prompt_len": 12 + 5 * i, "max_tokens": 4,
                                              "arrival_s": 0.0}) for i in range(4)))
    result = CliRunner().invoke(alternated.main, ["--workload", str(workload), "--model", str(tiny_model_dir("llama")),
                                                  "--formats", "float32,float32:int8", "--threads", "1",
                                                  "--rounds", "1"])
    assert result.exit_code == 0, result.output
    assert "(float32 = float32 weights none, float32:int8 = float32 weights int8)" in result.output
    header, rule, row = [line for line in result.output.splitlines() if line.startswith("|")]
    assert header == "| round | threads | float32 | float32:int8 | float32:int8 / float32 |"
    cells = row.strip("| ").split(" | ")
    assert cells[:2] == ["1", "1"] and float(cells[2].replace(",", "")) > 0 and cells[4].endswith("x")


def test_bad_arguments_are_named():
    runner = CliRunner()
    for args, named in [(["--formats", "float32:int4"], "float32:int4"), (["--threads", "1,0"], "at least 1"),
                        (["--threads", "two"], "two"), ([], "no-such-workload")]:
        result = runner.invoke(alternated.main, ["--workload", "no-such-workload", *args])
        assert result.exit_code == 2 and named in result.output, result.output
