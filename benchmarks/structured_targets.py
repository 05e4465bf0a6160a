"""Structured outputs on a real model: the issue's targets, measured in one process.

    python -m benchmarks.structured_targets [--model smollm2] [--threads 1] [--skip-overhead]

- answers: every schema of the suite (schemas/suite.jsonl) as a chat request, greedy and then sampled;
  the share of `stop` answers that parse and validate, and of bounded-schema answers that end with `stop`;
  schemas the grammar library refuses count as not covered (they are 400s, never wrong answers);
- compile: the time `Engine.add` spends on each schema's grammar, uncached (p50, p99);
- mask: the time the grammar hooks keep a step waiting (the masks are computed while the forward runs; the
  wait for them, applying them and advancing the grammars), in decode steps where 32 constrained sequences
  decode, against the step's whole time;
- overhead: the bundled skew-small workload (no constraint, no logprobs) with the grammar and logprob hooks
  as shipped and with them removed, alternated, each on a fresh engine; the median ratio of throughputs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import jsonschema
import torch

from benchmarks.grammar_libraries import load_suite, percentile
from rqbatcher.config import EngineConfig
from rqbatcher.schema import GenerationRequest
from rqbatcher.workers.bench.run import run_batcher
from rqbatcher.workers.bench.workload import load_workload
from rqbatcher.workers.engine.engine import Engine, build_engine

INSTRUCTION = " Answer in JSON."
MAX_TOKENS = 256
SAMPLED = {"temperature": 0.8, "top_p": 0.95}
MASK_BATCH = 32
OVERHEAD_WORKLOAD = "skew-small"
OVERHEAD_PAIRS = 4
HOOKS = {"grammars": ("admit", "begin", "mask", "advance", "forget"), "logprobs": ("capture", "record", "pop")}


class Timed:
    """Wraps an engine's grammar hook and adds up the seconds it took in the current step."""

    def __init__(self, hook) -> None:
        self.hook, self.seconds = hook, 0.0

    def __call__(self, *args):
        started = time.perf_counter()
        try:
            return self.hook(*args)
        finally:
            self.seconds += time.perf_counter() - started


def suite_request(item: dict, sampling: dict) -> GenerationRequest:
    return GenerationRequest(messages=[{"role": "user", "content": item["prompt"] + INSTRUCTION}],
                             sampling={"max_tokens": MAX_TOKENS, **sampling},
                             response_format={"type": "json_schema",
                                              "json_schema": {"name": "answer", "schema": item["schema"]}})


def run_suite(engine: Engine, suite: list[dict], sampling: dict, compile_ms: list[float] | None) -> dict:
    """Every covered schema's answer, and the grammar time of the steps where MASK_BATCH sequences decode."""
    begin, mask, advance = Timed(engine.grammars.begin), Timed(engine.grammars.mask), Timed(engine.grammars.advance)
    engine.grammars.begin, engine.grammars.mask, engine.grammars.advance = begin, mask, advance
    finals, refused = {}, []
    for i, item in enumerate(suite):
        try:
            request = suite_request(item, {**sampling, "seed": i} if sampling else sampling)
        except ValueError:
            refused.append(item["name"])
            continue
        started = time.perf_counter()
        engine.add(item["name"], request)
        if compile_ms is not None:
            compile_ms.append((time.perf_counter() - started) * 1e3)
    grammar_s, step_s = [], []
    while engine.has_work():
        begin.seconds = mask.seconds = advance.seconds = 0.0
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        stats = engine.last_step
        if stats.num_seqs == MASK_BATCH and stats.num_prefill_tokens == 0:
            grammar_s.append(begin.seconds + mask.seconds + advance.seconds)
            step_s.append(stats.duration_s)
    del engine.grammars.begin, engine.grammars.mask, engine.grammars.advance
    schemas = {item["name"]: item for item in suite}
    stops = [k for k, out in finals.items() if out.finish_reason == "stop"]
    invalid = {}
    for name in stops:
        try:
            jsonschema.validate(json.loads(finals[name].text), schemas[name]["schema"])
        except (ValueError, jsonschema.ValidationError) as exc:
            invalid[name] = f"{finals[name].text[:80]!r}: {str(exc)[:80]}"
    bounded = [k for k in finals if schemas[k]["bounded"]]
    return {
        "covered": len(finals), "refused": refused, "errors": {k: o.error for k, o in finals.items() if o.error},
        "stop": len(stops), "stop_valid": len(stops) - len(invalid), "invalid": invalid,
        "bounded": len(bounded), "bounded_stop": sum(finals[k].finish_reason == "stop" for k in bounded),
        "bounded_not_stopped": {k: finals[k].text[-60:] for k in bounded if finals[k].finish_reason != "stop"},
        f"decode_steps_at_{MASK_BATCH}": len(step_s),
        "grammar_ms_p50": round(statistics.median(grammar_s) * 1e3, 3) if grammar_s else None,
        "step_ms_p50": round(statistics.median(step_s) * 1e3, 2) if step_s else None,
        "grammar_share_of_step": round(sum(grammar_s) / sum(step_s), 4) if step_s else None,
    }


class NoHooks:
    """The engine as it was before constrained decoding and logprobs: hooks that do nothing at all."""

    def admit(self, *args) -> None: ...
    def begin(self, *args) -> None: ...
    def forget(self, *args) -> None: ...
    def mask(self, *args) -> None: ...
    def advance(self, *args) -> bool:
        return False

    def capture(self, *args) -> None: ...
    def record(self, *args) -> None: ...
    def pop(self, *args) -> None: ...


def overhead(config: EngineConfig) -> dict:
    """skew-small throughput with the hooks over that without them, on fresh engines in the order ABBA ABBA...
    (drift cancels); the median of the pairs' ratios. On a shared CPU that ratio swings by tens of percent
    either way, so the time spent inside the hooks is also summed: the throughput they can cost at most."""
    workload = load_workload(OVERHEAD_WORKLOAD)
    rates: dict[str, list[float]] = {"with_hooks": [], "without_hooks": []}
    hook_shares: list[float] = []
    for pair in range(OVERHEAD_PAIRS):
        for name in (("with_hooks", "without_hooks") if pair % 2 == 0 else ("without_hooks", "with_hooks")):
            engine = build_engine(config)
            timers = []
            if name == "without_hooks":
                engine.grammars = engine.logprobs = NoHooks()
            else:
                for part, hooks in ((engine.grammars, HOOKS["grammars"]), (engine.logprobs, HOOKS["logprobs"])):
                    for hook in hooks:
                        timers.append(Timed(getattr(part, hook)))
                        setattr(part, hook, timers[-1])
            run = run_batcher(engine, workload, name)
            rates[name].append(sum(len(t) for t in run.tokens.values()) / run.wall_s)
            if timers:
                hook_shares.append(sum(t.seconds for t in timers) / run.wall_s)
    ratios = [a / b for a, b in zip(rates["with_hooks"], rates["without_hooks"])]
    return {"tokens_per_s": {k: [round(r, 1) for r in v] for k, v in rates.items()},
            "pair_ratios": [round(r, 4) for r in ratios], "median_ratio": round(statistics.median(ratios), 4),
            "hook_share_of_wall": [round(x, 6) for x in hook_shares],
            "ratio_implied_by_hook_time": round(1 - max(hook_shares), 5)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--only-overhead", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = EngineConfig(model=args.model, max_num_seqs=MASK_BATCH)
    if args.only_overhead:
        print(json.dumps({"overhead": overhead(replace(config, max_num_seqs=EngineConfig().max_num_seqs))}))
        return
    engine = build_engine(config)
    engine.warm_up()
    engine.add("warm-grammar", GenerationRequest(prompt="x", regex="[a-z]", sampling={"max_tokens": 2}))
    while engine.has_work():  # builds the grammar library's view of the tokenizer (once per engine)
        engine.step()
    suite = load_suite()
    compile_ms: list[float] = []
    report = {"model": args.model, "dtype": engine.dtype, "threads": args.threads, "schemas": len(suite)}
    report["greedy"] = run_suite(engine, suite, {}, compile_ms)
    report["compile_ms"] = {"p50": round(percentile(compile_ms, 0.5), 2), "p99": round(percentile(compile_ms, 0.99), 2),
                            "max": round(max(compile_ms), 2)}
    report["sampled"] = run_suite(engine, suite, SAMPLED, None)
    print(json.dumps(report, indent=1), flush=True)
    if not args.skip_overhead:
        print(json.dumps({"overhead": overhead(replace(config, max_num_seqs=EngineConfig().max_num_seqs))}),
              flush=True)


if __name__ == "__main__":
    main()
