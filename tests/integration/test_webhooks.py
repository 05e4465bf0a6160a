"""Webhooks on the real Redis, delivered over real HTTP by a real RQ worker (in this process): signatures the
`openai` SDK verifies, retries of a failing endpoint with the same webhook-id, no redirect followed, private
addresses refused at add and at delivery, the CLI, and a batch's end delivered as `batch.completed`."""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest
from click.testing import CliRunner
from redis import Redis
from rq import SimpleWorker
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from rqbatcher.cli import main
from rqbatcher.client import Client
from rqbatcher.jobs import keys
from rqbatcher.jobs.rq_adapter import CommandThreadExit, PromptExitWorker
from rqbatcher.webhooks import addresses, delivery, endpoints, pinned_http
from rqbatcher.webhooks.delivery import DELIVERY_QUEUE, delivery_job_id
from rqbatcher.webhooks.event_payload import event_id
from rqbatcher.webhooks.outbox import dispatch
from rqbatcher.workers.job_worker.worker import JobWorker
from tests.fake_engine import FakeEngine
from tests.jobs_support import keep_signal_handlers_fixture  # noqa: F401

pytestmark = [pytest.mark.usefixtures("keep_signal_handlers"), pytest.mark.timeout(120)]
TENANT = "key-0123456789abcdef"
TEST_RETRY_INTERVALS_S = (1, 1, 1)
FAILURES_BEFORE_SUCCESS = 2


class Receiver(ThreadingHTTPServer):
    """Records every POST; /ok answers 204, /flaky 500 twice then 200, /moved a redirect to /ok."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.received: list[tuple[str, dict, bytes]] = []
        self.flaky_failures = 0

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802  (http.server's name)
        server: Receiver = self.server
        body = self.rfile.read(int(self.headers["content-length"]))
        server.received.append((self.path, dict(self.headers), body))
        if self.path == "/flaky" and server.flaky_failures < FAILURES_BEFORE_SUCCESS:
            server.flaky_failures += 1
            self.send_response(500)
        elif self.path == "/moved":
            self.send_response(302)
            self.send_header("location", "/ok")
        else:
            self.send_response(204 if self.path == "/ok" else 200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def receiver():
    server = Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def connection(redis_url, monkeypatch):
    monkeypatch.setattr(delivery, "RETRY_INTERVALS_S", TEST_RETRY_INTERVALS_S)
    return Redis.from_url(redis_url)


class BurstWorker(CommandThreadExit, SimpleWorker):
    """RQ's in-process worker, whose exit does not wait a minute on its command thread (as stock RQ's can)."""


def deliver_until(connection: Redis, done, timeout: float = 15) -> None:
    """Run the webhooks queue (with RQ's scheduler, for the retries) in bursts until `done()`."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the deliveries did not end in time"
        BurstWorker([DELIVERY_QUEUE], connection=connection, serializer=JSONSerializer).work(
            burst=True, with_scheduler=True)
        time.sleep(0.2)


def announce(connection: Redis, subject: str = "batch_abc", event_type: str = "batch.completed",
             tenant: str | None = TENANT) -> str:
    connection.rpush(keys.WEBHOOK_OUTBOX, json.dumps({"type": event_type, "id": subject, "tenant": tenant,
                                                      "created_at": int(time.time())}))
    return event_id(event_type, subject)


def unwrap(secret: str, headers: dict, body: bytes):
    return openai.OpenAI(api_key="unused", webhook_secret=secret).webhooks.unwrap(body, headers)


def job_of(connection: Redis, event: str, endpoint_id: str) -> Job:
    return Job.fetch(delivery_job_id(event, endpoint_id), connection=connection, serializer=JSONSerializer)


def test_a_failing_endpoint_is_retried_with_a_fresh_signature_and_the_same_webhook_id(connection, receiver):
    flaky = endpoints.add(connection, receiver.base + "/flaky", tenant=TENANT, allow_private_addresses=True)
    steady = endpoints.add(connection, receiver.base + "/ok", tenant=TENANT, events=("batch.completed",),
                           allow_private_addresses=True)
    evt = announce(connection)
    assert dispatch(connection) == 2
    deliver_until(connection, lambda: len(receiver.received) == FAILURES_BEFORE_SUCCESS + 2)
    by_path = {path: [(h, b) for p, h, b in receiver.received if p == path] for path in ("/flaky", "/ok")}
    assert len(by_path["/flaky"]) == FAILURES_BEFORE_SUCCESS + 1 and len(by_path["/ok"]) == 1
    for path, endpoint in (("/flaky", flaky), ("/ok", steady)):
        for headers, body in by_path[path]:
            event = unwrap(endpoint.secret, headers, body)
            assert (event.id, event.type, event.data.id, headers["webhook-id"]) == (
                evt, "batch.completed", "batch_abc", evt)
    assert len({h["webhook-signature"] for h, _ in by_path["/flaky"]}) >= 2  # re-signed, a second or more later
    assert job_of(connection, evt, flaky.id).get_status() == JobStatus.FINISHED


def test_a_redirect_is_not_followed_and_fails_the_attempt(connection, receiver):
    moved = endpoints.add(connection, receiver.base + "/moved", tenant=TENANT, allow_private_addresses=True)
    evt = announce(connection, event_type="batch.failed")
    dispatch(connection)
    job = job_of(connection, evt, moved.id)
    deliver_until(connection, lambda: job.get_status(refresh=True) == JobStatus.FAILED)
    assert [path for path, _, _ in receiver.received] == ["/moved"] * (len(TEST_RETRY_INTERVALS_S) + 1)
    assert "answered 302" in job.latest_result().exc_string


def test_a_host_that_now_resolves_to_a_private_address_fails_at_once(connection, receiver, monkeypatch):
    """DNS changed since the endpoint was added: the delivery checks again, fails without retrying, and the host's
    address is the one it connects to (a name only this test resolves)."""
    port = receiver.server_address[1]
    answers = {"public": "93.184.216.34", "private": "127.0.0.1"}
    now = ["public"]
    real_getaddrinfo = socket.getaddrinfo

    def getaddrinfo(host, port_, *args, **kwargs):
        if host != "hooks.example.test":  # Redis
            return real_getaddrinfo(host, port_, *args, **kwargs)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (answers[now[0]], port_))]

    monkeypatch.setattr(addresses.socket, "getaddrinfo", getaddrinfo)
    rebound = endpoints.add(connection, f"http://hooks.example.test:{port}/ok", tenant=TENANT)
    allowed = endpoints.add(connection, f"http://hooks.example.test:{port}/ok", tenant="key-fedcba9876543210",
                            allow_private_addresses=True)
    now[0] = "private"
    with pytest.raises(addresses.RefusedAddress):
        endpoints.add(connection, f"http://hooks.example.test:{port}/ok", tenant=TENANT)
    refused_event = announce(connection)
    allowed_event = announce(connection, subject="batch_other", tenant="key-fedcba9876543210")
    assert dispatch(connection) == 2
    refused_job, allowed_job = job_of(connection, refused_event, rebound.id), job_of(connection, allowed_event,
                                                                                    allowed.id)
    deliver_until(connection, lambda: refused_job.get_status(refresh=True) == JobStatus.FAILED
                  and allowed_job.get_status(refresh=True) == JobStatus.FINISHED)
    assert "non-public address" in refused_job.latest_result().exc_string
    [(path, headers, body)] = receiver.received  # the allowed one alone, sent to the checked address
    assert headers["Host"] == f"hooks.example.test:{port}"
    assert unwrap(allowed.secret, headers, body).data.id == "batch_other"


def test_the_cli_adds_lists_and_removes_endpoints(redis_url, receiver):
    runner = CliRunner()
    refused = runner.invoke(main, ["webhooks", "add", "--redis-url", redis_url, "--url", receiver.base + "/ok"])
    assert refused.exit_code == 1 and "non-public address" in refused.output
    added = runner.invoke(main, ["webhooks", "add", "--redis-url", redis_url, "--url", receiver.base + "/ok",
                                 "--tenant", TENANT, "--events", "batch.completed", "--events", "batch.failed",
                                 "--allow-private-addresses"])
    assert added.exit_code == 0, added.output
    created = json.loads(added.stdout)
    assert created["secret"].startswith("whsec_") and created["id"].startswith("we_")
    open_one = runner.invoke(main, ["webhooks", "add", "--redis-url", redis_url, "--url", receiver.base + "/ok",
                                    "--allow-private-addresses"])
    assert open_one.exit_code == 0, open_one.output
    listed = runner.invoke(main, ["webhooks", "list", "--redis-url", redis_url, "--json"])
    assert created["secret"] not in listed.output and "whsec_" not in listed.output
    assert sorted((e["tenant"] or "", e["events"][0]) for e in json.loads(listed.stdout)) == [
        ("", "batch.completed"), (TENANT, "batch.completed")]
    only_tenant = runner.invoke(main, ["webhooks", "list", "--redis-url", redis_url, "--tenant", TENANT])
    assert created["id"] in only_tenant.output and len(only_tenant.stdout.splitlines()) == 1
    assert runner.invoke(main, ["webhooks", "remove", "--redis-url", redis_url, created["id"]]).exit_code == 0
    gone = runner.invoke(main, ["webhooks", "remove", "--redis-url", redis_url, created["id"]])
    assert gone.exit_code == 1 and "no webhook endpoint" in gone.output


def test_a_batch_end_delivers_a_signed_batch_completed_webhook(connection, redis_url, receiver):
    """The batch's last line ends in a worker, whose job end dispatches the outbox: the delivery job is queued
    before any webhooks worker runs."""
    hook = endpoints.add(connection, receiver.base + "/ok", tenant=TENANT, allow_private_addresses=True)
    client = Client(connection, queue="hooks")
    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": f"p{i}", "max_tokens": 2}}) for i in range(2)]
    batch = client.create_batch(lines, owner=TENANT)
    JobWorker(keys.priority_queue_names(["hooks"]), FakeEngine(), connection=connection).work(burst=True)
    assert client.batch(batch.id).status == "completed"
    evt = event_id("batch.completed", batch.id)
    assert job_of(connection, evt, hook.id).get_status() == JobStatus.QUEUED
    deliver_until(connection, lambda: receiver.received)
    [(_, headers, body)] = receiver.received
    event = unwrap(hook.secret, headers, body)
    assert (event.type, event.data.id, event.id) == ("batch.completed", batch.id, evt)


def test_the_webhooks_worker_command_dispatches_and_delivers(connection, redis_url, receiver):
    hook = endpoints.add(connection, receiver.base + "/ok", allow_private_addresses=True)
    evt = announce(connection, subject="resp_abc", event_type="response.incomplete", tenant=None)
    done = subprocess.run([sys.executable, "-m", "rqbatcher", "webhooks", "worker", "--burst",
                           "--redis-url", redis_url],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    [(_, headers, body)] = receiver.received
    event = unwrap(hook.secret, headers, body)
    assert (event.id, event.type, event.data.id) == (evt, "response.incomplete", "resp_abc")


EXIT_BOUND_S = 20  # the stock command thread's wait is 60 s; ours is COMMAND_WAIT_S


def test_a_worker_whose_command_thread_waits_for_a_subscription_still_exits_promptly(connection):
    """The race behind a burst that took a minute to end: RQ's command thread, no longer subscribed, waits for a
    subscription, and redis-py 8's stop() joins it without a timeout."""
    worker = PromptExitWorker([DELIVERY_QUEUE], connection=connection, serializer=JSONSerializer)
    worker.subscribe()
    worker.pubsub.unsubscribe()
    deadline = time.monotonic() + 5
    while worker.pubsub.subscribed:  # the thread reads the confirmation, then waits for a subscription
        assert time.monotonic() < deadline, "the unsubscribe was never confirmed"
        time.sleep(0.01)
    time.sleep(0.1)
    started = time.monotonic()
    worker.unsubscribe()
    assert time.monotonic() - started < EXIT_BOUND_S and not worker.pubsub_thread.is_alive()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_https_goes_to_the_checked_address_and_verifies_the_hosts_certificate(tmp_path, monkeypatch):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=hooks.example.test", "-addext", "subjectAltName=DNS:hooks.example.test",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    server = Receiver()
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    server.socket = tls.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    trusting_our_cert = ssl.create_default_context(cafile=cert)
    monkeypatch.setattr(pinned_http.ssl, "create_default_context", lambda: trusting_our_cert)
    port = server.server_address[1]
    try:
        target = addresses.Target("https", "hooks.example.test", port, "/ok", "127.0.0.1")  # as resolve() pins it
        assert pinned_http.post(target, b"{}", {}, timeout=5)[0] == 204
        assert server.received[0][1]["Host"] == f"hooks.example.test:{port}"
        with pytest.raises(ssl.SSLCertVerificationError):  # the certificate names another host
            pinned_http.post(addresses.Target("https", "other.example.test", port, "/ok", "127.0.0.1"), b"{}", {}, 5)
    finally:
        server.shutdown()
        server.server_close()
