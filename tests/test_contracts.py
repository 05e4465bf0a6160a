"""Contracts shared by two components, each written once: the worker stats hash, the Redis backoff, and what a
client of one release reads of a worker of the next."""

import json
import time

import pytest
from pydantic import ValidationError
from redis.exceptions import ConnectionError as RedisConnectionError

from rqbatcher.batches.batch_object import Batch
from rqbatcher.jobs import keys
from rqbatcher.jobs.redis_retry import FIRST_DELAY_S, MAX_DELAY_S, Backoff, retry_while_unreachable
from rqbatcher.jobs.worker_stats import WorkerStats
from rqbatcher.schema import GenerationRequest, GenerationResult, SamplingParams, StreamEvent
from tests.jobs_support import fake_redis_fixture  # noqa: F401

STATS = WorkerStats(name="w1", host="h", pid=42, queues="a,b", model="m", state="busy", in_flight=3,
                    free_slots=5, kv_usage=0.25, tokens_per_s=12.5, last_heartbeat=1700000000.5, dtype="bfloat16",
                    prefix_cache_hit_rate=0.875)


def test_worker_stats_survive_a_round_trip_through_a_redis_hash(fake_redis):
    key = keys.worker_stats_key(STATS.name)
    fake_redis.hset(key, mapping=STATS.to_dict())
    assert WorkerStats.from_hash(fake_redis.hgetall(key)) == STATS
    fake_redis.hdel(key, "dtype", "vocab_size")
    with pytest.raises(ValueError, match="^not a worker's stats: the hash lacks dtype, vocab_size$"):
        WorkerStats.from_hash(fake_redis.hgetall(key))


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


def test_what_clients_read_ignores_fields_a_newer_worker_adds_and_requests_stay_strict():
    """A rolling upgrade: workers of the next release write results, events and batches with fields this one does
    not know; this release's clients still read them. What producers send is still checked strictly."""
    newer = {"text": "hi", "token_ids": [1], "finish_reason": "stop", "reasoning": "a field of the future",
             "usage": {"prompt_tokens": 3, "completion_tokens": 1, "cached_tokens": 2, "reasoning_tokens": 0},
             "timings": {"queue_s": 0.1, "prefill_s": 0.2}}
    result = GenerationResult.model_validate(newer)
    assert (result.usage.cached_tokens, result.timings.queue_s) == (2, 0.1)
    event = StreamEvent.model_validate_json(json.dumps({"type": "token", "text": "a", "audio": "..."}))
    assert event.text == "a"
    batch = Batch.from_hash({"id": "batch_1", "endpoint": "/v1/completions", "completion_window": "24h",
                             "status": "in_progress", "created_at": "1", "expires_at": "2", "queue": "q",
                             "service_tier": "flex"})
    assert batch.status == "in_progress"
    assert Batch.model_validate(batch.model_dump() | {"service_tier": "flex"}) == batch
    with pytest.raises(ValidationError, match="extra"):
        GenerationRequest.model_validate({"prompt": "hi", "temprature": 0})
    with pytest.raises(ValidationError, match="extra"):
        SamplingParams.model_validate({"max_tokens": 3, "top_kk": 2})
