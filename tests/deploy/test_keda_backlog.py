"""KEDA counts every queue the code can put a job of the worker pool in (deploy/k8s/keda-scaledobject.yaml).

The queue names come from the code (rqbatcher.jobs.keys, rqbatcher.jobs.queues). The triggers are then run as KEDA's
redis scaler runs them, against the real Redis: its own Lua script (a list's LLEN, a sorted set's ZCARD, ...), a
trigger active when its count passes activationListLength (0 by default), and the HPA's AverageValue target over the
formula's sum. A pool at 0 replicas scales up for a batch backlog, a priority one and a model one, and the batch
backlog empties as the jobs start or are cancelled."""

from __future__ import annotations

import math

import pytest
from rq import Queue

from rqbatcher.client import Client
from rqbatcher.jobs import keys
from rqbatcher.jobs.contract import JOB_FUNCTION
from rqbatcher.jobs.queues import backlog_key, class_queue, parse_queue
from rqbatcher.jobs.rq_adapter import rq_queue
from rqbatcher.schema import GenerationRequest
from rqbatcher.service_class import BATCH, CLASSES, PRIORITY
from rqbatcher.workers.job_worker.worker import JobWorker
from tests.deploy.deploy_files import flag
from tests.fake_engine import FakeEngine
from tests.jobs_support import claim_database, release_database

RQ_PREFIX = Queue.redis_queue_namespace_prefix  # RQ's list key: rq:queue:<name>
TENANTS = ("acme", "a tenant@example.com", None)  # a plain token, one that needs a slug and a hash, and none
# What KEDA's redis scaler runs for a trigger's listName (pkg/scalers/redis_scaler.go, KEDA 2.x)
KEDA_LENGTH_LUA = """
local listName = KEYS[1]
local listType = redis.call('type', listName).ok
local cmd = {zset = 'zcard', set = 'scard', list = 'llen', hash = 'hlen', none = 'llen'}
return redis.call(cmd[listType], listName)
"""


@pytest.fixture(scope="module")
def scaled(k8s) -> dict:
    return k8s["ScaledObject", "worker"]["spec"]


@pytest.fixture(scope="module")
def pool(worker_container) -> tuple[str, str]:
    """(base queue, model) of the worker Deployment."""
    return flag(worker_container["args"], "--queue"), flag(worker_container["args"], "--model")


def counted_key(rq_queue_name: str) -> str:
    """The key that counts a job waiting in an RQ queue: the list itself where its name is fixed, the routed queue's
    backlog for a batch queue (one per tenant)."""
    parsed = parse_queue(rq_queue_name)
    return backlog_key(parsed.routed) if parsed.service_class == BATCH else RQ_PREFIX + rq_queue_name


def test_every_queue_the_code_can_put_a_pool_job_in_is_counted(scaled, pool):
    base, model = pool
    listed = {t["metadata"]["listName"] for t in scaled["triggers"]}
    for routed in (keys.model_queue(base, model), base):
        for service_class in CLASSES:
            for level in range(keys.NUM_PRIORITIES):
                for tenant in TENANTS:
                    name = class_queue(routed, service_class, level, tenant)
                    assert counted_key(name) in listed, f"{name} ({service_class}) is not counted"
    # the worker's own queues, as it polls them, are all among them
    assert {RQ_PREFIX + q for q in keys.priority_queue_names([base], model)} <= listed


def test_the_triggers_are_summed_and_count_each_key_once(scaled, kustomization):
    triggers = scaled["triggers"]
    assert {t["type"] for t in triggers} == {"redis"}
    assert len({t["metadata"]["listName"] for t in triggers}) == len(triggers)
    for trigger in triggers:
        assert trigger["metadata"]["address"] == f"redis.{kustomization['namespace']}.svc:6379"
        assert trigger["metadata"]["listLength"] == scaled["advanced"]["scalingModifiers"]["target"]
    assert sorted(scaled["advanced"]["scalingModifiers"]["formula"].split(" + ")) == sorted(t["name"] for t in triggers)
    assert scaled["advanced"]["scalingModifiers"]["metricType"] == "AverageValue"


def keda_scale(redis, scaled) -> tuple[bool, int]:
    """(whether KEDA activates the pool from 0 replicas, the replicas the HPA then asks for), as KEDA computes them
    from the triggers on this Redis."""
    script = redis.register_script(KEDA_LENGTH_LUA)
    counts = {t["name"]: int(script(keys=[t["metadata"]["listName"]])) for t in scaled["triggers"]}
    active = any(counts[t["name"]] > int(t["metadata"].get("activationListLength", 0)) for t in scaled["triggers"])
    target = float(scaled["advanced"]["scalingModifiers"]["target"])
    return active, math.ceil(sum(counts.values()) / target)


@pytest.fixture
def redis():
    _, connection = claim_database()
    yield connection
    release_database(connection)


def test_a_pool_at_zero_scales_up_for_a_batch_a_priority_and_a_model_backlog(redis, scaled, pool):
    base, model = pool
    client = Client(redis, queue=base)
    assert keda_scale(redis, scaled) == (False, 0)
    lines = [GenerationRequest(prompt="hi", model=model, service_class=BATCH, tenant=f"tenant-{i % 3}", priority=i % 2)
             for i in range(40)]
    client.submit_many(lines)
    assert keda_scale(redis, scaled) == (True, 2)  # 40 lines of three tenants: two workers of 32 slots
    redis.flushdb()
    client.submit(GenerationRequest(prompt="hi", service_class=PRIORITY, priority=4))
    assert keda_scale(redis, scaled) == (True, 1)
    redis.flushdb()
    client.submit(GenerationRequest(prompt="hi", model=model))
    assert keda_scale(redis, scaled) == (True, 1)
    redis.flushdb()
    rq_queue(keys.queue_name(base, 3), redis).enqueue(JOB_FUNCTION, {"prompt": "hi"})  # a plain RQ producer's
    assert keda_scale(redis, scaled) == (True, 1)


def test_the_batch_backlog_empties_as_its_lines_start_or_are_cancelled(redis, scaled, pool):
    base, model = pool
    client = Client(redis, queue=base)
    started = client.submit_many([GenerationRequest(prompt="hi", model=model, service_class=BATCH, tenant="acme")
                                  for _ in range(3)])
    cancelled = client.submit(GenerationRequest(prompt="hi", service_class=BATCH, tenant="other"))
    assert redis.zcard(backlog_key(keys.model_queue(base, model))) == 3 and redis.zcard(backlog_key(base)) == 1
    assert client.cancel(cancelled)
    assert keda_scale(redis, scaled) == (True, 1)
    JobWorker(keys.priority_queue_names([base], model), FakeEngine(), connection=redis,
              model_name=model).work(burst=True)
    assert all(client.result(job_id, timeout=10).text for job_id in started)
    assert keda_scale(redis, scaled) == (False, 0)


def test_a_worker_forced_to_stop_counts_the_batch_lines_it_requeues_again(redis, pool):
    base, model = pool
    backlog = backlog_key(keys.model_queue(base, model))
    lines = [GenerationRequest(prompt="hi", model=model, service_class=BATCH, tenant="acme",
                               sampling={"max_tokens": 8}) for _ in range(3)]
    Client(redis, queue=base).submit_many(lines)
    while_running: list[int] = []

    def force(worker, outputs):
        if worker.engine.step_index == 1:
            while_running.append(redis.zcard(backlog))
            worker.request_stop(None, None)
            worker.request_force_stop(None, None)

    JobWorker(keys.priority_queue_names([base], model), FakeEngine(max_num_seqs=2), connection=redis,
              model_name=model, on_step=force).work()
    assert while_running == [1]  # two started (the engine's two slots), one waited
    assert redis.zcard(backlog) == 3  # the two in flight went back to their queue, and count again
