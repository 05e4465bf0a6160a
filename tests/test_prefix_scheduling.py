"""Prefix caching in the scheduler (pure Python): what a sequence starts from, what it is charged, what
happens to shared blocks on preemption and failure, and invariants over random workloads.

`forward` stands in for the model. It writes into a simulated KV cache, at every scheduled token's
slot, the whole prefix that token's keys and values depend on, all writes of a step before any read
(as each layer of the model does); then it checks that every scheduled sequence's context reads back
its own tokens. A block shared by mistake, or read before anything wrote it, fails that check.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rqbatcher.config import EngineConfig
from rqbatcher.schema import SamplingParams
from rqbatcher.workers.scheduler import Scheduler, StepPlan
from rqbatcher.workers.scheduler.blocks import BlockAllocator
from rqbatcher.workers.scheduler.sequence import Sequence, SequenceStatus

TOKEN = 7


def make(num_blocks=64, block_size=4, prefix_caching=True, **cfg):
    config = EngineConfig(block_size=block_size, num_blocks=num_blocks, prefix_caching=prefix_caching, **cfg)
    return Scheduler(config, BlockAllocator(num_blocks, block_size, prefix_caching))


def seq(rid, prompt, max_tokens=4):
    return Sequence(rid, list(prompt), SamplingParams(max_tokens=max_tokens))


class SimulatedCache:
    """slot -> the tokens up to and including the one whose keys and values the slot holds."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[int, tuple[int, ...]] = {}

    def slot(self, s: Sequence, position: int) -> int:
        return s.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def forward(self, batch: StepPlan, failing: Sequence | None = None, sched: Scheduler | None = None) -> StepPlan:
        """Run `batch` as the engine does; with `failing`, that sequence's forward raises and the engine
        runs the others alone, in order, skipping any that the failure preempted. Returns what was computed."""
        computed = StepPlan(preempted=batch.preempted)
        order = list(batch.num_tokens.items())
        if failing is None:
            runs = [order]
        else:
            runs = [[item] for item in order]
        for run in runs:
            run = [(s, n) for s, n in run if s.status is SequenceStatus.RUNNING]
            if failing is not None and run and run[0][0] is failing:
                sched.finish(failing, "error")
                continue
            for s, n in run:
                for p in range(s.num_computed_tokens, s.num_computed_tokens + n):
                    self.slots[self.slot(s, p)] = tuple(s.token_ids[: p + 1])
            for s, n in run:
                for p in range(s.num_computed_tokens + n):
                    assert self.slots.get(self.slot(s, p)) == tuple(s.token_ids[: p + 1]), \
                        f"{s.request_id} reads wrong keys at position {p}"
                computed.num_tokens[s] = n
        return computed


def step(sched, cache, failing=None):
    batch = sched.schedule()
    computed = cache.forward(batch, failing, sched)
    sched.update(computed, {s: TOKEN for s in computed.num_tokens if computed.samples(s)})
    return batch


def check_invariants(sched: Scheduler) -> None:
    alloc = sched.allocator
    holders = [b for s in sched.running for b in s.block_table]
    for block in range(alloc.num_blocks):
        refs = alloc.ref_count(block)
        assert refs >= 0
        assert refs == holders.count(block), f"block {block}: {refs} references, {holders.count(block)} holders"
        assert alloc.is_free(block) == (refs == 0), f"block {block} is both free and in use"
    assert all(not s.block_table for s in sched.waiting)


def run_to_end(sched, cache):
    while sched.has_work():
        step(sched, cache)
        check_invariants(sched)


def test_a_prefix_of_whole_blocks_is_taken_and_only_the_rest_is_computed():
    sched, cache = make(block_size=4), SimulatedCache(4)
    doc = list(range(100, 108))  # two whole blocks
    first, second = seq("a", doc + [1, 2, 3]), seq("b", doc + [4, 5])
    sched.add(first)
    run_to_end(sched, cache)
    sched.add(second)
    batch = step(sched, cache)
    assert batch.num_tokens == {second: 2} and second.num_cached_tokens == 8
    assert sched.prefix_cache_stats.queries == 11 + 10 and sched.prefix_cache_stats.hits == 8


def test_a_prompt_entirely_cached_still_computes_its_last_block():
    sched, cache = make(block_size=4), SimulatedCache(4)
    prompt = list(range(100, 112))  # three whole blocks
    sched.add(seq("a", prompt))
    run_to_end(sched, cache)
    again = seq("b", prompt)
    sched.add(again)
    assert step(sched, cache).num_tokens == {again: 4}  # the last token needs its logits: its block is recomputed
    assert again.num_cached_tokens == 8


def test_one_token_past_a_block_edge_computes_one_token():
    sched, cache = make(block_size=4), SimulatedCache(4)
    prompt = list(range(100, 112))
    sched.add(seq("a", prompt))
    run_to_end(sched, cache)
    longer = seq("b", prompt + [5])
    sched.add(longer)
    assert step(sched, cache).num_tokens == {longer: 1} and longer.num_cached_tokens == 12


def test_prompts_arriving_together_share_in_the_same_step():
    sched, cache = make(block_size=4, max_num_batched_tokens=64), SimulatedCache(4)
    doc = list(range(100, 116))
    seqs = [seq(f"q{i}", doc + [i, i + 1, i + 2]) for i in range(4)]
    for s in seqs:
        sched.add(s)
    batch = step(sched, cache)
    assert batch.num_tokens == {seqs[0]: 19, seqs[1]: 3, seqs[2]: 3, seqs[3]: 3}
    assert [s.num_cached_tokens for s in seqs] == [0, 16, 16, 16]
    run_to_end(sched, cache)


def test_under_a_token_budget_a_shared_prefix_is_computed_once():
    sched, cache = make(block_size=4, max_num_batched_tokens=8), SimulatedCache(4)
    doc = list(range(100, 124))
    seqs = [seq(f"q{i}", doc + [i, i + 1]) for i in range(3)]
    for s in seqs:
        sched.add(s)
    run_to_end(sched, cache)
    assert [s.num_cached_tokens for s in seqs] == [0, 24, 24]


def test_admission_counts_only_the_blocks_a_sequence_newly_needs():
    # 8 blocks of 4: one 26-token prompt takes 7; a second copy of it would not fit, but it needs only 1 more
    sched, cache = make(num_blocks=8, block_size=4, max_num_batched_tokens=64), SimulatedCache(4)
    doc = list(range(100, 124))
    a, b = seq("a", doc + [1, 2], max_tokens=1), seq("b", doc + [3, 4], max_tokens=1)
    sched.add(a)
    sched.add(b)
    batch = step(sched, cache)
    assert set(batch.num_tokens) == {a, b} and not batch.preempted


def test_preemption_while_a_block_is_shared_keeps_it_for_the_other():
    sched, cache = make(num_blocks=10, block_size=4, max_num_batched_tokens=64), SimulatedCache(4)
    doc = list(range(100, 116))
    old, young = seq("old", doc + [1, 2], max_tokens=16), seq("young", doc + [3, 4], max_tokens=12)
    sched.add(old)
    sched.add(young)
    batch = step(sched, cache)
    shared = old.block_table[:4]
    assert young.block_table[:4] == shared
    while not batch.preempted:
        batch = step(sched, cache)
        check_invariants(sched)
    assert batch.preempted == [young] and young.block_table == []
    assert all(sched.allocator.ref_count(b) == 1 for b in shared)  # old still holds them
    run_to_end(sched, cache)
    assert (old.num_output_tokens, young.num_output_tokens) == (16, 12)
    assert sched.allocator.num_free == sched.allocator.num_blocks


def test_a_failed_forward_uncaches_what_it_never_wrote_and_resets_who_shared_it():
    sched, cache = make(block_size=4, max_num_batched_tokens=64), SimulatedCache(4)
    doc = list(range(100, 116))
    filler, sharer = seq("filler", doc + [1]), seq("sharer", doc + [2])
    sched.add(filler)
    sched.add(sharer)
    batch = step(sched, cache, failing=filler)
    assert set(batch.num_tokens) == {filler, sharer} and sharer.num_cached_tokens == 16
    assert filler.finish_reason == "error"
    assert sharer.status is SequenceStatus.WAITING and sharer.num_computed_tokens == 0
    assert sched.allocator.cached_prefix(filler.block_hashes) == []
    run_to_end(sched, cache)  # the sharer computes the prefix itself: the cache checks what it reads
    assert sharer.num_output_tokens == 4


def test_with_caching_off_nothing_is_shared_or_counted():
    sched, cache = make(prefix_caching=False), SimulatedCache(4)
    doc = list(range(100, 116))
    a, b = seq("a", doc + [1]), seq("b", doc + [2])
    sched.add(a)
    sched.add(b)
    step(sched, cache)
    assert not set(a.block_table) & set(b.block_table)
    assert (sched.prefix_cache_stats.queries, sched.prefix_cache_stats.hits, b.num_cached_tokens) == (0, 0, 0)
    run_to_end(sched, cache)


workloads = st.fixed_dictionaries({
    "block_size": st.sampled_from([1, 2, 3, 4, 7]),
    "num_blocks": st.integers(12, 60),
    "budget": st.integers(2, 48),
    "slots": st.integers(1, 6),
    "static": st.booleans(),
    "requests": st.lists(st.tuples(st.integers(0, 1), st.integers(0, 30), st.integers(1, 12), st.integers(1, 8)),
                         min_size=1, max_size=10),  # (prefix id, prefix length, own tokens, max tokens)
    "arrive_together": st.integers(1, 10),
    "events": st.lists(st.tuples(st.sampled_from(["step", "step", "step", "abort", "fail", "add"]),
                                 st.integers(0, 100)), max_size=80),
})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads)
def test_random_workloads_keep_the_pool_consistent_and_every_read_right(w):
    """Steps, aborts, failed forwards and late arrivals in any order: reference counts never go negative,
    no block is both free and in use, every sequence reads its own keys, and all blocks come back."""
    size = w["block_size"]
    sched = make(num_blocks=w["num_blocks"], block_size=size, max_num_batched_tokens=w["budget"],
                 max_num_seqs=w["slots"], policy="static" if w["static"] else "continuous")
    cache = SimulatedCache(size)
    prefixes = [list(range(1000 * (p + 1), 1000 * (p + 1) + 30)) for p in range(2)]
    pending = []
    for i, (prefix, prefix_len, own, max_tokens) in enumerate(w["requests"]):
        prompt = prefixes[prefix][:prefix_len] + [10 * i + k for k in range(own)]
        longest = len(prompt) + max_tokens
        if -(-longest // size) <= w["num_blocks"]:  # the engine refuses what could never fit
            pending.append(seq(f"r{i}", prompt, max_tokens))
    for _ in range(min(w["arrive_together"], len(pending))):
        sched.add(pending.pop(0))
    for event, pick in w["events"] + [("step", 0)] * 400:
        if (event == "add" or not sched.has_work()) and pending:
            sched.add(pending.pop(0))
        elif event == "abort" and (sched.running or sched.waiting):
            victims = sched.running + list(sched.waiting)
            sched.finish(victims[pick % len(victims)], "cancelled")
        elif event in ("step", "fail"):
            batch = sched.schedule()
            failing = list(batch.num_tokens)[pick % len(batch.num_tokens)] if event == "fail" and batch else None
            computed = cache.forward(batch, failing, sched)
            sched.update(computed, {s: TOKEN for s in computed.num_tokens if computed.samples(s)})
        check_invariants(sched)
        if not sched.has_work() and not pending:
            break
    assert not sched.has_work() and not pending
    assert sched.allocator.num_free == sched.allocator.num_blocks
    assert all(sched.allocator.ref_count(b) == 0 for b in range(sched.allocator.num_blocks))
    stats = sched.prefix_cache_stats
    assert 0 <= stats.hits <= stats.queries
