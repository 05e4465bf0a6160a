"""llama.cpp's server as a peer of `python -m benchmarks.compare`: named like the others, skipped with a reason
where it cannot be built. Building it takes CPU minutes, so the run itself is `-m slow` (and needs cmake)."""

import shutil
import sys

import pytest

from benchmarks import llama_server
from benchmarks.compare import QUICK_PEERS, Peer, compare, parse_system
from rqbatcher.config import EngineConfig
from rqbatcher.workers.bench.workload import WorkloadRequest

WORKLOAD = [WorkloadRequest(i, f"r{i}", prompt_len, max_tokens, 0.0)
            for i, (prompt_len, max_tokens) in enumerate([(9, 3), (21, 5), (5, 4)])]


def test_it_is_named_like_the_other_peers_and_kept_out_of_the_default_test_run():
    assert parse_system("llama-server") == Peer("llama-server")
    assert parse_system("llama-server:no-prefix-caching").name == "llama-server:no-prefix-caching"
    with pytest.raises(ValueError, match="unknown llama-server@redis"):
        parse_system("llama-server@redis")
    assert "llama-server" not in QUICK_PEERS
    assert parse_system("llama-server:q4_k_m:no-prefix-caching") == Peer("llama-server", False, "q4_k_m")
    assert parse_system("llama-server:q4_k_m").name == "llama-server:q4_k_m"
    for bad in ("llama-server:q3_k", "hf-cb:q8_0"):
        with pytest.raises(ValueError, match=f"unknown {bad}.*a GGUF type: f32, bf16, f16, q8_0, q4_k_m"):
            parse_system(bad)


def test_a_machine_without_cmake_skips_it_with_the_reason(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHER_CACHE_DIR", str(tmp_path))  # nothing built here
    monkeypatch.setattr(shutil, "which", lambda name: None)
    config = EngineConfig(model=str(tiny_model_dir("llama")), max_num_seqs=2, max_num_batched_tokens=16,
                          block_size=4, kv_cache_bytes=1 << 20, dtype="float32")
    comparison = compare(WORKLOAD, "tiny", [parse_system("batcher:continuous"), parse_system("llama-server")],
                         parse_system("batcher:continuous"), config, threads=1)
    assert [s.system for s in comparison.report.systems] == ["batcher:continuous"]
    assert "cmake is missing" in comparison.skipped["llama-server"]
    assert "skipped llama-server: llama-server: cmake is missing" in comparison.table()
    with pytest.raises(llama_server.SystemUnavailable, match="cmake"):
        compare(WORKLOAD, "tiny", [parse_system("llama-server")], parse_system("llama-server"), config, threads=1)


def test_requests_ask_for_greedy_tokens_past_eos():
    body = llama_server._request([5, 6, 7], 12, prefix_caching=False)
    assert body["prompt"] == [5, 6, 7] and body["n_predict"] == 12
    assert body["ignore_eos"] and body["top_k"] == 1 and body["temperature"] == 0.0
    assert body["return_tokens"] and body["stream"] and body["cache_prompt"] is False


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake to build llama.cpp")
def test_llama_server_generates_every_token_of_every_request(request):
    """On the bundled SmolLM2 (llama.cpp's converter knows its tokenizer, not the tiny test models')."""
    if request.config.getoption("markexpr") != "slow":
        pytest.skip("builds llama.cpp on first use (CPU minutes): run with -m slow")
    config = EngineConfig(model="smollm2", max_num_seqs=2, max_num_batched_tokens=16, block_size=4,
                          kv_cache_bytes=1 << 24, dtype="float32")
    comparison = compare(WORKLOAD, "tiny", [parse_system("hf-naive"), parse_system("llama-server")],
                         parse_system("hf-naive"), config, threads=1)
    server = comparison.report.system("llama-server")
    assert server.generated_tokens == sum(w.max_tokens for w in WORKLOAD)


def test_int8_runs_against_a_q8_0_gguf_of_the_same_checkpoint(tmp_path, monkeypatch):
    """llama.cpp's converter is asked for Q8_0 where batcher runs int8 weights, else for the run's dtype; each
    conversion is kept under its own name."""
    source = tmp_path / "llama.cpp"
    source.mkdir()
    (source / "convert_hf_to_gguf.py").write_text(
        "import sys\nargs = sys.argv[1:]\n"
        "open(args[args.index('--outfile') + 1], 'w').write(args[args.index('--outtype') + 1])\n")
    monkeypatch.setattr(llama_server, "_fetch_source", lambda: source)
    monkeypatch.setattr(llama_server, "_root", lambda: tmp_path)
    model_dir = tmp_path / "smol"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    int8 = llama_server.gguf_checkpoint(model_dir, llama_server.gguf_type("float32", "int8"))
    full = llama_server.gguf_checkpoint(model_dir, llama_server.gguf_type("bfloat16", "none"))
    assert (int8.name, int8.read_text()) == ("smol-q8_0.gguf", "q8_0")
    assert (full.name, full.read_text()) == ("smol-bf16.gguf", "bf16")


def test_a_q4_k_m_peer_is_quantized_by_llama_quantize_from_the_f32_conversion(tmp_path, monkeypatch):
    """llama.cpp's converter makes the f32 GGUF once; its llama-quantize (built on demand) makes Q4_K_M from it."""
    source = tmp_path / "llama.cpp"
    source.mkdir()
    (source / "convert_hf_to_gguf.py").write_text(
        "import sys\nargs = sys.argv[1:]\n"
        "open(args[args.index('--outfile') + 1], 'w').write(args[args.index('--outtype') + 1])\n")
    quantize = tmp_path / "llama-quantize"  # stands in for the built tool: writes "<input's text> -> <type>"
    quantize.write_text(f"#!{sys.executable}\nimport sys\n_, src, dst, kind = sys.argv\n"
                        "open(dst, 'w').write(open(src).read() + ' -> ' + kind)\n")
    quantize.chmod(0o755)
    built = []
    monkeypatch.setattr(llama_server, "_fetch_source", lambda: source)
    monkeypatch.setattr(llama_server, "_root", lambda: tmp_path)
    monkeypatch.setattr(llama_server, "_tool", lambda target, jobs: built.append((target, jobs)) or quantize)
    model_dir = tmp_path / "smol"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    q4 = llama_server.gguf_checkpoint(model_dir, "q4_k_m", jobs=2)
    assert (q4.name, q4.read_text()) == ("smol-q4_k_m.gguf", "f32 -> Q4_K_M")
    assert (tmp_path / "smol-f32.gguf").read_text() == "f32" and built == [("llama-quantize", 2)]
    assert llama_server.gguf_checkpoint(model_dir, "q4_k_m") == q4 and len(built) == 1  # made once


FAKE_SERVER = """
import functools, http.server, os, signal, sys
if sys.argv[3] == "crash" and "--no-repack" not in sys.argv:
    os.kill(os.getpid(), signal.SIGSEGV)
if sys.argv[3] == "exit":
    sys.exit(3)
handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=sys.argv[2])
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), handler).serve_forever()
"""


@pytest.mark.parametrize("behaviour", ["serve", "crash", "exit"])
def test_a_server_killed_at_start_up_runs_again_without_repacking_and_says_so(tmp_path, behaviour):
    """llama.cpp's AMX matmul crashed llama-server at start-up on an Intel Xeon with AMX (a signal): it runs once
    more with --no-repack, and the run's notes say so. A server that exits with an error is not started again."""
    from benchmarks.private_redis import free_port

    (tmp_path / "health").write_text("ok")
    script, port = tmp_path / "server.py", free_port()
    script.write_text(FAKE_SERVER)
    command = [sys.executable, str(script), str(port), str(tmp_path), behaviour]
    if behaviour == "exit":
        with pytest.raises(RuntimeError, match="exited with 3 at start-up"):
            llama_server.start_server(command, port, tmp_path / "log")
        return
    server, note = llama_server.start_server(command, port, tmp_path / "log")
    try:
        assert (server.args[-1] == "--no-repack") == (behaviour == "crash")
        assert note == ("" if behaviour == "serve" else
                        "llama-server was killed by signal 11 at start-up with its weight repacking, so it runs "
                        "with --no-repack")
    finally:
        server.terminate()
        server.wait(timeout=10)
