"""Security: key names from ids are validated (no key injection), Redis with `requirepass` and a
restricted ACL user, TLS (`rediss://`) with a self-signed certificate, size limits with clear errors,
and /metrics bound to the address the operator picks. (Workers never unpickling job data is tested
against a real worker in test_bad_input.py.)"""

from __future__ import annotations

import socket
import subprocess
import urllib.request

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from redis.connection import SSLConnection
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError
from rq import Queue
from rq.job import JobStatus
from rq.serializers import JSONSerializer

from rqbatcher.client import Client, JobFailed, connect
from rqbatcher.jobs import keys
from rqbatcher.jobs.contract import JOB_FUNCTION
from rqbatcher.sampling_params import MAX_TOKENS_LIMIT
from rqbatcher.schema import MAX_PROMPT_BYTES, MAX_PROMPT_TOKEN_IDS, GenerationRequest
from rqbatcher.workers.job_worker.worker import JobWorker
from tests.fake_engine import FakeEngine, expected_text
from tests.jobs_support import fake_redis_fixture, keep_signal_handlers_fixture  # noqa: F401
from tests.reliability.support import RedisServer, fetch, free_port, record

pytestmark = pytest.mark.timeout(300)
SAFE = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


# ----- key names -----
@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80))
def test_an_id_or_queue_name_never_reaches_outside_its_key(name):
    for check, key in ((keys.check_job_id, keys.stream_key), (keys.check_queue, lambda n: keys.queue_name(n, 3))):
        try:
            check(name)
        except ValueError as exc:
            assert set(name) - SAFE or not name or len(name) > keys.MAX_QUEUE_CHARS
            assert "A-Z a-z 0-9 _ -" in str(exc)
            with pytest.raises(ValueError):
                key(name)
        else:
            assert name and set(name) <= SAFE
            assert key(name).count(":") <= 2 and "*" not in key(name)


def test_the_client_refuses_unsafe_ids_before_touching_redis(fake_redis):
    client = Client(fake_redis, queue="safe")
    for bad in ("a:b", "x y", "*", "../rq:queue:other", "id\r\nFLUSHALL", ""):
        with pytest.raises(ValueError, match="A-Z a-z 0-9"):
            client.submit("hi", job_id=bad)
        with pytest.raises(ValueError, match="A-Z a-z 0-9"):
            client.status(bad)
        with pytest.raises(ValueError, match="A-Z a-z 0-9"):
            client.cancel(bad)
        with pytest.raises(ValueError):
            list(client.stream(bad))
    for bad in ("rq:queue:x", "a.p1", "q*", "x" * 65):
        with pytest.raises(ValueError, match="queue name"):
            Client(fake_redis, queue=bad)
    assert fake_redis.keys("*") == []


# ----- Redis auth: requirepass, and an ACL user restricted to batcher's and RQ's keys -----
ACL_USER, ACL_PASSWORD, ADMIN_PASSWORD = "batcher", "w0rker-pass", "admin-pass"


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("acl"), "--requirepass", ADMIN_PASSWORD,
                         password=ADMIN_PASSWORD).start()
    server.connection().acl_setuser(ACL_USER, enabled=True, passwords=[f"+{ACL_PASSWORD}"],
                                    keys=["rq:*", "batcher:*"], channels=["rq:*"],
                                    commands=["+@all", "-@dangerous", "+info", "+client|setname", "+client|getname"])
    yield server
    server.stop()


def run_one_job_in_process(url: str, queue: str) -> None:
    """A client and a JobWorker (fake engine, so no model) on `url`: one job end to end."""
    client = Client(url, queue=queue)
    job_id = client.submit({"prompt": "hi", "sampling": {"max_tokens": 3}})
    worker = JobWorker(keys.priority_queue_names([queue]), FakeEngine(), connection=connect(url))
    assert worker.work(burst=True)
    assert client.result(job_id, timeout=30).text == expected_text(3)


@pytest.mark.usefixtures("keep_signal_handlers")
def test_workers_and_clients_run_as_a_restricted_acl_user(acl_redis):
    url = f"redis://{ACL_USER}:{ACL_PASSWORD}@127.0.0.1:{acl_redis.port}/0"
    run_one_job_in_process(url, "acl")
    admin = acl_redis.connection()
    assert all(k.startswith((b"rq:", b"batcher:")) for k in admin.keys("*"))
    user = connect(url)
    with pytest.raises(NoPermissionError):  # the user reaches only rq:* and batcher:* keys
        user.set("elsewhere", 1)
    with pytest.raises((NoPermissionError, ResponseError)):
        user.flushall()
    with pytest.raises(AuthenticationError):
        connect(f"redis://{ACL_USER}:wrong@127.0.0.1:{acl_redis.port}/0").ping()
    with pytest.raises((AuthenticationError, ResponseError), match="(?i)auth"):
        connect(f"redis://127.0.0.1:{acl_redis.port}/0").ping()


@pytest.mark.usefixtures("keep_signal_handlers")
def test_a_job_id_with_key_syntax_in_redis_is_dropped_and_reaches_no_other_key(acl_redis):
    """A job pushed by hand with an id RQ and batcher refuse: the worker drops it, writes no key for it,
    and serves the next job."""
    admin = acl_redis.connection()
    queue = Queue("inject", connection=admin, serializer=JSONSerializer)
    evil = queue.create_job(JOB_FUNCTION, args=({"prompt": "hi"},))
    evil._id = "x:rq:queue:other *"
    evil.save()
    admin.rpush(queue.key, evil.id)
    good = queue.enqueue(JOB_FUNCTION, {"prompt": "hi", "sampling": {"max_tokens": 2}})
    url = f"redis://{ACL_USER}:{ACL_PASSWORD}@127.0.0.1:{acl_redis.port}/0"
    JobWorker(keys.priority_queue_names(["inject"]), FakeEngine(), connection=connect(url)).work(burst=True)
    assert fetch(admin, good.id).get_status() == JobStatus.FINISHED
    assert not admin.keys("batcher:stream:x*") and not admin.exists("rq:queue:other")
    assert admin.llen(queue.key) == 0 and admin.llen(queue.intermediate_queue_key) == 0


# ----- TLS -----
@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "redis.crt", directory / "redis.key"
    made = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                           "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                           "-keyout", str(key), "-out", str(cert)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"openssl could not make a certificate: {made.stderr.decode()[-300:]}")
    port = free_port()
    server = RedisServer(directory, "--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert),
                         "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no",
                         port=port, scheme="rediss", client_kwargs={"ssl_ca_certs": str(cert)})
    # (the plain port is turned off: this "--port 0" comes after RedisServer's own "--port")
    server.start()
    yield server, cert
    server.stop()


@pytest.mark.usefixtures("keep_signal_handlers")
def test_rediss_urls_run_jobs_over_tls_and_check_the_certificate(tls_redis):
    server, cert = tls_redis
    url = f"rediss://127.0.0.1:{server.port}/0?ssl_ca_certs={cert}&ssl_cert_reqs=required"
    assert issubclass(connect(url).connection_pool.connection_class, SSLConnection)
    run_one_job_in_process(url, "tls")
    with pytest.raises(Exception, match="(?i)certificate|ssl"):  # an unknown CA is refused
        connect(f"rediss://127.0.0.1:{server.port}/0?ssl_cert_reqs=required").ping()
    with pytest.raises(Exception):  # plain redis:// on the TLS port does not talk
        connect(f"redis://127.0.0.1:{server.port}/0?socket_timeout=2").ping()
    record("tls", rediss="job ran over TLS with a self-signed CA, certificate checked")


# ----- size limits -----
def test_size_limits_are_enforced_with_clear_errors(fake_redis):
    client = Client(fake_redis, queue="limits")
    cases = {
        "the limit is 1048576": {"prompt": "a" * (MAX_PROMPT_BYTES + 1)},
        "prompt_token_ids: List should have at most 131072 items":
            {"prompt_token_ids": [5] * (MAX_PROMPT_TOKEN_IDS + 1)},
        "sampling.max_tokens: Input should be less than or equal to 32768":
            {"prompt": "hi", "sampling": {"max_tokens": MAX_TOKENS_LIMIT + 1}},
        "sampling.max_tokens: Input should be greater than or equal to 0":
            {"prompt": "hi", "sampling": {"max_tokens": -1}},
    }
    for message, payload in cases.items():
        with pytest.raises(ValidationError) as refused:
            client.submit(payload)
        assert message.split(": ")[-1] in str(refused.value)
    assert fake_redis.keys("rq:job:*") == []
    GenerationRequest(prompt="a" * MAX_PROMPT_BYTES)  # the limit itself is allowed


def test_a_worker_fails_oversized_jobs_sent_around_the_client(shared_worker):
    w = shared_worker
    queue = Queue(w.queue, connection=w.connection, serializer=JSONSerializer)
    cases = {
        queue.enqueue(JOB_FUNCTION, {"prompt": "a" * (MAX_PROMPT_BYTES + 1)}).id: "the limit is 1048576",
        queue.enqueue(JOB_FUNCTION, {"prompt_token_ids": [5] * (MAX_PROMPT_TOKEN_IDS + 1)}).id: "at most 131072 items",
        queue.enqueue(JOB_FUNCTION, {"prompt": "hi", "sampling": {"max_tokens": 10**9}}).id:
            "sampling.max_tokens: Input should be less than or equal to 32768",
        queue.enqueue(JOB_FUNCTION, {"prompt_token_ids": list(range(3, 200))}).id: "this model's context is 96",
    }
    client = Client(w.connection, queue=w.queue)
    for job_id, message in cases.items():
        with pytest.raises(JobFailed, match=message):
            client.result(job_id, timeout=60)
    assert w.process.poll() is None


# ----- /metrics -----
def test_metrics_bind_to_the_address_the_operator_picks(tiny_model_dir):
    from rqbatcher.workers.job_worker.engine_metrics import EngineMetrics
    from tests.engine_helpers import engine_for

    metrics = EngineMetrics(engine_for(tiny_model_dir("llama"), num_blocks=16))
    server = metrics.start_http_server(0, "127.0.0.1")
    try:
        host, port = server.server_address[:2]
        assert host == "127.0.0.1"
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "batcher" in body
        with socket.socket() as s:  # bound to loopback only: not reachable on another local address
            s.settimeout(1)
            other = socket.gethostbyname(socket.gethostname())
            if not other.startswith("127."):
                assert s.connect_ex((other, port)) != 0
    finally:
        server.shutdown()
        server.server_close()
