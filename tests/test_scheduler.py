"""The scheduler alone (pure Python): budgets, slots, chunking, preemption and the static baseline.

`simulate_step` stands in for the engine: it advances computed tokens and appends a token to every
sequence whose prompt is fully computed, finishing it after `max_tokens`."""

from batcher.blocks import BlockAllocator
from batcher.config import EngineConfig
from batcher.scheduler import Scheduler, Sequence, SequenceStatus
from batcher.schema import SamplingParams


def make(num_blocks=100, block_size=4, **cfg):
    config = EngineConfig(block_size=block_size, num_blocks=num_blocks, **cfg)
    return Scheduler(config, BlockAllocator(num_blocks, block_size))


def seq(rid, prompt_len, max_tokens=4):
    return Sequence(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens))


def simulate_step(sched):
    batch = sched.schedule()
    for s, n in batch.num_tokens.items():
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(7)
            if s.num_output_tokens >= s.sampling.max_tokens:
                sched.finish(s, "length")
    return batch


def test_decodes_get_one_token_and_prefill_is_chunked_to_the_budget():
    sched = make(max_num_seqs=4, max_num_batched_tokens=8)
    running = [seq(f"d{i}", 3, max_tokens=50) for i in range(3)]
    for s in running:
        sched.add(s)
    simulate_step(sched)  # 9 prompt tokens > budget 8: the third waits for the rest of its prompt
    simulate_step(sched)
    long = seq("long", 20)
    sched.add(long)
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        batch = simulate_step(sched)
        assert all(batch.num_tokens[s] == 1 for s in running), "a running decode missed a step"
        assert batch.total_tokens <= 8
        chunks.append(batch.num_tokens[long])
    assert sum(chunks) == 20 and len(chunks) > 1 and max(chunks) == 5


def test_slots_limit_admission_and_a_freed_slot_is_refilled_next_step():
    sched = make(max_num_seqs=2, max_num_batched_tokens=64)
    short, long, waiting = seq("short", 4, max_tokens=1), seq("long", 4, max_tokens=10), seq("next", 4)
    for s in (short, long, waiting):
        sched.add(s)
    first = simulate_step(sched)
    assert set(first.num_tokens) == {short, long}
    assert short.is_finished  # one token and done
    second = simulate_step(sched)
    assert waiting in second.num_tokens


def test_static_admits_only_into_an_empty_batch_and_never_chunks():
    sched = make(max_num_seqs=2, max_num_batched_tokens=4, policy="static")
    a, b, c = seq("a", 10, max_tokens=1), seq("b", 10, max_tokens=3), seq("c", 10, max_tokens=1)
    for s in (a, b, c):
        sched.add(s)
    first = simulate_step(sched)
    assert first.num_tokens == {a: 10, b: 10}  # whole prompts, budget ignored
    assert a.is_finished
    while not b.is_finished:
        batch = simulate_step(sched)
        assert c not in batch.num_tokens, "static admitted into a non-empty batch"
    assert c in simulate_step(sched).num_tokens


def test_preemption_frees_the_latest_admitted_and_requeues_it_first():
    sched = make(num_blocks=5, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    old, young = seq("old", 8, max_tokens=10), seq("young", 7, max_tokens=10)
    sched.add(old)
    sched.add(young)
    batch = simulate_step(sched)
    while not batch.preempted:
        batch = simulate_step(sched)
    assert batch.preempted == [young]
    assert young.status is SequenceStatus.WAITING and young.num_computed_tokens == 0
    assert young.block_table == [] and sched.waiting[0] is young
    assert young.num_output_tokens > 0  # what it generated is kept and recomputed, not lost
    while sched.has_work():
        simulate_step(sched)
    assert old.num_output_tokens == 10 and young.num_output_tokens == 10


def test_finish_removes_a_waiting_sequence_too():
    sched = make()
    s = seq("x", 4)
    sched.add(s)
    sched.finish(s, "cancelled")
    assert not sched.has_work() and s.finish_reason == "cancelled"


def test_free_slots_counts_running_and_waiting():
    sched = make(max_num_seqs=3)
    assert sched.free_slots == 3
    sched.add(seq("a", 4))
    simulate_step(sched)
    sched.add(seq("b", 4))
    assert sched.free_slots == 1
