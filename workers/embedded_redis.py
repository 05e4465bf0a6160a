"""An in-process Redis (fakeredis) for `batcher demo`, when no Redis is given."""

from __future__ import annotations

from redis import Redis

from rqbatcher.jobs.rq_adapter import pin_server_version

EMBEDDED_SERVER_VERSION = (7, 2, 0)  # fakeredis answers no INFO; RQ is told the version it would ask for


def embedded_redis() -> Redis:
    """A fakeredis server that the threads of this process share."""
    import fakeredis

    connection = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    pin_server_version(connection, EMBEDDED_SERVER_VERSION)
    return connection
