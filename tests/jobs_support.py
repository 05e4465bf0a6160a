"""Fixtures and helpers for the tests of jobs on Redis: fakeredis for unit tests, a private
database of the real Redis for integration and end-to-end tests.

A test module takes a fixture by importing its `*_fixture` function."""

from __future__ import annotations

import os
import signal
import time

import pytest
from redis import Redis

from rqbatcher.workers.embedded_redis import embedded_redis

REAL_REDIS = "redis://127.0.0.1:6379"
TEST_DBS = range(15, 8, -1)  # RQ's keys have no prefix, so the tests take a whole database
CLAIM_KEY = "batcher-tests:claim"
CLAIM_TTL_S = 3600


@pytest.fixture(name="fake_redis")
def fake_redis_fixture() -> Redis:
    """A fresh fakeredis server (the demo's embedded Redis)."""
    return embedded_redis()


@pytest.fixture(name="keep_signal_handlers")
def keep_signal_handlers_fixture():
    """A worker run on the main thread installs SIGINT/SIGTERM handlers; put pytest's back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def claim_database() -> tuple[str, Redis]:
    """Take an empty database of the local Redis for this test session: (url, connection).

    Claimed with SET NX, so two sessions never share one; everything in it is ours to flush."""
    try:
        Redis.from_url(REAL_REDIS).ping()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"no Redis at {REAL_REDIS}: {exc}")
    for db in TEST_DBS:
        connection = Redis.from_url(f"{REAL_REDIS}/{db}")
        if connection.set(CLAIM_KEY, os.getpid(), nx=True, ex=CLAIM_TTL_S):
            if connection.dbsize() == 1:
                return f"{REAL_REDIS}/{db}", connection
            connection.delete(CLAIM_KEY)
    pytest.skip("no empty Redis database in 9..15 to claim")


def reset_database(connection: Redis) -> None:
    """Empty a claimed database between tests, keeping the claim."""
    connection.flushdb()
    connection.set(CLAIM_KEY, os.getpid(), ex=CLAIM_TTL_S)


def release_database(connection: Redis) -> None:
    connection.flushdb()


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    """Poll `predicate` until it returns something truthy; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def continued_text(events, choice: int = 0) -> str:
    """A rerun job's streamed text, checked to be one uninterrupted stream: no `restart`, and each token event of
    `choice` starts where the one before it ended, across executions."""
    assert "restart" not in [e.type for e in events]
    tokens = [e for e in events if e.type == "token" and e.choice == choice]
    assert [e.index for e in tokens] == [sum(len(t.token_ids) for t in tokens[:i]) for i in range(len(tokens))]
    return "".join(e.text for e in tokens)
