"""The Batch API's parity fields in the core, on fakeredis (with Lua): the batch's `usage`, the expiry of its output
files (`output_expires_after`) and the webhook outbox event each batch end pushes in the step that ends it."""

from __future__ import annotations

import base64
import json
import struct
import time

import pytest
from rq.job import Job
from rq.serializers import JSONSerializer

from rqbatcher.batches import store
from rqbatcher.batches.batch_object import BatchInputError, parse_output_expiry
from rqbatcher.batches.lines import record_outcome_on
from rqbatcher.client import Client
from rqbatcher.jobs import keys
from rqbatcher.jobs.life import decode_request
from rqbatcher.openai.embeddings_body import EMBEDDINGS_URL
from rqbatcher.openai.responses.responses_body import RESPONSES_URL
from rqbatcher.schema import GenerationResult, Usage
from rqbatcher.service_class import BATCH
from rqbatcher.webhooks.event_payload import from_outbox_entry
from tests.jobs_support import fake_redis_fixture  # noqa: F401
from tests.test_batches import batch_lines, line

HOUR = 3600


def finish(client: Client, job_id: str, status: str = "finished", prompt_tokens: int = 5, cached: int = 2,
           completion_tokens: int = 3, finish_reason: str = "length", embeddings: list[str] | None = None) -> None:
    """Record a job's end as the worker does, in one transaction, with the given usage."""
    job = Job.fetch(job_id, connection=client.connection, serializer=JSONSerializer)
    result = GenerationResult(text="ok", token_ids=[1] * completion_tokens, finish_reason=finish_reason,
                              usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                          cached_tokens=cached), embeddings=embeddings)
    with client.connection.pipeline() as pipe:
        pipe.multi()
        record_outcome_on(pipe, job_id=job_id, queue=job.origin, status=status, request=decode_request(job),
                          result=result if status != "failed" else None, reason="boom")
        pipe.execute()


def outbox(connection) -> list[dict]:
    return [json.loads(e) for e in connection.lrange(keys.WEBHOOK_OUTBOX, 0, -1)]


def test_usage_sums_the_output_lines_once_each_through_retries(fake_redis):
    client = Client(fake_redis)
    batch = client.create_batch(batch_lines(4, bad=(3,)))
    assert client.batch(batch.id).usage.model_dump() == {
        "input_tokens": 0, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 0,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 0}
    finish(client, keys.batch_job_id(batch.id, 0), prompt_tokens=7, cached=4, completion_tokens=2)
    finish(client, keys.batch_job_id(batch.id, 0), prompt_tokens=7, cached=0, completion_tokens=9)  # a retry
    finish(client, keys.batch_job_id(batch.id, 1), prompt_tokens=5, cached=0, completion_tokens=3)
    finish(client, keys.batch_job_id(batch.id, 2), "failed")  # a failed line bills nothing, as at OpenAI
    done = client.batch(batch.id)
    assert done.status == "completed"
    assert done.usage.model_dump() == {
        "input_tokens": 12, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 5,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 17}
    lines = [json.loads(x)["response"]["body"]["usage"] for x in client.batch_output(batch.id)]
    assert sum(u["prompt_tokens"] for u in lines) == 12 and sum(u["completion_tokens"] for u in lines) == 5


def test_each_batch_end_pushes_exactly_one_outbox_event(fake_redis, monkeypatch):
    dispatches = []
    monkeypatch.setattr(store, "dispatch_after", lambda connection, what: dispatches.append(connection))  # keep them
    client = Client(fake_redis)
    completed = client.create_batch(batch_lines(2), owner="tenant-a")
    for i in range(2):
        finish(client, keys.batch_job_id(completed.id, i))
    finish(client, keys.batch_job_id(completed.id, 1))  # a repeated end: no second event
    cancelled = client.create_batch(batch_lines(2))
    client.cancel_batch(cancelled.id)
    client.cancel_batch(cancelled.id)
    failed = client.create_batch(batch_lines(2, bad=(0, 1)))
    expired = client.create_batch(batch_lines(2), completion_window="1s")
    time.sleep(1.1)
    assert client.batch(expired.id).status == "expired"
    client.batch(expired.id)
    events = outbox(fake_redis)
    assert [(e["type"], e["id"], e["tenant"]) for e in events] == [
        ("batch.completed", completed.id, "tenant-a"), ("batch.cancelled", cancelled.id, None),
        ("batch.failed", failed.id, None), ("batch.expired", expired.id, None)]
    assert all(isinstance(e["created_at"], int) and abs(e["created_at"] - time.time()) < 5 for e in events)
    assert set(events[0]) == {"type", "id", "tenant", "created_at"}
    assert dispatches and set(dispatches) == {fake_redis}  # each transition's caller dispatched the outbox
    for event in events:
        assert from_outbox_entry(json.dumps(event))[1] == event["tenant"]  # what the delivery side reads


def test_output_files_expire_after_the_batch_ends_as_asked_and_nothing_counts_after(fake_redis):
    client = Client(fake_redis)
    long_kept = client.create_batch(batch_lines(1), output_expires_s=30 * 86400)
    assert fake_redis.ttl(keys.batch_key(long_kept.id)) > 31 * 86400  # the batch outlives its window and files
    batch = client.create_batch(batch_lines(2), output_expires_s=2 * HOUR)
    for i in range(2):
        finish(client, keys.batch_job_id(batch.id, i))
    done = client.batch(batch.id)
    assert done.output_expires_at == done.completed_at + 2 * HOUR
    assert abs(fake_redis.ttl(keys.batch_lines_key(batch.id)) - 2 * HOUR) <= 2
    fake_redis.hset(keys.batch_key(batch.id), "output_expires_at", int(time.time()) - 1)
    fake_redis.delete(keys.batch_lines_key(batch.id))  # as the TTL would
    finish(client, keys.batch_job_id(batch.id, 1))  # a very late repeat: the lines are gone, it counts nothing
    assert client.batch(batch.id).request_counts.completed == 2 and not fake_redis.exists(
        keys.batch_lines_key(batch.id))


def test_a_batch_without_an_output_expiry_keeps_its_files_as_long_as_itself(fake_redis):
    client = Client(fake_redis)
    batch = client.create_batch(batch_lines(1))
    finish(client, keys.batch_job_id(batch.id, 0))
    done = client.batch(batch.id)
    assert abs(done.output_expires_at - (time.time() + fake_redis.ttl(keys.batch_key(batch.id)))) <= 2
    assert abs(fake_redis.ttl(keys.batch_lines_key(batch.id)) - fake_redis.ttl(keys.batch_key(batch.id))) <= 2


@pytest.mark.parametrize("value", [{"anchor": "last_active_at", "seconds": HOUR},
                                   {"anchor": "created_at", "seconds": HOUR - 1},
                                   {"anchor": "created_at", "seconds": 30 * 86400 + 1},
                                   {"anchor": "created_at", "seconds": "3600"}, {"anchor": "created_at"},
                                   {"anchor": "created_at", "seconds": HOUR, "extra": 1}, "1h"])
def test_a_bad_output_expiry_is_refused(fake_redis, value):
    with pytest.raises(BatchInputError, match="output_expires_after"):
        parse_output_expiry(value)
    assert parse_output_expiry({"anchor": "created_at", "seconds": HOUR}) == HOUR
    with pytest.raises(BatchInputError, match="output_expires_after"):
        Client(fake_redis).create_batch(batch_lines(1), output_expires_s=60)


def test_responses_and_embeddings_lines_run_in_the_batch_class_and_answer_their_endpoints_objects(fake_redis):
    client = Client(fake_redis)
    ask = {"model": "m", "input": "Say hi", "instructions": "Be brief", "max_output_tokens": 2}
    responses = client.create_batch([line(i, RESPONSES_URL, **ask) for i in range(2)])
    assert responses.endpoint == RESPONSES_URL and responses.request_counts.failed == 0
    request = decode_request(Job.fetch(keys.batch_job_id(responses.id, 0), connection=fake_redis,
                                       serializer=JSONSerializer))
    assert (request.batch.url, request.service_class, request.messages[0].role) == (RESPONSES_URL, BATCH, "system")
    finish(client, keys.batch_job_id(responses.id, 0), finish_reason="length")
    finish(client, keys.batch_job_id(responses.id, 1), finish_reason="stop")
    bodies = [json.loads(x)["response"]["body"] for x in client.batch_output(responses.id)]
    assert [(b["object"], b["status"], b["output"][0]["content"][0]["text"]) for b in bodies] == [
        ("response", "incomplete", "ok"), ("response", "completed", "ok")]
    assert bodies[0]["id"] == f"resp_{keys.batch_job_id(responses.id, 0)}" and bodies[0]["usage"]["output_tokens"] == 3

    vector = base64.b64encode(struct.pack("<3f", 0.5, -0.25, 1.0)).decode()
    embeddings = client.create_batch([line(0, EMBEDDINGS_URL, model="m", input=["a", "b"]),
                                      line(1, EMBEDDINGS_URL, model="m", input="c", encoding_format="base64")])
    assert embeddings.request_counts.model_dump() == {"total": 2, "completed": 0, "failed": 0}
    finish(client, keys.batch_job_id(embeddings.id, 0), completion_tokens=0, embeddings=[vector, vector])
    finish(client, keys.batch_job_id(embeddings.id, 1), completion_tokens=0, embeddings=[vector])
    done = client.batch(embeddings.id)
    assert done.status == "completed" and done.usage.input_tokens == 10 and done.usage.output_tokens == 0
    floats, encoded = [json.loads(x)["response"]["body"] for x in client.batch_output(embeddings.id)]
    assert floats["object"] == "list" and [d["embedding"] for d in floats["data"]] == [[0.5, -0.25, 1.0]] * 2
    assert [d["embedding"] for d in encoded["data"]] == [vector]  # the line's encoding_format, honoured
