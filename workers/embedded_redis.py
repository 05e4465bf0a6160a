"""An in-process Redis (fakeredis) for `batcher demo`, when no Redis is given."""

from __future__ import annotations

from redis import Redis

from rqbatcher.errors import BatcherError
from rqbatcher.jobs.rq_adapter import pin_server_version

EMBEDDED_SERVER_VERSION = (7, 2, 0)  # fakeredis answers no INFO; RQ is told the version it would ask for
DEMO_EXTRA = "rqbatcher[demo]"


def embedded_redis() -> Redis:
    """A fakeredis server that the threads of this process share; BatcherError names the extra where it is missing."""
    try:
        import fakeredis
    except ImportError:
        raise BatcherError(f"`batcher demo` without --redis-url runs an embedded Redis (fakeredis): pip install "
                           f"'{DEMO_EXTRA}', or give it a Redis with --redis-url") from None

    connection = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    pin_server_version(connection, EMBEDDED_SERVER_VERSION)
    return connection
