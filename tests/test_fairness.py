"""Service classes and the fair pick (batcher/service_class.py, batcher/jobs/fairness.py) on a Redis with Lua.

The pick is run on fakeredis (the demo's embedded Redis, which runs the same Lua) and, for the test of two
pickers at once, on the real Redis. A simulated job ends right after it is picked, charging its real cost."""

from __future__ import annotations

import threading
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rqbatcher.client import Client
from rqbatcher.jobs import fairness, keys
from rqbatcher.jobs.fairness import Candidate, Picker, charge_on, cost
from rqbatcher.jobs.queues import class_queue, parse_queue, tenant_token
from rqbatcher.schema import GenerationRequest
from rqbatcher.service_class import BATCH, INTERACTIVE, PRIORITY, RANK, class_of, urgency_of
from tests.jobs_support import claim_database, fake_redis_fixture, release_database  # noqa: F401

BASE = "fair"


def candidates(tenants: list[str], extra: list[tuple[str, int]] = ()) -> list[Candidate]:
    """Batch queues of `tenants` in one group, after `extra` non-batch (queue, group) pairs."""
    rows = [candidate(name, group) for name, group in extra]
    return rows + [candidate(class_queue(BASE, BATCH, 0, tenant), RANK[BATCH] * 1000) for tenant in tenants]


def candidate(name: str, group: int) -> Candidate:
    parsed = parse_queue(name)
    return Candidate(f"rq:queue:{name}", f"rq:intermediate:{name}", keys.fairness_key(BASE, parsed.service_class),
                     keys.job_tenants_key(BASE), keys.due_key(name), keys.waiting_tenants_key(name), group,
                     parsed.service_class == BATCH,
                     parsed.tenant or "-", parsed.service_class == INTERACTIVE)


def push(redis, queue: str, job_ids: list[str]) -> None:
    if job_ids:
        redis.rpush(f"rq:queue:{queue}", *job_ids)


def enqueue_shared(redis, queue: str, job_ids: list[str]) -> None:
    """Jobs in a shared queue as the enqueue leaves them: a job "<tenant>-<n>" names its tenant, "rq-<n>" none."""
    push(redis, queue, job_ids)
    tenants = [job.rsplit("-", 1)[0] for job in job_ids]
    with redis.pipeline() as pipe:
        fairness.note_on(pipe, BASE, [(queue, GenerationRequest(prompt="x", tenant=None if t == "rq" else t), job)
                                      for t, job in zip(tenants, job_ids)], 3600)
        pipe.execute()


def end(redis, queue: str, tenant: str, prompt: int, generated: int) -> None:
    with redis.pipeline() as pipe:
        pipe.multi()
        charge_on(pipe, queue, tenant, prompt, generated)
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
    if service_class == INTERACTIVE:  # the queue a plain-RQ producer enqueues to
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
    assert registered == {f"{BASE}.priority.p2", class_queue(BASE, BATCH, 0, "team@a.example"),
                          f"{BASE}.batch-key-0123"}


# ----- the pick -----
def test_the_pick_takes_the_most_urgent_class_first_and_batch_only_into_free_slots(fake_redis):
    picker = Picker(fake_redis)
    push(fake_redis, class_queue(BASE, BATCH, 0, "a"), ["b1", "b2", "b3"])
    push(fake_redis, BASE, ["i1"])
    push(fake_redis, f"{BASE}.priority", ["p1"])
    rows = candidates(["a"], [(f"{BASE}.priority", 0), (BASE, 1000)])
    lengths, taken = picker.pick(rows, free=0, extra=5)  # no free slot: only work that may preempt batch work
    assert lengths == [1, 1, 3] and [job for _, job, _ in taken] == ["p1", "i1"]
    assert fake_redis.lrange(f"rq:intermediate:{BASE}", 0, -1) == [b"i1"]  # taken as RQ's reliable dequeue takes
    push(fake_redis, BASE, ["i2"])
    _, taken = picker.pick(rows, free=2, extra=0, batch_first=1)  # the batch class's minimum share goes first
    assert [job for _, job, _ in taken] == ["b1", "i2"]


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
            push(fake_redis, class_queue(BASE, BATCH, 0, tenants[-1]),
                 [f"{tenants[-1]}-{j}" for j in range(len(costs[-1]))])
        _, taken = picker.pick(rows, free=1)
        if not taken:
            break
        _, job, charged = taken[0]
        tenant = job.rsplit("-", 1)[0]
        assert charged == tenant
        end(fake_redis, class_queue(BASE, BATCH, 0, tenant), tenant, *jobs[job])
        served.append((tenant, cost(*jobs[job])))
    assert_fair_share(served, tenants, {t: len(c) for t, c in zip(tenants, costs)}, {tenants[-1]: joined_at},
                      largest)


def assert_fair_share(served: list[tuple[str, float]], tenants: list[str], jobs: dict[str, int],
                      joined_at: dict[str, int], largest: float) -> None:
    """VTC's bound over every window of the pick order `served` [(tenant, cost)]: each tenant with work waiting
    throughout (from its `joined_at` pick, 0 by default, until its `jobs` are all taken) gets at least an equal
    share of the window's service less `largest` (less twice that for a window that starts later)."""
    remaining = dict(jobs)
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
            active = [t for t in tenants if start >= joined_at.get(t, 0) and backlog_ends[t] >= stop - 1]
            if len(active) < 2:
                continue
            got = {t: prefix[t][stop] - prefix[t][start] for t in active}
            slack = largest if start == 0 else 2 * largest
            for t in active:
                assert got[t] >= sum(got.values()) / len(active) - slack, (t, start, stop, got)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flood=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 200)), min_size=3, max_size=150),
       others=st.lists(st.lists(st.tuples(st.integers(1, 300), st.integers(1, 200)), min_size=3, max_size=15),
                       min_size=1, max_size=3),
       order=st.randoms(use_true_random=False))
def test_interactive_tenants_sharing_one_queue_get_their_share_whatever_the_arrival_order(fake_redis, flood, others,
                                                                                         order):
    """Chat requests of all tenants wait in one queue (the one plain-RQ producers use): the pick takes the oldest
    job of the least served tenant however deep it waits, so a tenant that sent first and most does not hold back
    the others. Tenant t0 floods the queue first (up to 150 jobs); the others' arrive after, in any interleaving."""
    fake_redis.flushall()
    costs = [flood] + others
    picker = Picker(fake_redis)
    tenants = [f"t{i}" for i in range(len(costs))]
    jobs = {f"{t}-{j}": c for t, tenant_costs in zip(tenants, costs) for j, c in enumerate(tenant_costs)}
    slots = [t for t, tenant_costs in zip(tenants[1:], costs[1:]) for _ in tenant_costs]
    order.shuffle(slots)
    sent = Counter()
    arrival = [f"t0-{j}" for j in range(len(costs[0]))]
    for t in slots:  # each tenant's own jobs in their order
        arrival.append(f"{t}-{sent[t]}")
        sent[t] += 1
    enqueue_shared(fake_redis, BASE, arrival)
    rows = [candidate(BASE, 0)]
    served: list[tuple[str, float]] = []
    while True:
        _, taken = picker.pick(rows, free=1)
        if not taken:
            break
        _, job, charged = taken[0]
        assert charged == job.rsplit("-", 1)[0]
        end(fake_redis, BASE, charged, *jobs[job])
        served.append((charged, cost(*jobs[job])))
    assert len(served) == len(jobs)
    assert not fake_redis.exists(keys.job_tenants_key(BASE)), "a job's tenant is forgotten once it is taken"
    assert not any(fake_redis.llen(keys.waiting_tenants_key(BASE, t)) for t in tenants)
    largest = max(cost(*c) for c in jobs.values())
    assert_fair_share(served, tenants, {t: len(c) for t, c in zip(tenants, costs)}, {}, largest)


def test_a_job_that_names_no_tenant_is_served_as_one_more_tenant(fake_redis):
    """Plain-RQ producers name no tenant: their jobs share one counter, fairly against named tenants."""
    picker = Picker(fake_redis)
    enqueue_shared(fake_redis, BASE, ["a-0", "a-1", "a-2", "rq-0", "rq-1"])
    _, taken = picker.pick([candidate(BASE, 0)], free=4)
    assert [(job, tenant) for _, job, tenant in taken] == [("a-0", "a"), ("rq-0", "-"), ("a-1", "a"), ("rq-1", "-")]
    assert fake_redis.lrange(f"rq:intermediate:{BASE}", 0, -1) == [b"a-0", b"rq-0", b"a-1", b"rq-1"]
    assert fake_redis.lrange(f"rq:queue:{BASE}", 0, -1) == [b"a-2"]


def test_the_fair_room_takes_the_least_served_interactive_job_of_a_tenant_holding_no_slot(fake_redis):
    """A worker whose slots are all held (no free slot) takes, for the engine's fair room, a job of a tenant that
    holds none of them, never one of a tenant that does, and never batch work."""
    picker = Picker(fake_redis)
    batch = class_queue(BASE, BATCH, 0, "c")
    push(fake_redis, batch, ["c-0"])
    enqueue_shared(fake_redis, BASE, [f"a-{i}" for i in range(5)] + ["b-0", "rq-0"])
    rows = [candidate(BASE, 0), candidate(batch, RANK[BATCH] * 1000)]
    end(fake_redis, BASE, "-", 0, 500)  # the plain-RQ producer was served more than b
    _, taken = picker.pick(rows, free=0, fair_extra=1, holding=frozenset({"a"}))
    assert [(job, tenant) for _, job, tenant in taken] == [("b-0", "b")]
    _, taken = picker.pick(rows, free=0, fair_extra=2, holding=frozenset({"a", "b", "-"}))
    assert taken == [], "every waiting interactive tenant holds a slot; batch work never takes the fair room"
    _, taken = picker.pick(rows, free=0, fair_extra=2, holding=frozenset({"a", "b"}))
    assert [job for _, job, _ in taken] == ["rq-0"]
    assert fake_redis.llen(f"rq:queue:{BASE}") == 5 and fake_redis.llen(f"rq:queue:{batch}") == 1


def test_a_tenants_job_deep_behind_anothers_flood_is_taken_at_once_and_gone_jobs_are_skipped(fake_redis):
    picker, rows = Picker(fake_redis), [candidate(BASE, 0)]
    enqueue_shared(fake_redis, BASE, [f"a-{i}" for i in range(500)])
    _, taken = picker.pick(rows, free=4)
    assert [job for _, job, _ in taken] == ["a-0", "a-1", "a-2", "a-3"]
    enqueue_shared(fake_redis, BASE, ["b-0"])  # 497 of a's jobs ahead of it
    fake_redis.lrem(f"rq:queue:{BASE}", 1, "a-4")  # deleted from the queue behind the pick's back (`rq empty`...)
    _, taken = picker.pick(rows, free=2)
    assert [job for _, job, _ in taken] == ["b-0", "a-5"]
    assert fake_redis.llen(f"rq:queue:{BASE}") == 494 and fake_redis.llen(keys.waiting_tenants_key(BASE, "a")) == 494


def test_a_batch_line_whose_window_closes_soon_is_taken_first_and_as_urgent_work(fake_redis):
    picker = Picker(fake_redis)
    now = 1_000_000.0
    a, b = class_queue(BASE, BATCH, 0, "a"), class_queue(BASE, BATCH, 0, "b")
    push(fake_redis, a, ["a-0", "a-1"])
    push(fake_redis, b, ["b-0", "b-1", "b-2"])
    fake_redis.zadd(keys.due_key(a), {"a-0": now + 20 * 3600, "a-1": now + 20 * 3600})
    fake_redis.zadd(keys.due_key(b), {"b-0": now + 60, "b-1": now + 60, "b-2": now + 20 * 3600})
    fake_redis.hset(keys.fairness_key(BASE, BATCH), mapping={"a": 0, "b": 10_000})  # b was served far more
    rows = candidates(["a", "b"])
    _, taken = picker.pick(rows, free=0, extra=1, now=now)  # due: it may take a slot from batch work
    assert [job for _, job, _ in taken] == ["b-0"]
    fake_redis.lrem(f"rq:queue:{b}", 1, "b-1")  # b-1 is gone (its batch was swept): a stale due entry
    _, taken = picker.pick(rows, free=2, now=now)
    assert [job for _, job, _ in taken] == ["a-0", "a-1"], "nothing due is left: the least served tenant again"
    assert fake_redis.zcard(keys.due_key(b)) == 1 and fake_redis.zcard(keys.due_key(a)) == 0
    _, taken = picker.pick(rows, free=0, extra=1, now=now)
    assert taken == [], "a line not due waits for a free slot"
    _, taken = picker.pick(rows, free=1, now=now + 20 * 3600)  # later, b-2's window nears its end too
    assert [job for _, job, _ in taken] == ["b-2"]


def test_the_enqueue_notes_a_shared_jobs_tenant_and_a_batch_lines_deadline(fake_redis):
    client = Client(fake_redis, queue=BASE)
    chat = client.submit({"prompt": "x", "tenant": "team@a.example"})
    anonymous = client.submit("y")
    batch = client.create_batch(['{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "y"}}'],
                                owner="key-0123")
    noted = fake_redis.hgetall(keys.job_tenants_key(BASE))
    assert noted == {chat.encode(): tenant_token("team@a.example").encode()} and anonymous.encode() not in noted
    assert fake_redis.lrange(keys.waiting_tenants_key(BASE, tenant_token("team@a.example")), 0, -1) == [chat.encode()]
    line = keys.batch_job_id(batch.id, 0)
    assert fake_redis.zscore(keys.due_key(f"{BASE}.batch-key-0123"), line) == batch.expires_at
    assert fake_redis.ttl(keys.job_tenants_key(BASE)) > 0 and fake_redis.ttl(keys.due_key(f"{BASE}.batch-key-0123")) > 0
    assert client.cancel(chat) and not fake_redis.hexists(keys.job_tenants_key(BASE), chat), "a cancel forgets it"


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
                taken.extend(job for _, job, _ in got)

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
