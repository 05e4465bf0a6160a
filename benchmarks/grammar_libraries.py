"""llguidance against xgrammar on the schema suite (schemas/suite.jsonl), with a real tokenizer.

    python -m benchmarks.grammar_libraries [--model smollm2] [--threads 1]

For each library: compile time per schema (p50, p99; no cache), coverage (schemas that compile, and
random walks through the mask that end in text which parses and validates), and the time to fill the
masks of 32 constrained sequences in one step (each at its own point of its own schema). This is how
batcher chose its grammar library (workers/engine/structured.py); xgrammar is only needed to run it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import numpy as np

SUITE = Path(__file__).parent / "schemas" / "suite.jsonl"
BATCH = 32  # constrained sequences in one step
WALK_STEPS = 48  # steps timed per walk
WALKS_PER_SCHEMA = 3


def load_suite(path: Path = SUITE) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def allowed(mask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    bits = np.unpackbits(mask_row.view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, threads: int) -> None:
        import llguidance
        import llguidance.hf

        self.lib = llguidance
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, schema: dict):
        grammar = self.lib.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        matcher = self.lib.LLMatcher(self.tok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def matcher(self, compiled):
        return self.lib.LLMatcher(self.tok, compiled, log_level=0)

    def fill(self, matchers: list, mask: np.ndarray) -> None:
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], mask.ctypes.data,
                                              mask.shape[1] * 4, mask.shape[0])

    def advance(self, matcher, token: int) -> bool:
        return matcher.consume_token(token) and not matcher.is_error()

    def done(self, matcher) -> bool:
        return matcher.is_stopped()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, threads: int) -> None:
        import xgrammar

        self.lib = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=threads)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)

    def matcher(self, compiled):
        return self.lib.GrammarMatcher(compiled)

    def fill(self, matchers: list, mask: np.ndarray) -> None:
        import torch

        live = [i for i, m in enumerate(matchers) if not m.is_terminated()]
        self.batch.batch_fill_next_token_bitmask([matchers[i] for i in live], torch.from_numpy(mask), live)

    def advance(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_terminated()


def measure(lib, suite: list[dict], tokenizer, vocab_size: int, eos: int) -> dict:
    import jsonschema

    compile_ms, compiled, failures = [], {}, {}
    for item in suite:
        started = time.perf_counter()
        try:
            compiled[item["name"]] = lib.compile(item["schema"])
        except Exception as exc:  # noqa: BLE001  (an unsupported schema is what coverage counts)
            failures[item["name"]] = f"{type(exc).__name__}: {str(exc)[:120]}"
            continue
        compile_ms.append((time.perf_counter() - started) * 1e3)
    names = list(compiled)
    rng = random.Random(0)
    mask_ms, valid, invalid, unfinished = [], 0, {}, 0
    for walk in range(WALKS_PER_SCHEMA * len(names) // BATCH + 1):
        group = [names[(walk * BATCH + i) % len(names)] for i in range(BATCH)]
        matchers = [lib.matcher(compiled[n]) for n in group]
        tokens: list[list[int]] = [[] for _ in group]
        mask = np.zeros((BATCH, (vocab_size + 31) // 32), dtype=np.int32)
        for _ in range(WALK_STEPS):
            started = time.perf_counter()
            lib.fill(matchers, mask)
            mask_ms.append((time.perf_counter() - started) * 1e3)
            for i, m in enumerate(matchers):
                if lib.done(m):
                    continue
                ids = allowed(mask[i], vocab_size)
                token = eos if eos in ids and rng.random() < 0.3 else int(rng.choice(ids))
                lib.advance(m, token)
                if token != eos:
                    tokens[i].append(token)
        for name, m, toks in zip(group, matchers, tokens):
            if not lib.done(m):
                unfinished += 1
                continue
            text = tokenizer.decode(toks)
            try:
                jsonschema.validate(json.loads(text), next(s["schema"] for s in suite if s["name"] == name))
                valid += 1
            except Exception as exc:  # noqa: BLE001
                invalid[name] = f"{text[:80]!r}: {type(exc).__name__}: {str(exc)[:80]}"
    return {
        "library": lib.name,
        "schemas": len(suite),
        "compiled": len(compiled),
        "compile_p50_ms": round(percentile(compile_ms, 0.5), 2),
        "compile_p99_ms": round(percentile(compile_ms, 0.99), 2),
        "compile_max_ms": round(max(compile_ms), 2),
        f"mask_{BATCH}_p50_ms": round(statistics.median(mask_ms), 3),
        f"mask_{BATCH}_p99_ms": round(percentile(mask_ms, 0.99), 3),
        "walks_ended": valid + len(invalid),
        "walks_valid": valid,
        "walks_unfinished": unfinished,
        "not_compiled": failures,
        "invalid_walks": invalid,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--library", choices=["llguidance", "xgrammar"], action="append")
    args = parser.parse_args()
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from rqbatcher.workers.model.loading import resolve

    torch.set_num_threads(args.threads)
    source = resolve(args.model)
    tokenizer = AutoTokenizer.from_pretrained(source)
    vocab_size = AutoConfig.from_pretrained(source).get_text_config().vocab_size
    suite = load_suite()
    for cls in (Llguidance, Xgrammar):
        if args.library and cls.name not in args.library:
            continue
        try:
            lib = cls(tokenizer, vocab_size, args.threads)
        except ImportError as exc:
            print(f"{cls.name}: not installed ({exc})", flush=True)
            continue
        print(json.dumps(measure(lib, suite, tokenizer, vocab_size, tokenizer.eos_token_id), indent=1), flush=True)


if __name__ == "__main__":
    main()
