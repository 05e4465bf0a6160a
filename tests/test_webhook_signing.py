"""Webhooks without a network: signatures the `openai` SDK verifies, event ids and bodies, which addresses a delivery
may reach, the background-response event pushed by a job's end, and the dispatch of the outbox (fakeredis)."""

import json
import time

import fakeredis
import openai
import pytest
from rq import Queue
from rq.serializers import JSONSerializer

from rqbatcher.client import Client
from rqbatcher.jobs import keys
from rqbatcher.jobs.ends import announce_response_end_on
from rqbatcher.schema import GenerationRequest, GenerationResult
from rqbatcher.webhooks import endpoints
from rqbatcher.webhooks.addresses import RefusedAddress, is_public, split_url
from rqbatcher.webhooks.delivery import DELIVERY_QUEUE, RETRY_INTERVALS_S, delivery_job_id, retry_policy
from rqbatcher.webhooks.event_payload import encode, event_id, from_outbox_entry
from rqbatcher.webhooks.outbox import dispatch
from rqbatcher.webhooks.signing import new_secret, signed_headers


def entry(event_type="batch.completed", subject="batch_abc", tenant=None, created_at=1_700_000_000) -> str:
    return json.dumps({"type": event_type, "id": subject, "tenant": tenant, "created_at": created_at})


def test_the_openai_sdk_verifies_and_parses_a_signed_event():
    secret = new_secret()
    body, tenant = from_outbox_entry(entry(tenant="key-0123456789abcdef"))
    payload = encode(body)
    event = openai.OpenAI(api_key="x", webhook_secret=secret).webhooks.unwrap(
        payload, signed_headers(secret, body["id"], payload))
    assert (event.type, event.data.id, event.object, event.created_at) == (
        "batch.completed", "batch_abc", "event", 1_700_000_000)
    assert event.id == body["id"] == event_id("batch.completed", "batch_abc") and tenant == "key-0123456789abcdef"
    with pytest.raises(openai.InvalidWebhookSignatureError):  # another endpoint's secret
        openai.OpenAI(api_key="x").webhooks.unwrap(payload, signed_headers(secret, body["id"], payload),
                                                   secret=new_secret())
    with pytest.raises(openai.InvalidWebhookSignatureError):  # a replay, ten minutes late
        openai.OpenAI(api_key="x").webhooks.unwrap(
            payload, signed_headers(secret, body["id"], payload, now=time.time() - 600), secret=secret)


def test_an_event_id_is_the_same_for_one_end_and_differs_between_ends():
    assert event_id("batch.completed", "batch_a") == event_id("batch.completed", "batch_a")
    assert len({event_id("batch.completed", "batch_a"), event_id("batch.failed", "batch_a"),
                event_id("batch.completed", "batch_b")}) == 3
    assert event_id("response.completed", "resp_1").startswith("evt_")


@pytest.mark.parametrize("bad", ["[]", "not json", entry(event_type="batch.exploded"), entry(subject=""),
                                 entry(tenant=3), entry(created_at="now")])
def test_an_outbox_entry_that_is_not_an_event_is_refused(bad):
    with pytest.raises(ValueError):
        from_outbox_entry(bad)


@pytest.mark.parametrize("address,public", [
    ("93.184.216.34", True), ("2606:4700:4700::1111", True), ("::ffff:8.8.8.8", True),
    ("127.0.0.1", False), ("10.0.0.1", False), ("172.16.5.4", False), ("192.168.0.1", False),
    ("169.254.169.254", False), ("100.64.0.1", False), ("0.0.0.0", False), ("224.0.0.1", False),
    ("240.0.0.1", False), ("::1", False), ("::", False), ("fe80::1", False), ("fc00::1", False), ("ff02::1", False),
    ("::ffff:127.0.0.1", False), ("::ffff:10.0.0.1", False), ("2002:7f00:1::", False), ("fe80::1%eth0", False)])
def test_only_public_addresses_are_reachable(address, public):
    assert is_public(address) is public


@pytest.mark.parametrize("url", ["ftp://example.com/", "file:///etc/passwd", "http://", "https://u:p@example.com/",
                                 "gopher://example.com"])
def test_a_webhook_url_is_http_or_https_with_a_host_and_no_credentials(url):
    with pytest.raises(RefusedAddress):
        split_url(url)


def test_adding_a_private_address_needs_the_operators_flag():
    connection = fakeredis.FakeRedis()
    for url in ("http://127.0.0.1:9/hook", "http://[::1]/hook", "http://localhost/hook"):
        with pytest.raises(RefusedAddress):
            endpoints.add(connection, url)
    added = endpoints.add(connection, "http://127.0.0.1:9/hook", allow_private_addresses=True)
    assert endpoints.every(connection) == [added] and endpoints.of_tenant(connection, "key-a") == []


def test_the_retries_last_more_than_a_day():
    policy = retry_policy()
    assert sum(RETRY_INTERVALS_S) >= 24 * 3600 and policy.max == len(RETRY_INTERVALS_S)


@pytest.mark.parametrize("status,finish_reason,event_type", [
    ("finished", "stop", "response.completed"), ("finished", "length", "response.incomplete"),
    ("finished", "timeout", "response.incomplete"), ("failed", None, "response.failed"),
    ("stopped", None, "response.cancelled")])
def test_a_background_responses_end_is_pushed_onto_the_outbox(status, finish_reason, event_type):
    connection = fakeredis.FakeRedis()
    request = GenerationRequest(prompt="hi", background_response="resp_abc", tenant="key-0123456789abcdef")
    result = None if finish_reason is None else GenerationResult(
        text="x", token_ids=[1], finish_reason=finish_reason, usage={"prompt_tokens": 1, "completion_tokens": 1})
    with connection.pipeline() as pipe:
        announce_response_end_on(pipe, request, status, result)
        pipe.execute()
    pushed = json.loads(connection.lpop(keys.WEBHOOK_OUTBOX))
    assert pushed.pop("created_at") == pytest.approx(time.time(), abs=2)
    assert pushed == {"type": event_type, "id": "resp_abc", "tenant": "key-0123456789abcdef"}


def test_cancelling_a_queued_background_response_announces_it_and_a_plain_job_announces_nothing():
    connection = fakeredis.FakeRedis()
    endpoint = endpoints.add(connection, "http://127.0.0.1:9/hook", allow_private_addresses=True)
    client = Client(connection, queue="hooks")
    plain = client.submit(GenerationRequest(prompt="hi"))
    background = client.submit(GenerationRequest(prompt="hi", background_response="resp_xyz"))
    deliveries = Queue(DELIVERY_QUEUE, connection=connection, serializer=JSONSerializer)
    assert client.cancel(plain) and deliveries.job_ids == []
    assert client.cancel(background)  # the cancel dispatches the event it pushed at once
    assert deliveries.job_ids == [delivery_job_id(event_id("response.cancelled", "resp_xyz"), endpoint.id)]
    assert connection.llen(keys.WEBHOOK_OUTBOX) == 0


class CountingRedis(fakeredis.FakeRedis):
    commands = 0

    def execute_command(self, *args, **options):
        CountingRedis.commands += 1
        return super().execute_command(*args, **options)


def test_dispatch_of_an_empty_outbox_is_one_round_trip():
    connection = CountingRedis()
    dispatch(connection)  # loads the script
    CountingRedis.commands = 0
    assert dispatch(connection) == 0 and CountingRedis.commands == 1


def test_dispatch_makes_one_job_per_wanting_endpoint_of_the_tenant_once():
    connection = fakeredis.FakeRedis()
    url = "http://127.0.0.1:9/hook"
    mine = endpoints.add(connection, url, tenant="key-a", allow_private_addresses=True)
    responses_only = endpoints.add(connection, url, tenant="key-a", events=("response.completed",),
                                   allow_private_addresses=True)
    open_gateway = endpoints.add(connection, url, allow_private_addresses=True)
    endpoints.add(connection, url, tenant="key-b", allow_private_addresses=True)
    connection.rpush(keys.WEBHOOK_OUTBOX, entry(tenant="key-a"), entry(tenant="key-a"), entry(subject="batch_open"),
                     entry(tenant="key-nobody"), "garbage")
    assert dispatch(connection) == 2  # the repeated entry adds nothing
    queue = Queue(DELIVERY_QUEUE, connection=connection, serializer=JSONSerializer)
    assert sorted(queue.job_ids) == sorted([
        delivery_job_id(event_id("batch.completed", "batch_abc"), mine.id),
        delivery_job_id(event_id("batch.completed", "batch_open"), open_gateway.id)])
    job = queue.fetch_job(delivery_job_id(event_id("batch.completed", "batch_abc"), mine.id))
    assert job.args[0] == mine.id and job.args[1]["data"] == {"id": "batch_abc"} and job.retries_left == len(
        RETRY_INTERVALS_S)
    assert responses_only.id not in json.dumps(queue.job_ids)
    assert connection.llen(keys.WEBHOOK_OUTBOX) == 0 and connection.zcard(keys.WEBHOOK_OUTBOX_CLAIMED) == 0
    connection.rpush(keys.WEBHOOK_OUTBOX, entry(tenant="key-a"))  # announced again: the job exists
    assert dispatch(connection) == 0 and len(queue.job_ids) == 2


def test_an_entry_claimed_by_a_dispatcher_that_died_is_dispatched_again_once_stale():
    connection = fakeredis.FakeRedis()
    endpoint = endpoints.add(connection, "http://127.0.0.1:9/", allow_private_addresses=True)
    connection.zadd(keys.WEBHOOK_OUTBOX_CLAIMED, {entry(subject="batch_old"): time.time() - 3600,
                                                 entry(subject="batch_new"): time.time()})
    assert dispatch(connection) == 1
    assert Queue(DELIVERY_QUEUE, connection=connection, serializer=JSONSerializer).job_ids == [
        delivery_job_id(event_id("batch.completed", "batch_old"), endpoint.id)]
    assert connection.zcard(keys.WEBHOOK_OUTBOX_CLAIMED) == 1  # the fresh claim is its dispatcher's, still at work
