"""Contracts shared by two components, each written once: the worker stats hash and the Redis backoff."""

import time

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from batcher import keys
from batcher.redis_retry import FIRST_DELAY_S, MAX_DELAY_S, Backoff, retry_while_unreachable
from batcher.worker_stats import WorkerStats
from tests.jobs_support import fake_redis_fixture  # noqa: F401

STATS = WorkerStats(name="w1", host="h", pid=42, queues="a,b", model="m", state="busy", in_flight=3,
                    free_slots=5, kv_usage=0.25, tokens_per_s=12.5, last_heartbeat=1700000000.5, dtype="bfloat16",
                    prefix_cache_hit_rate=0.875)


def test_worker_stats_survive_a_round_trip_through_a_redis_hash(fake_redis):
    key = keys.worker_stats_key(STATS.name)
    fake_redis.hset(key, mapping=STATS.to_dict())
    assert WorkerStats.from_hash(fake_redis.hgetall(key)) == STATS
    fake_redis.hset(key, "added_by_a_newer_worker", "x")
    assert WorkerStats.from_hash(fake_redis.hgetall(key)) == STATS
    fake_redis.hdel(key, "dtype")  # a worker from before dtypes were published
    assert WorkerStats.from_hash(fake_redis.hgetall(key)).dtype == "unknown"
    fake_redis.hdel(key, "prefix_cache_hit_rate")  # a worker from before prefix caching
    assert WorkerStats.from_hash(fake_redis.hgetall(key)).prefix_cache_hit_rate == 0.0


def test_backoff_doubles_up_to_its_cap_and_resets():
    backoff = Backoff()
    delays = [backoff.next() for _ in range(8)]
    assert delays[0] == FIRST_DELAY_S and delays == sorted(delays) and delays[-1] == MAX_DELAY_S
    backoff.reset()
    assert backoff.next() == FIRST_DELAY_S


def test_retry_while_unreachable_retries_then_gives_up_at_the_deadline(monkeypatch):
    monkeypatch.setattr(time, "sleep", lambda s: None)
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise RedisConnectionError("down")
        return "up"

    assert retry_while_unreachable(flaky) == "up" and len(calls) == 3

    def down():
        raise RedisConnectionError("down")

    with pytest.raises(RedisConnectionError):
        retry_while_unreachable(down, deadline=time.monotonic())
