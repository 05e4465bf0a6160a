"""Prefix caching on the tiny models, in fp32 with greedy decoding: with the cache, every request's tokens
equal those without it and those of `generate` on that request alone, and the cache was really used."""

from __future__ import annotations

import random

import pytest

import rqbatcher.kernels.attention
import rqbatcher.kernels.segmented
from tests.engine_helpers import engine_for, greedy, reference_tokens

VOCAB = 384


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def questions(prefix: list[int], count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [prefix + ids(rng.randint(1, 9), seed * 100 + i) for i in range(count)]


DOC, OTHER = ids(24, 1), ids(64, 2)

# name: (engine knobs, waves of prompts: (engine steps run before the wave arrives, prompts))
SCENARIOS = {
    "prefix-of-whole-blocks": (dict(block_size=8, max_num_batched_tokens=64),
                               [(0, questions(DOC, 4, 3)), (3, questions(DOC, 3, 4))]),
    "prompt-entirely-cached": (dict(block_size=8, max_num_batched_tokens=64),
                               [(0, [DOC, DOC]), (2, [DOC, DOC[:16]])]),
    "one-token-past-a-block-edge": (dict(block_size=8, max_num_batched_tokens=64),
                                    [(0, [DOC + ids(5, 5)]), (2, [DOC + [9], DOC[:8] + [9]])]),
    "block-size-1": (dict(block_size=1, max_num_batched_tokens=32),
                     [(0, questions(DOC[:13], 3, 6)), (2, [DOC[:13], DOC[:13] + [5]])]),
    "block-size-7-chunked": (dict(block_size=7, max_num_batched_tokens=11),
                             [(0, questions(DOC[:20], 3, 7)), (6, questions(DOC[:20], 2, 8))]),
    "preemption-while-shared": (dict(block_size=4, num_blocks=14, max_num_batched_tokens=64),
                                [(0, questions(DOC, 6, 9))]),
    "eviction-under-a-small-cache": (dict(block_size=4, num_blocks=28, max_num_seqs=2, max_num_batched_tokens=64),
                                     [(0, questions(DOC, 2, 10)), (10, questions(OTHER, 2, 11)),
                                      (30, questions(DOC, 2, 12))]),
    "many-sharing-one-prefix": (dict(block_size=4, max_num_seqs=16, max_num_batched_tokens=32),
                                [(0, questions(DOC, 8, 13)), (4, questions(DOC, 4, 14)), (12, questions(DOC, 4, 15))]),
}


def run_waves(engine, waves):
    """Add each wave once the engine has run its steps; return {request id: (prompt, max tokens, final output)}
    and the number of preemptions."""
    requests, finals, preemptions, pending = {}, {}, 0, list(waves)
    steps = 0
    while pending or engine.has_work():
        while pending and pending[0][0] <= steps:
            for prompt in pending.pop(0)[1]:
                rid = f"r{len(requests)}"
                requests[rid] = (prompt, 4 + len(requests) % 5)
                engine.add(rid, greedy(prompt, requests[rid][1]))
        if not engine.has_work():
            steps = pending[0][0]
            continue
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
        preemptions += engine.last_step.num_preempted
        steps += 1
    return {rid: (*requests[rid], finals[rid]) for rid in requests}, preemptions


def check_scenario(model_dir, name):
    knobs, waves = SCENARIOS[name]
    cached, preemptions = run_waves(engine_for(model_dir, **knobs), waves)
    uncached, _ = run_waves(engine_for(model_dir, prefix_caching=False, **knobs), waves)
    for rid, (prompt, max_tokens, out) in cached.items():
        expected = reference_tokens(model_dir, prompt, max_tokens)
        assert uncached[rid][2].token_ids == expected, f"{name}: {rid} without the cache"
        assert out.token_ids == expected, f"{name}: {rid} with the cache diverged"
        assert uncached[rid][2].num_cached_tokens == 0
    return {rid: out.num_cached_tokens for rid, (_, _, out) in cached.items()}, preemptions


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_cached_tokens_equal_uncached_and_generate_alone(tiny_model_dir, name, monkeypatch):
    shared_reads = []
    read_shared = rqbatcher.kernels.attention.shared_prefix_decode_attention
    read_fused = rqbatcher.kernels.segmented.shared_prefix_decode
    monkeypatch.setattr(rqbatcher.kernels.attention, "shared_prefix_decode_attention",
                        lambda *args, **kw: shared_reads.append(1) or read_shared(*args, **kw))
    monkeypatch.setattr(rqbatcher.kernels.segmented, "shared_prefix_decode",
                        lambda *args, **kw: shared_reads.append(1) or read_fused(*args, **kw))
    hits, preemptions = check_scenario(tiny_model_dir("llama"), name)
    knobs = SCENARIOS[name][0]
    size = knobs["block_size"]
    assert max(hits.values()) > 0, "the cache was never used"
    assert all(h % size == 0 for h in hits.values())
    if name == "prefix-of-whole-blocks":
        assert sorted(hits.values()) == [0] + [24] * 6  # those arriving with the first share in its step
    if name == "prompt-entirely-cached":
        assert hits == {"r0": 0, "r1": 16, "r2": 16, "r3": 8}  # the last token's block is always computed
    if name == "one-token-past-a-block-edge":
        assert hits == {"r0": 0, "r1": 24, "r2": 8}
    if name == "block-size-1":
        assert hits["r3"] == 12 and hits["r4"] == 13
    if name == "preemption-while-shared":
        assert preemptions > 0
    if name == "eviction-under-a-small-cache":
        assert hits["r1"] == 24 and hits["r3"] == 64  # shared while both were cached
        assert hits["r4"] < 24 and hits["r5"] == 24, hits  # the other document evicted part of the first
    if name == "many-sharing-one-prefix":
        assert sum(h == 24 for h in hits.values()) == len(hits) - 1
        assert shared_reads, "decodes sharing the prefix never read it together"


def test_every_family_shares_a_prefix(tiny_model_dir, family):
    """Sliding windows (mistral), no GQA (gpt2), one KV head (qwen2): a cached prefix reads the same."""
    hits, _ = check_scenario(tiny_model_dir(family), "block-size-7-chunked")
    assert max(hits.values()) > 0


POISON = [383, 383, 383, 383]


def test_a_failed_forward_does_not_leave_unwritten_blocks_for_its_sharers(tiny_model_dir):
    """The first request fills the shared prefix and raises in the forward; the second, admitted in the same
    step from those blocks, is recomputed on its own and still matches `generate`."""
    model_dir = tiny_model_dir("llama")
    engine = engine_for(model_dir, block_size=8, max_num_batched_tokens=64)

    def raise_on_poison(module, args):
        row = args[0].reshape(-1).tolist()
        if any(row[i:i + len(POISON)] == POISON for i in range(len(row))):
            raise RuntimeError("poisoned input")

    engine.runner.model.get_input_embeddings().register_forward_pre_hook(raise_on_poison)
    sharer_prompt = DOC + [7, 8]
    engine.add("filler", greedy(DOC + POISON, 4))
    engine.add("sharer", greedy(sharer_prompt, 6))
    finals = {}
    while engine.has_work():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    assert "poisoned input" in finals["filler"].error
    assert finals["sharer"].num_cached_tokens == 24  # admitted with the filler, from its blocks of that step
    assert finals["sharer"].token_ids == reference_tokens(model_dir, sharer_prompt, 6)
    allocator = engine.scheduler.allocator
    assert allocator.num_free == allocator.num_blocks
