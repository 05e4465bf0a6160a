"""The scheduling policy of issue 43, on a fake clock and a fake device: each step's time is its true cost, so
time to first token and fairness are judged in seconds. Cases: an infeasible target, interactive-only load with
long prompts, siblings on one document (the prefix computed once), a tenant's consecutive requests in a flood,
and the bounds of the budget."""

from __future__ import annotations

import itertools

import pytest

from rqbatcher.schema import SamplingParams
from rqbatcher.service_class import BATCH, INTERACTIVE, RANK
from rqbatcher.workers.scheduler import step_budget
from rqbatcher.workers.scheduler.preemption import FAIRNESS_INTERVAL_S, NEAR_END_S
from rqbatcher.workers.scheduler.sequence import Sequence
from tests.test_scheduler import make
from tests.test_step_budget import (
    BASE_S,
    DECODE_ROW_S,
    PROMPT_TOKEN_S,
    ending_within,
    step_at,
    tenant_seq,
    trained,
    true_cost,
)

TOKEN = 7
_unique = itertools.count(10_000_000, 100_000)


class FakeDevice:
    """Drives a scheduler: each step takes its true cost (times `slowdown`: a slower device) on the fake clock,
    which the cost model then learns."""

    def __init__(self, sched, slowdown: float = 1.0) -> None:
        self.sched, self.now, self.slowdown = sched, 0.0, slowdown

    def step(self):
        plan = self.sched.schedule(now=self.now)
        decode_rows = sum(1 for n in plan.num_tokens.values() if n == 1)
        seconds = self.slowdown * true_cost(plan.total_tokens - decode_rows, decode_rows)
        self.now += seconds
        self.sched.update(plan, {s: TOKEN for s in plan.num_tokens if plan.samples(s)}, now=self.now)
        self.sched.record_step(plan, seconds)
        return plan

    def run_until(self, done, max_steps=5000) -> None:
        for _ in range(max_steps):
            if done():
                return
            self.step()
        raise AssertionError("the scheduler stopped making progress")


def decode_only_s(rows: int) -> float:
    return BASE_S + DECODE_ROW_S * rows


def decoders(sched, n, tenant="x", max_tokens=10_000):
    seqs = [tenant_seq(f"d{i}", tenant, max_tokens=max_tokens) for i in range(n)]
    for s in seqs:
        sched.add(s)
    return seqs


# ----- an infeasible target -----
@pytest.mark.parametrize("target", [0.05, None], ids=["below the decodes' cost", "measured (the default)"])
def test_a_target_below_the_decodes_cost_adapts_to_a_multiple_of_the_decode_only_step_and_says_so(target):
    sched = trained(make(num_blocks=4000, max_num_seqs=40, max_num_batched_tokens=512, step_time_target=target))
    device = FakeDevice(sched)
    decoders(sched, 30)  # 30 decode rows cost 0.17 s alone
    device.step()
    batch = tenant_seq("b0", "x", BATCH, prompt_len=2000)
    sched.add(batch)
    device.step()
    plan = device.step()
    measured = step_budget.TARGET_DECODE_MULTIPLE * decode_only_s(30)
    assert sched.budget.infeasible is (target is not None), "a given target the decodes exceed is reported"
    assert sched.budget.step_target_s == pytest.approx(measured, rel=0.02)
    expected = (measured - decode_only_s(30)) / PROMPT_TOKEN_S  # 170 tokens, not the floor of 32
    assert plan.num_tokens[batch] == pytest.approx(expected, abs=2)
    assert true_cost(plan.num_tokens[batch], 30) <= measured * 1.02


def test_a_feasible_given_target_binds_as_given_and_is_not_reported():
    sched = trained(make(num_blocks=4000, max_num_seqs=40, max_num_batched_tokens=512, step_time_target=0.3))
    device = FakeDevice(sched)
    decoders(sched, 30)
    device.step()
    batch = tenant_seq("b0", "x", BATCH, prompt_len=2000)
    sched.add(batch)
    device.step()
    plan = device.step()
    assert not sched.budget.infeasible and sched.budget.step_target_s == 0.3
    assert plan.num_tokens[batch] == pytest.approx((0.3 - decode_only_s(30)) / PROMPT_TOKEN_S, abs=2)


# ----- interactive-only load with long prompts -----
def ttft_of_long_prompt(target, decoding=20, prompt_len=3000):
    sched = trained(make(num_blocks=4000, max_num_seqs=40, max_num_batched_tokens=512, step_time_target=target))
    device = FakeDevice(sched)
    decoders(sched, decoding)
    device.step()
    long = tenant_seq("long", "y", prompt_len=prompt_len, max_tokens=5)
    long.arrival_time = device.now
    sched.add(long)
    chunks = []
    while long.first_token_time is None:
        chunks.append(device.step().num_tokens.get(long, 0))
    return long.first_token_time - long.arrival_time, chunks


@pytest.mark.parametrize("target", [None, 0.03, 0.2])
def test_a_long_interactive_prompt_among_interactive_decodes_runs_as_with_the_target_off(target):
    ttft, chunks = ttft_of_long_prompt(target)
    unchunked, full_chunks = ttft_of_long_prompt(0)  # the target off: full-budget chunks
    assert ttft == pytest.approx(unchunked) and chunks == full_chunks, "its TTFT does not grow for others' ITL"



def interactive_schedule(target) -> list[dict[str, int]]:
    """Every step's plan (request id: tokens) of an interactive-only load: prompts of 3 to 2,500 tokens from three
    tenants, arriving while others decode, on the fake clock."""
    sched = trained(make(num_blocks=6000, max_num_seqs=16, max_num_batched_tokens=512, step_time_target=target))
    device = FakeDevice(sched)
    arrivals = [tenant_seq(f"r{i}", "abc"[i % 3], prompt_len=(3, 700, 2500, 120)[i % 4], max_tokens=20 + i % 7)
                for i in range(24)]
    plans = []
    while arrivals or sched.running or sched.waiting:
        if arrivals and len(plans) % 3 == 0:
            sched.add(arrivals.pop(0))
        plans.append({seq.request_id: n for seq, n in device.step().num_tokens.items()})
        assert len(plans) < 5000, "the scheduler stopped making progress"
    return plans


@pytest.mark.parametrize("target", [None, 0.03, 0.2], ids=["measured (the default)", "0.03 s", "0.2 s"])
def test_an_interactive_only_load_is_scheduled_step_for_step_as_with_the_target_off(target):
    assert interactive_schedule(target) == interactive_schedule(0)

def test_an_interactive_prompt_with_nothing_decoding_takes_the_full_budget():
    sched = trained(make(num_blocks=4000, max_num_seqs=8, max_num_batched_tokens=512, step_time_target=0.03))
    alone = tenant_seq("i0", "x", prompt_len=1000)
    sched.add(alone)
    assert FakeDevice(sched).step().num_tokens[alone] == 512


# ----- siblings on one document -----
def question(rid, document, service_class=INTERACTIVE):
    first = next(_unique)
    s = Sequence(rid, document + list(range(first, first + 20)), SamplingParams(max_tokens=4))
    s.service_class, s.urgency = service_class, (RANK[service_class], 0)
    return s


def possible_hits(seqs, document, block_size):
    """The prompt tokens every sibling but the first could find cached: the document's full blocks."""
    return (len(seqs) - 1) * (len(document) // block_size) * block_size


@pytest.mark.parametrize("budget", [64, 512])
@pytest.mark.parametrize("target", [None, 0.03, 0])
@pytest.mark.parametrize("arrival", ["together", "one a step", "behind a batch sibling"])
def test_siblings_on_one_document_compute_its_prefix_once(budget, target, arrival):
    sched = trained(make(num_blocks=4000, block_size=16, max_num_seqs=16, max_num_batched_tokens=budget,
                         step_time_target=target))
    device = FakeDevice(sched)
    decoders(sched, 4)  # something decodes, so the budget binds
    device.step()
    document = list(range(1, 1001))
    first_class = BATCH if arrival == "behind a batch sibling" else INTERACTIVE
    siblings = [question("q0", document, first_class)] + [question(f"q{i}", document) for i in range(1, 8)]
    computed = {s: 0 for s in siblings}
    pending = list(siblings)
    while pending or any(s.first_token_time is None for s in siblings):
        for s in pending[: len(pending) if arrival == "together" else 1]:
            sched.add(s)
        pending = [] if arrival == "together" else pending[1:]
        prefilling = [s for s in siblings if s.first_token_time is None]
        plan = device.step()
        for s in prefilling:
            computed[s] += plan.num_tokens.get(s, 0)
    hits = sum(s.num_cached_tokens for s in siblings)
    assert hits >= 0.99 * possible_hits(siblings, document, 16)
    assert sum(computed.values()) <= len(document) + 8 * 40, "the document is computed once"
    if arrival != "together" or budget == 64:
        assert sched.prefix_blocks_awaited > 0, "later siblings waited for the first's prefill in flight"


# ----- fairness: a tenant's consecutive requests in a flood -----
def test_each_of_a_tenants_consecutive_requests_in_a_flood_is_admitted_within_one_interval():
    sched = trained(make(num_blocks=4000, max_num_seqs=8, max_num_batched_tokens=512, min_batch_share=0.0))
    device = FakeDevice(sched)
    for i in range(40):  # tenant A's flood: more requests than slots, all interactive
        sched.add(tenant_seq(f"a{i}", "A", max_tokens=200, prompt_len=30))
    device.run_until(lambda: len(sched.running) == 8 and not any(s.num_uncomputed_tokens > 1 for s in sched.running))
    waits = []
    for i in range(3):  # B sends one request after another, each once the previous has finished
        b = tenant_seq(f"b{i}", "B", max_tokens=5, prompt_len=30)
        b.arrival_time = device.now
        sched.add(b)
        device.run_until(lambda b=b: b.is_finished)
        waits.append(b.first_token_time - b.arrival_time)
        assert sched.running and all(s.tenant == "A" for s in sched.running), "A's flood goes on"
    assert max(waits) <= FAIRNESS_INTERVAL_S
    assert sched.fairness_preemptions == 3, "every one of B's requests was judged, not only the first"


def test_on_a_slow_device_requests_a_few_tokens_from_their_end_still_give_way_for_fairness():
    """A flood of short requests: at times every one of A's is a few tokens from its end. Where a decode step takes
    most of a second, a few tokens are seconds: no reason to keep B waiting. Each of B's requests is judged."""
    sched = make(num_blocks=4000, max_num_seqs=8, max_num_batched_tokens=512, min_batch_share=0.0)
    device = FakeDevice(sched, slowdown=10.0)  # an 8-row decode step: 0.6 s
    for i in range(200):
        sched.add(tenant_seq(f"a{i}", "A", max_tokens=32, prompt_len=30))
    for i in range(3):  # B's requests one after another
        device.run_until(lambda: len(sched.running) == 8 and all(s.num_uncomputed_tokens == 1 for s in sched.running))
        for s in sched.running:
            ending_within(s, 4 * sched.decode_step_s, sched.decode_step_s)  # 4 tokens: 2.4 s
        b = tenant_seq(f"b{i}", "B", max_tokens=5, prompt_len=30)
        b.arrival_time = device.now
        sched.add(b)
        plan = device.step()
        assert b in plan.num_tokens and plan.preempted, "admitted at the next step, by a fairness preemption"
        assert b.first_token_time - b.arrival_time <= FAIRNESS_INTERVAL_S
        device.run_until(lambda b=b: b.is_finished)
    assert sched.fairness_preemptions == 3


def test_a_sequence_gives_way_for_fairness_at_most_once_an_interval_and_the_waiter_gets_in_when_it_passes():
    sched = trained(make(num_blocks=400, max_num_seqs=3, min_batch_share=0.0))
    a = [tenant_seq(f"a{i}", "A", max_tokens=500) for i in range(3)]
    for s in a:
        sched.add(s)
    step_at(sched, 0.0)
    sched.add(tenant_seq("b0", "B", max_tokens=2))
    assert step_at(sched, 0.1).preempted == [a[2]]
    step_at(sched, 0.2)  # B's last token
    step_at(sched, 0.3)
    assert a[2] in sched.running
    for s in a[:2]:  # near their end: only a2 could give way, and it did 0.3 s ago
        ending_within(s, NEAR_END_S, sched.decode_step_s)
    c = tenant_seq("c0", "C", max_tokens=2)
    sched.add(c)
    for now in (0.4, 0.5, 0.1 + FAIRNESS_INTERVAL_S - 0.01):
        assert not step_at(sched, now).preempted and c in sched.waiting, "a2 gave way within the interval"
    plan = step_at(sched, 0.1 + FAIRNESS_INTERVAL_S)
    assert plan.preempted == [a[2]] and c in plan.num_tokens, "admitted once the interval has passed"


# ----- the bounds -----
def test_batch_prefill_keeps_its_floor_and_urgent_prefill_the_full_budget_when_the_target_leaves_nothing():
    sched = trained(make(num_blocks=4000, max_num_seqs=40, max_num_batched_tokens=2000, step_time_target=0.18))
    device = FakeDevice(sched)
    decoders(sched, 30)  # 0.17 s of decodes: 10 prompt tokens fit in 0.18 s
    device.step()
    batch, urgent = tenant_seq("b0", "x", BATCH, prompt_len=4000), tenant_seq("i0", "y", prompt_len=4000)
    sched.add(batch)
    device.step()
    plan = device.step()
    assert not sched.budget.infeasible and plan.num_tokens[batch] == step_budget.BATCH_PROMPT_FLOOR
    sched.add(urgent)
    plan = device.step()
    assert plan.num_tokens[urgent] == 2000 - 30 - plan.num_tokens.get(batch, 0)


def test_without_urgent_work_for_the_quiet_period_the_full_budget_runs_under_any_target():
    sched = trained(make(num_blocks=4000, max_num_seqs=8, max_num_batched_tokens=512, step_time_target=None))
    device = FakeDevice(sched)
    batch = [tenant_seq(f"b{i}", "x", BATCH, prompt_len=3000, max_tokens=400) for i in range(2)]
    for s in batch:
        sched.add(s)
    plan = device.step()
    assert plan.total_tokens == 512 and not sched.budget.binding and sched.budget.step_target_s == 0.0
