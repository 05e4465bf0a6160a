"""Steps sized to a latency target (workers/scheduler/step_cost.py, step_budget.py) with a fake clock and a cost
model fed known step times; then fairness between interactive tenants by preemption (workers/scheduler/
preemption.py), on the scheduler and, for tokens, on a tiny real model."""

from __future__ import annotations

import pytest

from rqbatcher.service_class import BATCH, INTERACTIVE, PRIORITY
from rqbatcher.workers.scheduler import preemption, step_budget
from rqbatcher.workers.scheduler.preemption import FAIRNESS_INTERVAL_S, NEAR_END_S
from rqbatcher.workers.scheduler.step_cost import StepCostModel
from tests.engine_helpers import engine_for, greedy, random_prompts, reference_tokens, run_all
from tests.test_scheduler import make, simulate_step
from tests.test_urgency_scheduling import classed

BASE_S, PROMPT_TOKEN_S, DECODE_ROW_S = 0.02, 0.001, 0.005  # the device the fake clock runs on
TARGET_S = 0.2


def true_cost(prompt_tokens: int, decode_rows: int) -> float:
    return BASE_S + PROMPT_TOKEN_S * prompt_tokens + DECODE_ROW_S * decode_rows


def trained(sched):
    """The scheduler's cost model, fed steps of the fake device (varied mixes, as real traffic gives)."""
    for prompt, rows in [(512, 0), (256, 8), (64, 32), (0, 16), (128, 4), (400, 20), (0, 1)]:
        sched.step_cost.observe(prompt, rows, true_cost(prompt, rows))
    return sched


def tenant_seq(rid, tenant, service_class=INTERACTIVE, max_tokens=100, prompt_len=3):
    s = classed(rid, service_class, prompt_len=prompt_len, max_tokens=max_tokens)
    s.tenant = tenant
    return s


def step_at(sched, now):
    plan = sched.schedule(now=now)
    sched.update(plan, {s: 7 for s in plan.num_tokens if plan.samples(s)}, now=now)
    return plan


# ----- the cost model -----
def test_the_cost_model_learns_a_devices_step_costs_and_follows_a_change_of_speed():
    model = StepCostModel()
    assert not model.ready
    mixes = [(p, r) for p in (0, 16, 100, 300, 512) for r in (1, 4, 16, 32)]
    for prompt, rows in mixes:
        model.observe(prompt, rows, true_cost(prompt, rows))
    assert model.ready
    assert model.prompt_token_s == pytest.approx(PROMPT_TOKEN_S, rel=0.02)
    assert model.decode_row_s == pytest.approx(DECODE_ROW_S, rel=0.05)
    assert model.predict(200, 10) == pytest.approx(true_cost(200, 10), rel=0.02)
    for prompt, rows in mixes * 4:  # the device slows to half its speed (a neighbour's load)
        model.observe(prompt, rows, 2 * true_cost(prompt, rows))
    assert model.predict(200, 10) == pytest.approx(2 * true_cost(200, 10), rel=0.05)
    assert model.prompt_tokens_within(0.1) == pytest.approx(0.1 / (2 * PROMPT_TOKEN_S), abs=2)


# ----- the step budget -----
def test_batch_prompt_chunks_follow_the_target_while_interactive_work_runs():
    sched = trained(make(num_blocks=2000, max_num_seqs=8, max_num_batched_tokens=512, step_time_target=TARGET_S))
    urgent, batch = tenant_seq("i0", "x", max_tokens=50), tenant_seq("b0", "x", BATCH, prompt_len=2000)
    sched.add(urgent)
    sched.add(batch)
    first = step_at(sched, 0.0)
    assert first.num_tokens == {urgent: 3}, "the first step of a new interactive request carries no batch prompt"
    second = step_at(sched, 0.1)
    expected = int((TARGET_S - BASE_S - DECODE_ROW_S) / PROMPT_TOKEN_S)  # one decode row: 175 tokens
    assert second.num_tokens[urgent] == 1 and abs(second.num_tokens[batch] - expected) <= 1
    assert true_cost(second.total_tokens - 1, 1) <= TARGET_S + 0.002
    assert sched.budget.binding and abs(sched.budget.prompt_tokens - expected) <= 1


def test_the_full_budget_returns_once_interactive_work_has_left_for_the_quiet_period():
    sched = trained(make(num_blocks=2000, max_num_seqs=8, max_num_batched_tokens=512, step_time_target=TARGET_S))
    urgent, batch = tenant_seq("i0", "x", max_tokens=2), tenant_seq("b0", "x", BATCH, prompt_len=4000)
    sched.add(urgent)
    sched.add(batch)
    step_at(sched, 0.0)
    step_at(sched, 0.1)  # the interactive request's second and last token
    assert urgent.is_finished
    soon = step_at(sched, 0.2)
    assert soon.num_tokens[batch] <= int((TARGET_S - BASE_S) / PROMPT_TOKEN_S) + 1, "a pause between requests"
    later = step_at(sched, 0.2 + step_budget.QUIET_S)
    assert later.num_tokens[batch] == 512 and not sched.budget.binding


def test_a_long_interactive_prompt_takes_the_full_budget_alone_and_among_decodes():
    sched = trained(make(num_blocks=2000, max_num_seqs=8, max_num_batched_tokens=512, step_time_target=TARGET_S))
    alone = tenant_seq("i0", "x", prompt_len=1000)
    sched.add(alone)
    assert step_at(sched, 0.0).num_tokens[alone] == 512  # chunking it would only delay its own first token
    sched = trained(make(num_blocks=2000, max_num_seqs=8, max_num_batched_tokens=512, step_time_target=TARGET_S))
    decoding = tenant_seq("i1", "y", max_tokens=50)
    sched.add(decoding)
    step_at(sched, 0.0)
    long = tenant_seq("i2", "x", prompt_len=1000)
    sched.add(long)
    plan = step_at(sched, 0.01)
    assert sched.budget.binding  # the target binds, yet bounds batch prompt work only
    assert plan.num_tokens[decoding] == 1 and plan.num_tokens[long] == 511


@pytest.mark.parametrize("why", ["no target", "no measured step yet"])
def test_without_a_target_or_a_measured_cost_a_step_takes_the_full_budget(why):
    sched = make(num_blocks=2000, max_num_seqs=8, max_num_batched_tokens=512,
                 step_time_target=0.0 if why == "no target" else TARGET_S)
    if why == "no target":
        trained(sched)
    urgent, batch = tenant_seq("i0", "x", max_tokens=50), tenant_seq("b0", "x", BATCH, prompt_len=2000)
    sched.add(urgent)
    sched.add(batch)
    step_at(sched, 0.0)
    assert step_at(sched, 0.1).num_tokens[batch] == 511


# ----- fairness between interactive tenants -----
def test_a_tenant_holding_no_slot_preempts_one_sequence_of_the_most_served_tenant():
    sched = make(max_num_seqs=4, min_batch_share=0.0)
    a = [tenant_seq(f"a{i}", "A") for i in range(3)]
    c = tenant_seq("c0", "C")
    for s in (*a, c):
        sched.add(s)
    simulate_step(sched)
    assert sched.free_slots == 0 and sched.urgent_room == 0 and sched.fair_room == 1
    b = tenant_seq("b0", "B")
    sched.add(b)
    assert sched.fair_room == 0, "one request of a slotless tenant waits already"
    plan = simulate_step(sched)
    assert plan.preempted == [a[-1]] and b in plan.num_tokens, "A holds 3 of 4 slots: its latest gives way"
    assert sched.fairness_preemptions == 1 and sched.urgency_preemptions == {}
    assert a[-1] in sched.waiting and sched.fair_room == 1, "A's waiting sequence is no slotless tenant's"
    assert preemption.fairness_victim("D", sched.running, sched.now, 0.0, 4) is a[1], "A still holds the most"


def test_a_tenant_holding_one_slot_never_gives_it_up_for_fairness():
    sched = make(max_num_seqs=3, min_batch_share=0.0)
    for tenant in "ABC":
        sched.add(tenant_seq(f"{tenant}0", tenant))
    simulate_step(sched)
    assert sched.fair_room == 0
    d = tenant_seq("d0", "D")
    sched.add(d)
    assert not simulate_step(sched).preempted and d in sched.waiting, "slots would only change hands"


def ending_within(seq, seconds: float, step_s: float) -> None:
    """Make `seq` reach its max_tokens in `seconds` of decode steps of `step_s`."""
    seq.sampling = seq.sampling.model_copy(update={"max_tokens": seq.num_output_tokens + int(seconds / step_s)})


def test_fairness_preemption_spares_sequences_near_their_end_and_preempts_one_at_most_once_an_interval():
    sched = trained(make(max_num_seqs=3, min_batch_share=0.0))
    a = [tenant_seq(f"a{i}", "A") for i in range(3)]
    for s in a:
        sched.add(s)
    simulate_step(sched)
    b = tenant_seq("b0", "B", max_tokens=2)
    sched.add(b)
    assert simulate_step(sched).preempted == [a[2]]
    simulate_step(sched)  # B's last token: its slot frees, and a2 comes back
    simulate_step(sched)
    assert a[2] in sched.running and sched.running[-1] is a[2]
    c = tenant_seq("c0", "C")
    sched.add(c)
    assert simulate_step(sched).preempted == [a[1]], "a2 gave way within the interval: the next latest does"
    for s in a:
        ending_within(s, NEAR_END_S, sched.decode_step_s)
    d = tenant_seq("d0", "D")
    sched.add(d)
    assert sched.now - a[2].fairness_preempted_at < FAIRNESS_INTERVAL_S
    assert not simulate_step(sched).preempted and d in sched.waiting, "every A sequence is near its end"


def test_interactive_work_never_preempts_priority_work_for_fairness():
    sched = make(max_num_seqs=2, min_batch_share=0.0)
    for s in (tenant_seq("p0", "A", PRIORITY), tenant_seq("p1", "A", PRIORITY)):
        sched.add(s)
    simulate_step(sched)
    b = tenant_seq("b0", "B")
    sched.add(b)
    assert sched.fair_room == 0 and not simulate_step(sched).preempted and b in sched.waiting


def test_sequences_preempted_for_fairness_resume_to_the_same_greedy_tokens(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(preemption, "NEAR_END_S", 0.0)  # a tiny model's 16 tokens all end within it
    model_dir = tiny_model_dir("llama")
    engine = engine_for(model_dir, max_num_seqs=3, max_num_batched_tokens=64, block_size=4)
    prompts = random_prompts(4, seed=34, min_len=5, max_len=20)
    requests = {f"a{i}": greedy(p, 16).model_copy(update={"tenant": "A"}) for i, p in enumerate(prompts[:3])}
    for rid, request in requests.items():
        engine.add(rid, request)
    for _ in range(3):
        engine.step()
    requests["b0"] = greedy(prompts[3], 6).model_copy(update={"tenant": "B"})
    engine.add("b0", requests["b0"])
    finals = run_all(engine)
    assert engine.scheduler.fairness_preemptions == 1
    for rid, request in requests.items():
        assert finals[rid].token_ids == reference_tokens(model_dir, request.prompt_token_ids,
                                                         request.sampling.max_tokens), rid
