"""The scheduler alone (pure Python): budgets, slots, chunking, preemption, stops and the static baseline.

`simulate_step` drives the real `schedule()`/`update()` pair, standing in only for the forward: every
sequence that samples this step draws token 7."""

import itertools

from rqbatcher.config import EngineConfig
from rqbatcher.schema import SamplingParams
from rqbatcher.workers.scheduler import Scheduler
from rqbatcher.workers.scheduler.blocks import BlockAllocator
from rqbatcher.workers.scheduler.sequence import Sequence, SequenceStatus


def make(num_blocks=100, block_size=4, **cfg):
    config = EngineConfig(block_size=block_size, num_blocks=num_blocks, **cfg)
    return Scheduler(config, BlockAllocator(num_blocks, block_size))


_first_ids = itertools.count(1, 1000)


def seq(rid, prompt_len, max_tokens=4):
    """A sequence whose prompt shares no token with any other's (prefix caching is tested on its own)."""
    first = next(_first_ids)
    return Sequence(rid, list(range(first, first + prompt_len)), SamplingParams(max_tokens=max_tokens))


TOKEN = 7


def simulate_step(sched, token=TOKEN):
    batch = sched.schedule()
    sched.update(batch, {s: token for s in batch.num_tokens if batch.samples(s)})
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


def test_update_advances_sequences_and_stops_them_at_eos_length_or_the_context():
    config = EngineConfig(block_size=4, num_blocks=100)
    sched = Scheduler(config, BlockAllocator(100, 4), eos_token_ids=frozenset({2}), max_model_len=12)
    eos, ignores_eos, capped = seq("eos", 4, max_tokens=50), seq("ignores", 4, max_tokens=3), seq("capped", 10, 50)
    ignores_eos.sampling = SamplingParams(max_tokens=3, ignore_eos=True)
    for s in (eos, ignores_eos, capped):
        sched.add(s)
    batch = sched.schedule()
    assert sched.update(batch, {eos: 5, ignores_eos: 2, capped: 5}, now=1.0) == []
    assert [s.num_computed_tokens for s in (eos, ignores_eos, capped)] == [4, 4, 10]
    assert eos.first_token_time == eos.last_token_time == 1.0 and eos.output_token_ids == [5]
    batch = sched.schedule()
    assert batch.num_tokens == {eos: 1, ignores_eos: 1, capped: 1}
    finished = sched.update(batch, {eos: 2, ignores_eos: 2, capped: 5}, now=2.0)
    assert finished == [eos, capped]
    assert (eos.finish_reason, capped.finish_reason) == ("stop", "length")  # EOS; prompt + output reached 12
    assert eos.first_token_time == 1.0 and eos.last_token_time == 2.0 and eos.block_table == []
    assert sched.running == [ignores_eos]
    batch = sched.schedule()
    assert sched.update(batch, {ignores_eos: 2}) == [ignores_eos] and ignores_eos.finish_reason == "length"
    assert not sched.has_work() and sched.allocator.num_free == 100


def test_a_chunk_that_does_not_end_the_prompt_samples_nothing():
    sched = make(max_num_batched_tokens=4)
    s = seq("long", 10)
    sched.add(s)
    batch = sched.schedule()
    assert batch.num_tokens == {s: 4} and not batch.samples(s)
    sched.update(batch, {})
    assert s.num_computed_tokens == 4 and s.num_output_tokens == 0
