"""`make gpu-check`: the GPU path checked in one command, on a fresh clone with one GPU, in about 8 minutes.

1. vLLM installs into a virtual environment of its own (it pins its own torch), in the background, where
   `pip install vllm` works.
2. The Triton kernel tests run on CUDA (TRITON_INTERPRET=0), the slow ones included: every shape against the
   torch path, and greedy fp32 tokens equal to `generate` on the tiny families, a tiny Qwen3 and SmolLM2.
3. `python -m benchmarks.compare` runs skew-small and summarise: batcher (triton attention) against hf-cb, in the
   dtype `auto` picks, one run per workload.
4. vLLM runs the same workloads where it installed (benchmarks/vllm_peer.py), as it ships.
5. One table: each system's generated tokens/s on each workload, and ratios to hf-cb and to vLLM.

It exits non-zero when a kernel test or a bench run fails. The reports and logs go to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

WORKLOADS = ("skew-small", "summarise")
SYSTEMS = ("batcher:continuous", "hf-cb")
BATCHER = SYSTEMS[0]
VLLM = "vllm"
BUDGET_S = 8 * 60  # the whole check, set-up included (the Makefile installs before this starts)
TESTS_TIMEOUT_S = 240  # mostly compiling the kernels for each shape tested
BENCH_TIMEOUT_S = 120  # per workload
VLLM_RUN_TIMEOUT_S = 150  # start-up (graph capture) and both workloads
VLLM_VENV = ".venv-vllm"
DEFAULT_OUT = "gpu-check"


def start_vllm_install(out: Path) -> subprocess.Popen:
    """`pip install vllm` into a venv of its own, in the background; its log goes to `out`."""
    script = f"{sys.executable} -m venv {VLLM_VENV} && {VLLM_VENV}/bin/pip install --quiet vllm"
    return subprocess.Popen(["bash", "-c", script], stdout=open(out / "vllm-install.log", "w"),
                            stderr=subprocess.STDOUT)


def run_step(title: str, command: list[str], timeout: float, env: dict | None = None) -> bool:
    print(f"\n=== {title}\n$ {' '.join(command)}", flush=True)
    try:
        return subprocess.run(command, timeout=max(1.0, timeout), env=env, check=False).returncode == 0
    except subprocess.TimeoutExpired:
        print(f"--- {title}: timed out after {timeout:.0f} s", flush=True)
        return False


def vllm_requests(out: Path, model: str, dtype: str) -> Path:
    """The workloads' requests as vllm_peer.py reads them, with the bench's prompts and settings."""
    from transformers import AutoConfig

    from rqbatcher.config import EngineConfig
    from rqbatcher.workers.bench.workload import load_workload
    from rqbatcher.workers.model.loading import resolve

    path = resolve(model)
    vocab = AutoConfig.from_pretrained(path).get_text_config().vocab_size
    config = EngineConfig(model=model)
    spec = {"model": path, "dtype": dtype, "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens, "block_size": config.block_size,
            "workloads": {w: [{"id": r.id, "prompt_token_ids": r.prompt_token_ids(vocab), "max_tokens": r.max_tokens}
                              for r in load_workload(w)] for w in WORKLOADS}}
    target = out / "vllm-requests.json"
    target.write_text(json.dumps(spec))
    return target


def run_vllm(out: Path, install: subprocess.Popen, deadline: float, model: str, dtype: str) -> dict | None:
    """vLLM's results per workload, or None (said why) where it did not install or run in time."""
    try:
        if install.wait(timeout=max(1.0, deadline - time.monotonic() - VLLM_RUN_TIMEOUT_S)) != 0:
            print(f"\nvLLM did not install (see {out / 'vllm-install.log'}): no vLLM column", flush=True)
            return None
    except subprocess.TimeoutExpired:
        install.kill()
        print("\nvLLM was still installing when its time ran out: no vLLM column", flush=True)
        return None
    command = [f"{VLLM_VENV}/bin/python", str(Path(__file__).with_name("vllm_peer.py")),
               str(vllm_requests(out, model, dtype))]
    print(f"\n=== vLLM on {', '.join(WORKLOADS)}\n$ {' '.join(command)}", flush=True)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=VLLM_RUN_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        print("vLLM timed out: no vLLM column", flush=True)
        return None
    (out / "vllm.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0 or not done.stdout.strip():
        print(f"vLLM failed (see {out / 'vllm.log'}): no vLLM column", flush=True)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(out: Path, vllm: dict | None) -> str:
    """One table over the bench reports (and vLLM's results): generated tokens/s and ratios."""
    lines = [(f"{'workload':<12}{'system':<22}{'wall s':>8}{'gen tok/s':>11}{'x hf-cb':>9}{'x vLLM':>8}"
              "  greedy vs batcher")]
    for workload in WORKLOADS:
        path = out / f"{workload}.json"
        if not path.exists():
            lines.append(f"{workload:<12}(no bench report)")
            continue
        report = json.loads(path.read_text())["report"]
        rows = {s["system"]: (s["wall_s"], s["generated_tok_s"], "baseline" if s["system"] == report["baseline"]
                              else f"{len(s['mismatched_requests'])} requests differ") for s in report["systems"]}
        if vllm and workload in vllm:
            result = vllm[workload]
            rows[VLLM] = (result["wall_s"], result["generated_tokens"] / result["wall_s"], "- (not compared)")
        for system, (wall, tok_s, agree) in rows.items():
            to_hf, to_vllm = (f"{tok_s / rows[other][1]:.2f}x" if other in rows else "-" for other in ("hf-cb", VLLM))
            lines.append(f"{workload:<12}{system:<22}{wall:>8.2f}{tok_s:>11.1f}{to_hf:>9}{to_vllm:>8}  {agree}")
        lines.append(f"{'':<12}{report['model']} in {report['dtype']} on {report['device']}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help="Where reports and logs go.")
    parser.add_argument("--model", default="smollm2", help="The model of the bench runs.")
    parser.add_argument("--no-vllm", action="store_true", help="Skip installing and running vLLM.")
    args = parser.parse_args()
    deadline = time.monotonic() + BUDGET_S
    import torch

    if not torch.cuda.is_available():
        print("make gpu-check needs a CUDA GPU and a CUDA build of torch; none is here", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
    install = None if args.no_vllm else start_vllm_install(out)
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    tests_ok = run_step("Triton kernel tests on CUDA, greedy equality with generate included",
                        [sys.executable, "-m", "pytest", "tests/test_triton_kernels.py", "-m", "triton", "-q",
                         "-p", "no:cacheprovider"], TESTS_TIMEOUT_S, env)
    bench_ok = True
    for workload in WORKLOADS:
        bench_ok &= run_step(f"batcher bench {workload}", [
            sys.executable, "-m", "benchmarks.compare", "--workload", workload, "--model", args.model,
            "--systems", ",".join(SYSTEMS), "--device", "cuda", "--attention-backend", "triton",
            "--json", str(out / f"{workload}.json")], min(BENCH_TIMEOUT_S, deadline - time.monotonic()), env)
    dtype = "bfloat16"
    if (out / f"{WORKLOADS[0]}.json").exists():
        dtype = json.loads((out / f"{WORKLOADS[0]}.json").read_text())["report"]["dtype"]
    vllm = run_vllm(out, install, deadline, args.model, dtype) if install else None
    print("\n=== summary\n" + summary(out, vllm), flush=True)
    print(f"\nkernel tests: {'passed' if tests_ok else 'FAILED'}; bench: {'ran' if bench_ok else 'FAILED'}")
    return 0 if tests_ok and bench_ok else 1


if __name__ == "__main__":
    sys.exit(main())
