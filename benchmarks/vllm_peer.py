"""vLLM's offline throughput on `batcher bench` workloads, for `make gpu-check` (benchmarks.gpu_check).

Run by the Python of a virtual environment of its own, where `pip install vllm` brought vLLM's own torch:
it imports nothing from batcher. Its input is a JSON file written by the check, {"model", "dtype",
"max_num_seqs", "max_num_batched_tokens", "block_size", "workloads": {name: [{"id", "prompt_token_ids",
"max_tokens"}]}}; it prints {name: {"wall_s", "generated_tokens", "tokens": {id: [...]}}} as JSON on its
last line. Every workload this check runs arrives at once, so one `LLM.generate` call per workload is the
same work `batcher bench` times. vLLM runs as it ships (CUDA graphs, prefix caching), greedy, EOS ignored,
after one warm-up call.

    python vllm_peer.py requests.json
"""

from __future__ import annotations

import json
import sys
import time

GPU_MEMORY_UTILIZATION = 0.5  # the workloads are small; leave room for the other systems' leftovers


def main(path: str) -> None:
    from vllm import LLM, SamplingParams

    with open(path) as f:
        spec = json.load(f)
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_num_seqs=spec["max_num_seqs"],
              max_num_batched_tokens=spec["max_num_batched_tokens"], block_size=spec["block_size"],
              enable_prefix_caching=True, gpu_memory_utilization=GPU_MEMORY_UTILIZATION, seed=0)
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    results = {}
    for name, requests in spec["workloads"].items():
        prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
        params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True) for r in requests]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        tokens = {r["id"]: list(o.outputs[0].token_ids) for r, o in zip(requests, outputs)}
        results[name] = {"wall_s": wall, "generated_tokens": sum(len(t) for t in tokens.values()), "tokens": tokens}
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
