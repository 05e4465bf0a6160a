"""Service classes and the fair pick (batcher/service_class.py, batcher/fairness.py) on a Redis with Lua.

The pick is run on fakeredis (the demo's embedded Redis, which runs the same Lua) and, for the test of two
pickers at once, on the real Redis. A simulated job ends right after it is picked, charging its real cost."""

from __future__ import annotations

import threading

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batcher import fairness, keys
from batcher.client import Client
from batcher.fairness import Candidate, Picker, charge_on, cost
from batcher.schema import GenerationRequest
from batcher.service_class import (BATCH, INTERACTIVE, PRIORITY, RANK, class_of, class_queue, parse_queue,
                                   tenant_token, urgency_of)
from tests.jobs_support import claim_database, fake_redis_fixture, release_database  # noqa: F401

BASE = "fair"


def candidates(tenants: list[str], extra: list[tuple[str, int]] = ()) -> list[Candidate]:
    """Batch queues of `tenants` in one group, after `extra` non-batch (queue, group) pairs."""
    rows = [Candidate(f"rq:queue:{name}", f"rq:intermediate:{name}", keys.fairness_key(BASE, parse_queue(name).service_class),
                      group, False, "-") for name, group in extra]
    for tenant in tenants:
        name = class_queue(BASE, BATCH, 0, tenant)
        rows.append(Candidate(f"rq:queue:{name}", f"rq:intermediate:{name}", keys.fairness_key(BASE, BATCH),
                              RANK[BATCH] * 1000, True, tenant_token(tenant)))
    return rows


def push(redis, queue: str, job_ids: list[str]) -> None:
    if job_ids:
        redis.rpush(f"rq:queue:{queue}", *job_ids)


def end(redis, queue: str, prompt: int, generated: int) -> None:
    with redis.pipeline() as pipe:
        pipe.multi()
        charge_on(pipe, queue, None, prompt, generated)
        pipe.execute()


# ----- naming -----
@given(st.sampled_from([PRIORITY, INTERACTIVE, BATCH]), st.integers(0, 9),
       st.none() | st.from_regex(r"[A-Za-z0-9_.@-]{1,128}", fullmatch=True), st.booleans())
def test_a_class_queue_name_says_its_class_level_tenant_and_base(service_class, level, tenant, routed_by_model):
    routed = keys.model_queue(BASE, "org/Model.v1") if routed_by_model else BASE
    name = class_queue(routed, service_class, level, tenant)
    parsed = parse_queue(name)
    assert (parsed.routed, parsed.service_class, parsed.level) == (routed, service_class, level)
    assert keys.base_queue(name) == BASE and keys.unprioritised(name) == routed
    if service_class == BATCH:
        assert parsed.tenant == (None if tenant is None else tenant_token(tenant))
    if service_class == INTERACTIVE:  # what a plain-RQ producer and older clients always used
        assert name == keys.queue_name(routed, level)


def test_classes_of_requests_and_their_urgency():
    assert class_of(GenerationRequest(prompt="x")) == INTERACTIVE
    assert class_of(GenerationRequest(prompt="x", service_class="batch")) == BATCH
    assert class_of(GenerationRequest(prompt="x", batch={"id": "batch_1", "index": 0})) == BATCH
    assert urgency_of(GenerationRequest(prompt="x", priority=3, service_class="priority")) == (RANK[PRIORITY], 3)
    from datetime import datetime, timedelta, timezone
    soon = datetime.now(timezone.utc) + timedelta(seconds=60)
    later = datetime.now(timezone.utc) + timedelta(hours=20)
    assert urgency_of(GenerationRequest(prompt="x", service_class="batch", deadline=later)) == (RANK[BATCH], 0)
    assert urgency_of(GenerationRequest(prompt="x", service_class="batch", deadline=soon)) == (RANK[INTERACTIVE], 0)


def test_the_client_routes_each_class_to_its_queue_and_registers_the_class_queues(fake_redis):
    client = Client(fake_redis, queue=BASE)
    interactive = client.submit("hello")
    urgent = client.submit({"prompt": "x", "service_class": "priority", "priority": 2})
    flex = client.submit({"prompt": "x", "service_class": "batch", "tenant": "team@a.example"})
    batch = client.create_batch(['{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "y"}}'],
                                owner="key-0123")
    assert fake_redis.lrange(f"rq:queue:{BASE}", 0, -1) == [interactive.encode()]
    assert fake_redis.lrange(f"rq:queue:{BASE}.priority.p2", 0, -1) == [urgent.encode()]
    assert fake_redis.lrange(f"rq:queue:{class_queue(BASE, BATCH, 0, 'team@a.example')}", 0, -1) == [flex.encode()]
    assert fake_redis.lrange(f"rq:queue:{BASE}.batch-key-0123", 0, -1) == [keys.batch_job_id(batch.id, 0).encode()]
    registered = {m.decode() for m in fake_redis.smembers(keys.class_queues_key(BASE))}
    assert registered == {f"{BASE}.priority.p2", class_queue(BASE, BATCH, 0, "team@a.example"), f"{BASE}.batch-key-0123"}


# ----- the pick -----
def test_the_pick_takes_the_most_urgent_class_first_and_batch_only_into_free_slots(fake_redis):
    picker = Picker(fake_redis)
    push(fake_redis, class_queue(BASE, BATCH, 0, "a"), ["b1", "b2", "b3"])
    push(fake_redis, BASE, ["i1"])
    push(fake_redis, f"{BASE}.priority", ["p1"])
    rows = candidates(["a"], [(f"{BASE}.priority", 0), (BASE, 1000)])
    lengths, taken = picker.pick(rows, free=0, extra=5)  # no free slot: only work that may preempt batch work
    assert lengths == [1, 1, 3] and [job for _, job in taken] == ["p1", "i1"]
    assert fake_redis.lrange(f"rq:intermediate:{BASE}", 0, -1) == [b"i1"]  # taken as RQ's reliable dequeue takes
    push(fake_redis, BASE, ["i2"])
    _, taken = picker.pick(rows, free=2, extra=0, batch_first=1)  # the batch class's minimum share goes first
    assert [job for _, job in taken] == ["b1", "i2"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(costs=st.lists(st.lists(st.tuples(st.integers(1, 300), st.integers(1, 200)), min_size=5, max_size=40),
                      min_size=2, max_size=4),
       late=st.integers(0, 30), idle_credit=st.integers(0, 50_000))
def test_over_any_window_a_backlogged_tenant_gets_its_share_less_a_request(fake_redis, costs, late, idle_credit):
    """VTC's guarantee, checked on the real script: every tenant with waiting work is served, from the moment it
    has work, at least an equal share of what was served less one request's cost (less two over a window that
    starts anywhere). The last tenant joins `late` picks in, after idle time that banks no credit."""
    fake_redis.flushall()
    picker = Picker(fake_redis)
    tenants = [f"t{i}" for i in range(len(costs))]
    jobs = {}
    for t, tenant_costs in zip(tenants, costs):
        jobs.update({f"{t}-{j}": c for j, c in enumerate(tenant_costs)})
    fake_redis.hset(keys.fairness_key(BASE, BATCH), tenants[-1], -idle_credit)  # served long ago: no credit kept
    for t, tenant_costs in zip(tenants[:-1], costs):
        push(fake_redis, class_queue(BASE, BATCH, 0, t), [f"{t}-{j}" for j in range(len(tenant_costs))])
    rows = candidates(tenants)
    served: list[tuple[str, float]] = []  # (tenant, cost) in pick order
    joined_at = None
    largest = max(cost(*c) for cs in costs for c in cs)
    late = min(late, sum(len(c) for c in costs[:-1]) - 1)
    while True:
        if len(served) == late and joined_at is None:
            joined_at = len(served)
            push(fake_redis, class_queue(BASE, BATCH, 0, tenants[-1]), [f"{tenants[-1]}-{j}" for j in range(len(costs[-1]))])
        _, taken = picker.pick(rows, free=1)
        if not taken:
            break
        _, job = taken[0]
        tenant = job.rsplit("-", 1)[0]
        end(fake_redis, class_queue(BASE, BATCH, 0, tenant), *jobs[job])
        served.append((tenant, cost(*jobs[job])))
    remaining = {t: len(c) for t, c in zip(tenants, costs)}
    backlog_ends = {}  # the pick after which each tenant had nothing left waiting
    for i, (tenant, _) in enumerate(served):
        remaining[tenant] -= 1
        if remaining[tenant] == 0:
            backlog_ends[tenant] = i
    prefix = {t: [0.0] for t in tenants}  # service received by each tenant in the first n picks
    for tenant, c in served:
        for t in tenants:
            prefix[t].append(prefix[t][-1] + (c if t == tenant else 0.0))
    for start in range(len(served)):
        for stop in range(start + 1, len(served) + 1):
            active = [t for t in tenants if (t != tenants[-1] or start >= joined_at) and backlog_ends[t] >= stop - 1]
            if len(active) < 2:
                continue
            got = {t: prefix[t][stop] - prefix[t][start] for t in active}
            slack = largest if start == 0 else 2 * largest
            for t in active:
                assert got[t] >= sum(got.values()) / len(active) - slack, (t, start, stop, got)


def test_two_pickers_at_once_share_one_counter_and_take_each_job_once():
    url, redis = claim_database()
    try:
        pushed = {t: [f"{t}-{j}" for j in range(60)] for t in ("a", "b")}
        for t, ids in pushed.items():
            push(redis, class_queue(BASE, BATCH, 0, t), ids)
        rows = candidates(["a", "b"])
        taken: list[str] = []

        def worker():
            picker = Picker(redis.__class__.from_url(url))
            while True:
                _, got = picker.pick(rows, free=4)
                if not got:
                    return
                taken.extend(job for _, job in got)

        threads = [threading.Thread(target=worker) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(taken) == sorted(pushed["a"] + pushed["b"])
        counters = fairness.served(redis, BASE, BATCH)
        assert counters == {"a": 60 * fairness.PICK_CHARGE, "b": 60 * fairness.PICK_CHARGE}
        first_half = taken[:60]  # the advance charged at the pick alternates the tenants across both pickers
        assert abs(sum(job.startswith("a-") for job in first_half) - 30) <= 8
    finally:
        release_database(redis)
