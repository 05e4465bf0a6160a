"""Redis URLs (rqbatcher.jobs.connection) and replica confirmation (rqbatcher.jobs.durability).

The URL forms are checked without a server; READONLY and WAIT against redis-server processes of our own
(tests/reliability/support.py), since fakeredis has neither replicas nor WAIT."""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import subprocess

import fakeredis
import pytest
from redis import Redis
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelPool
from redis.connection import SSLConnection, UnixDomainSocketConnection
from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.sentinel import SentinelConnectionPool

from rqbatcher.client import REDIS_URL_ENV, Client, connect
from rqbatcher.jobs import durability
from rqbatcher.jobs.connection import (
    DEFAULT_SENTINEL_PORT,
    DEMOTED,
    FailoverConnection,
    connect_async,
    describe,
    parse_sentinel_url,
)
from rqbatcher.jobs.connection import connect as connect_url
from rqbatcher.jobs.durability import NotReplicated, ReplicaWait
from tests.jobs_support import wait_for
from tests.reliability.support import RedisServer, free_port

# ----- URL forms -----

def test_a_sentinel_url_names_its_sentinels_service_db_and_the_data_nodes_credentials():
    target = parse_sentinel_url("redis+sentinel://app:s3cr%40t@s1:26380,s2,[::1]:26381/mymaster/2")
    assert target.sentinels == [("s1", 26380), ("s2", DEFAULT_SENTINEL_PORT), ("::1", 26381)]
    assert target.service == "mymaster"
    assert (target.node_options["username"], target.node_options["password"], target.node_options["db"]) == \
        ("app", "s3cr@t", 2)
    assert "password" not in target.sentinel_options  # sentinels get a password only when asked for
    assert "ssl" not in target.node_options


def test_sentinel_credentials_tls_and_options_go_where_they_belong():
    target = parse_sentinel_url("rediss+sentinel://:nodepw@s1:1,s2:2/svc?sentinel_password=sentpw"
                                "&sentinel_username=watcher&ssl_ca_certs=/ca.pem&ssl_cert_reqs=required"
                                "&socket_timeout=2.5")
    node, sentinel = target.node_options, target.sentinel_options
    assert node["password"] == "nodepw" and node.get("db", 0) == 0
    assert (sentinel["password"], sentinel["username"]) == ("sentpw", "watcher")
    for options in (node, sentinel):  # TLS and socket options apply to both sides
        assert options["ssl"] is True and options["ssl_ca_certs"] == "/ca.pem"
        assert options["ssl_cert_reqs"] == "required" and options["socket_timeout"] == 2.5
    assert "sentinel_password" not in node and "sentpw" not in repr(node)


@pytest.mark.parametrize("url, problem", [
    ("redis+sentinel://s1:26379", "service"),
    ("redis+sentinel://s1:26379/", "service"),
    ("redis+sentinel://s1:26379/svc/0/extra", "service"),
    ("redis+sentinel://s1:26379/svc/zero", "db"),
    ("redis+sentinel://s1:port/svc", "host[:port]"),
    ("redis+sentinel://s1:1,,s2:2/svc", "host[:port]"),
    ("redis+sentinel://:hunter2@s1:port/svc", "host[:port]"),
])
def test_malformed_sentinel_urls_are_refused_naming_the_part_and_never_the_password(url, problem):
    with pytest.raises(ValueError, match=problem.replace("[", r"\[").replace("]", r"\]")) as caught:
        parse_sentinel_url(url)
    assert "hunter2" not in str(caught.value)


def test_an_unknown_scheme_is_refused():
    with pytest.raises(ValueError, match="redis\\+sentinel://"):
        connect_url("http://:pw@localhost:6379/0")


def test_connect_builds_a_sentinel_client_for_the_primary_sync_and_async():
    client = connect_url("redis+sentinel://:pw@127.0.0.1:26390,127.0.0.1:26391/svc/3?sentinel_password=sp")
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool) and pool.is_master and pool.service_name == "svc"
    assert (pool.connection_kwargs["password"], pool.connection_kwargs["db"]) == ("pw", 3)
    sentinels = pool.sentinel_manager.sentinels
    assert [s.connection_pool.connection_kwargs["port"] for s in sentinels] == [26390, 26391]
    assert all(s.connection_pool.connection_kwargs["password"] == "sp" for s in sentinels)
    assert describe(client) == "the primary of svc (sentinels 127.0.0.1:26390,127.0.0.1:26391)"
    aclient = connect_async("rediss+sentinel://127.0.0.1:26390/svc")
    assert isinstance(aclient.connection_pool, AsyncSentinelPool) and aclient.connection_pool.service_name == "svc"


def test_plain_urls_keep_their_forms_and_env_reaches_every_form(monkeypatch, tmp_path):
    assert issubclass(connect_url("redis://h:6390/1").connection_pool.connection_class, FailoverConnection)
    assert issubclass(connect_url("rediss://h:6390/1").connection_pool.connection_class, SSLConnection)
    unix = connect_url(f"unix://{tmp_path}/redis.sock?db=2")
    assert issubclass(unix.connection_pool.connection_class, UnixDomainSocketConnection)
    assert describe(unix) == f"{tmp_path}/redis.sock" and describe(connect_url("redis://h:6390/1")) == "h:6390"
    monkeypatch.setenv(REDIS_URL_ENV, "redis+sentinel://127.0.0.1:26392/envsvc")
    assert connect().connection_pool.service_name == "envsvc"
    assert Client().connection.connection_pool.service_name == "envsvc"


# ----- against redis-server -----

@pytest.fixture
def primary_and_replica(tmp_path):
    primary = RedisServer(tmp_path / "primary").start()
    replica = RedisServer(tmp_path / "replica", "--replicaof", "127.0.0.1", str(primary.port)).start()
    connection = primary.connection()
    wait_for(lambda: connection.info("replication").get("slave0", {}).get("state") == "online", 20,
             "the replica to come online", interval=0.05)
    try:
        yield primary, replica
    finally:
        replica.stop(signal.SIGKILL)
        primary.stop(signal.SIGKILL)


def test_a_write_to_a_demoted_primary_is_a_connection_fault_sync_and_async(primary_and_replica):
    _, replica = primary_and_replica
    with pytest.raises(RedisConnectionError, match=re.escape(DEMOTED)):
        connect_url(replica.url).set("k", 1)

    async def write():
        client = connect_async(replica.url)
        try:
            await client.set("k", 1)
        finally:
            await client.aclose()

    with pytest.raises(RedisConnectionError, match=re.escape(DEMOTED)):
        asyncio.run(write())


def test_confirm_waits_for_the_replica_and_reports_one_that_does_not_answer(primary_and_replica, caplog):
    primary, replica = primary_and_replica
    connection = connect_url(primary.url)
    connection.set("job", 1)
    assert durability.confirm(connection, "a write") == 1  # auto: the primary has a replica
    assert durability.confirm(connection, "a write", ReplicaWait(replicas=0)) == 0
    replica.process.send_signal(signal.SIGSTOP)  # connected, but acknowledges nothing
    try:
        connection.set("job", 2)
        with pytest.raises(NotReplicated, match="0 of 1 replicas confirmed a write within 50 ms"):
            durability.confirm(connection, "a write", ReplicaWait(timeout_ms=50))
        with caplog.at_level(logging.WARNING, logger="rqbatcher.jobs.durability"):
            assert durability.confirm(connection, "a write", ReplicaWait(timeout_ms=50), strict=False) == 0
        assert "0 of 1 replicas confirmed" in caplog.text
        with pytest.raises(NotReplicated, match="0 of 2 replicas"):
            durability.confirm(connection, "a write", ReplicaWait(replicas=2, timeout_ms=50))
    finally:
        replica.process.send_signal(signal.SIGCONT)


def test_confirm_costs_nothing_without_replicas_and_on_fakeredis(tmp_path):
    server = RedisServer(tmp_path / "alone").start()
    try:
        connection = connect_url(server.url)
        assert durability.confirm(connection, "a write") == 0
        before = connection.info("stats")["total_commands_processed"]
        for _ in range(5):
            assert durability.confirm(connection, "a write") == 0
        assert connection.info("stats")["total_commands_processed"] == before + 1  # only that INFO
    finally:
        server.stop()
    assert durability.confirm(fakeredis.FakeRedis(), "a write") == 0
    client = Client(fakeredis.FakeRedis(), replica_wait=ReplicaWait(replicas=1))
    assert client.submit("a prompt")  # fakeredis has no WAIT: nothing to confirm with


def test_the_policy_comes_from_the_environment(monkeypatch):
    monkeypatch.setattr(durability, "_configured", None)  # as in a fresh process (a CLI test may have set one)
    monkeypatch.setenv(durability.REPLICAS_ENV, "2")
    monkeypatch.setenv(durability.TIMEOUT_ENV, "250")
    assert durability.current() == ReplicaWait(2, 250)
    monkeypatch.setenv(durability.REPLICAS_ENV, "auto")
    assert durability.current().replicas is None
    monkeypatch.setenv(durability.REPLICAS_ENV, "many")
    with pytest.raises(ValueError, match="BATCHER_WAIT_REPLICAS"):
        durability.current()
    with pytest.raises(ValueError, match="at least 1 ms"):
        ReplicaWait(timeout_ms=0)
    durability.configure(ReplicaWait(0, 5))  # the CLI's flags win over the environment
    assert durability.current() == ReplicaWait(0, 5)


def test_sentinel_and_data_node_passwords_each_go_to_their_side(tmp_path):
    """A primary with `requirepass`, and a sentinel with a password of its own: the URL's userinfo reaches the
    primary, `sentinel_password` the sentinel; either one wrong is refused."""
    primary = RedisServer(tmp_path / "primary", "--requirepass", "nodepw", password="nodepw").start()
    port = free_port()
    directory = tmp_path / "sentinel"
    directory.mkdir()
    config = directory / "sentinel.conf"
    config.write_text(f"port {port}\nbind 127.0.0.1\ndir {directory}\nrequirepass sentpw\n"
                      f"sentinel monitor svc 127.0.0.1 {primary.port} 1\nsentinel auth-pass svc nodepw\n")
    sentinel = subprocess.Popen(["redis-server", str(config), "--sentinel"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.STDOUT)
    try:
        url = f"redis+sentinel://:nodepw@127.0.0.1:{port}/svc/1?sentinel_password=sentpw"
        client = wait_for(lambda: _answers(connect_url(url)), 20, "the sentinel to name the primary")
        client.set("k", "v")
        assert Redis(port=primary.port, password="nodepw", db=1).get("k") == b"v"  # the URL's db
        with pytest.raises(RedisConnectionError):  # the sentinel refuses: no primary can be found
            connect_url(f"redis+sentinel://:nodepw@127.0.0.1:{port}/svc?sentinel_password=wrong").ping()
        with pytest.raises(AuthenticationError):
            connect_url(f"redis+sentinel://:wrong@127.0.0.1:{port}/svc?sentinel_password=sentpw").ping()
    finally:
        sentinel.kill()
        sentinel.wait()
        primary.stop()


def _answers(client):
    try:
        return client if client.ping() else None
    except RedisConnectionError:
        return None
