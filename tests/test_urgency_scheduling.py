"""Preemption for urgency in the engine (workers/scheduler/preemption.py through the scheduler), and its bounds; then on
a tiny real model, a sequence preempted for urgency resumes to the same greedy fp32 tokens."""

from __future__ import annotations

from rqbatcher.service_class import BATCH, INTERACTIVE, PRIORITY, RANK
from tests.engine_helpers import engine_for, greedy, random_prompts, reference_tokens, run_all
from tests.test_scheduler import make, seq, simulate_step


def classed(rid, service_class, prompt_len=3, max_tokens=50, level=0):
    s = seq(rid, prompt_len, max_tokens)
    s.service_class, s.urgency = service_class, (RANK[service_class], level)
    return s


def test_an_interactive_request_preempts_the_latest_batch_sequence_when_no_slot_is_free():
    sched = make(max_num_seqs=4, min_batch_share=0.25)
    batch = [classed(f"b{i}", BATCH) for i in range(4)]
    for s in batch:
        sched.add(s)
    simulate_step(sched)
    assert sched.free_slots == 0 and sched.urgent_room == 3  # 4 batch sequences, one kept (the floor)
    urgent = classed("i0", INTERACTIVE)
    sched.add(urgent)
    step = simulate_step(sched)
    assert step.preempted == [batch[-1]] and urgent in step.num_tokens
    assert sched.urgency_preemptions == {BATCH: 1} and batch[-1].num_preemptions == 1
    assert all(s in step.num_tokens for s in batch[:-1]), "the other batch sequences kept running"


def test_batch_work_keeps_its_minimum_share_and_is_admitted_first_below_it():
    sched = make(max_num_seqs=4, min_batch_share=0.5)  # a floor of 2 slots
    batch = [classed(f"b{i}", BATCH) for i in range(4)]
    for s in batch:
        sched.add(s)
    simulate_step(sched)
    urgent = [classed(f"i{i}", INTERACTIVE) for i in range(4)]
    for s in urgent:
        sched.add(s)
    simulate_step(sched)
    running = {s.request_id for s in sched.running}
    assert running == {"b0", "b1", "i0", "i1"}, "two batch sequences stay: the floor"
    assert sched.urgent_room == 0 and sched.urgency_preemptions == {BATCH: 2}
    urgent[0].sampling = urgent[0].sampling.model_copy(update={"max_tokens": urgent[0].num_output_tokens + 1})
    batch[0].sampling = batch[0].sampling.model_copy(update={"max_tokens": batch[0].num_output_tokens + 1})
    simulate_step(sched)  # b0 and i0 end
    simulate_step(sched)  # a preempted batch sequence takes a slot back first (under the floor), then i2
    assert {s.request_id for s in sched.running} == {"b1", "b2", "i1", "i2"}
    assert sched.batch_deficit == 0


def test_only_a_more_urgent_class_preempts_and_priority_preempts_interactive():
    sched = make(max_num_seqs=2, min_batch_share=0.0)
    low = [classed("i0", INTERACTIVE), classed("i1", INTERACTIVE, level=5)]
    for s in low:
        sched.add(s)
    simulate_step(sched)
    same = classed("i2", INTERACTIVE)  # a more urgent level of the same class waits: no churn
    sched.add(same)
    assert not simulate_step(sched).preempted and same in sched.waiting
    top = classed("p0", PRIORITY)
    sched.add(top)
    step = simulate_step(sched)
    assert step.preempted == [low[1]], "the least urgent running sequence gives way (level 5)"
    assert top in step.num_tokens and sched.urgency_preemptions == {INTERACTIVE: 1}
    assert sched.urgent_room == 0, "the worker takes more beyond its slots only to preempt batch work"


def test_an_interactive_request_short_of_kv_blocks_preempts_batch_work():
    sched = make(max_num_seqs=8, num_blocks=6, block_size=4, min_batch_share=0.0)
    batch = [classed(f"b{i}", BATCH, prompt_len=7) for i in range(3)]  # 2 blocks each (with the next token): full
    for s in batch:
        sched.add(s)
    simulate_step(sched)
    assert sched.allocator.num_free == 0 and sched.free_slots == 5
    urgent = classed("i0", INTERACTIVE, prompt_len=6)
    sched.add(urgent)
    step = simulate_step(sched)
    assert step.preempted == [batch[-1]] and urgent in step.num_tokens


def test_a_sequence_preempted_for_urgency_resumes_to_the_same_greedy_tokens(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    engine = engine_for(model_dir, max_num_seqs=4, max_num_batched_tokens=64, block_size=4, min_batch_share=0.25)
    prompts = random_prompts(6, seed=19, min_len=5, max_len=20)
    requests = {f"b{i}": greedy(p, 12).model_copy(update={"service_class": "batch"}) for i, p in enumerate(prompts[:4])}
    for rid, request in requests.items():
        engine.add(rid, request)
    for _ in range(4):
        engine.step()
    for i, p in enumerate(prompts[4:]):
        requests[f"i{i}"] = greedy(p, 6)
        engine.add(f"i{i}", requests[f"i{i}"])
    finals = run_all(engine)
    assert engine.scheduler.urgency_preemptions.get(BATCH) == 2
    for rid, request in requests.items():
        assert finals[rid].token_ids == reference_tokens(model_dir, request.prompt_token_ids,
                                                         request.sampling.max_tokens), rid


def test_an_interactive_request_is_admitted_before_the_prompt_chunks_of_batch_work():
    sched = make(max_num_seqs=4, max_num_batched_tokens=8, min_batch_share=0.0)
    long_batch = classed("b0", BATCH, prompt_len=40)
    sched.add(long_batch)
    simulate_step(sched)  # its first chunk; 32 prompt tokens still to go
    urgent = classed("i0", INTERACTIVE, prompt_len=5)
    sched.add(urgent)
    step = simulate_step(sched)
    assert step.num_tokens == {urgent: 5}, "a step that starts interactive work carries no batch prompt: it is short"
    assert simulate_step(sched).num_tokens == {urgent: 1, long_batch: 7}
