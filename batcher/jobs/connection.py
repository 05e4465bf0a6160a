"""Redis clients from URLs: the one place that turns a URL batcher accepts into a client, sync or asyncio.

Accepted forms:
- `redis://[[user]:password@]host:port/db`, `rediss://...` (TLS) and `unix:///path?db=N`: redis-py's own;
- `redis+sentinel://[[user]:password@]host:port[,host:port...]/service_name[/db][?options]`, and
  `rediss+sentinel://...`, which speaks TLS to the sentinels and the data nodes alike.

Credentials: the URL's userinfo is the data nodes' (the primary's ACL user and password). Sentinels often run
without a password, so they get one only from the query options `sentinel_password=` (and `sentinel_username=`).
Every other query option is redis-py's (`socket_timeout`, `ssl_ca_certs`, `ssl_cert_reqs`, ...) and applies to
the sentinels and the data nodes.

Failover: a Sentinel client asks the sentinels for the primary each time it opens a connection, so after a
connection error the caller's retry reaches the new primary. A primary demoted to a replica still accepts
connections but answers writes with READONLY: every client made here takes that as a connection fault (the
connection is dropped, the error is a redis ConnectionError), so callers back off and reconnect, as after a cut,
and a URL whose DNS name follows the primary (a managed Redis) gets there too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlencode

from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from redis.asyncio import connection as aconnection
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.backoff import NoBackoff
from redis.connection import Connection, SSLConnection, UnixDomainSocketConnection, parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError
from redis.retry import Retry
from redis.sentinel import Sentinel

SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}  # scheme -> TLS
DEFAULT_SENTINEL_PORT = 26379
# A sentinel that does not answer is skipped for the next one, soon: discovery must not hang on it.
SENTINEL_TIMEOUT_S = 2.0
SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password")
ASYNC_MAX_CONNECTIONS = 10_000  # Redis's own default maxclients: the gateway relays about as many streams at once
DEMOTED = "the primary was demoted to a replica (a failover)"


@dataclass(frozen=True)
class SentinelTarget:
    """What a Sentinel URL names: where the sentinels are, the service, and the options of each side."""

    sentinels: list[tuple[str, int]]
    service: str
    node_options: dict = field(default_factory=dict)  # the data nodes': db, username, password, ssl, socket_*
    sentinel_options: dict = field(default_factory=dict)  # the sentinels': their password, ssl, socket_*


def is_sentinel_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in SENTINEL_SCHEMES


def parse_sentinel_url(url: str) -> SentinelTarget:
    """The parts of a `redis+sentinel://` or `rediss+sentinel://` URL; ValueError, naming the part, if malformed."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SENTINEL_SCHEMES:
        raise ValueError(f"not a Sentinel URL (redis+sentinel:// or rediss+sentinel://): {_redacted(url)}")
    tls = SENTINEL_SCHEMES[scheme.lower()]
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if not at:
        userinfo, hosts = "", netloc
    sentinels = [_host_port(part, url) for part in hosts.split(",")]
    parts = [unquote(p) for p in path.split("/") if p]
    if not parts or len(parts) > 2:
        raise ValueError(f"a Sentinel URL names its service, then optionally a db: .../service_name[/db]; got "
                         f"{_redacted(url)}")
    options = {name: values[-1] for name, values in parse_qs(query).items()}
    sentinel_auth = {name[len("sentinel_"):]: options.pop(name) for name in SENTINEL_OPTIONS if name in options}
    # redis-py parses the rest (typed query options, credentials) as it would for a plain URL
    node = parse_url(f"{'rediss' if tls else 'redis'}://{userinfo + '@' if at else ''}placeholder/"
                     f"{parts[1] if len(parts) == 2 else ''}?{urlencode(options)}")
    if len(parts) == 2 and "db" not in node:
        raise ValueError(f"the db of a Sentinel URL is a number; got {parts[1]!r} in {_redacted(url)}")
    for name in ("host", "port", "connection_class"):
        node.pop(name, None)
    if tls:
        node["ssl"] = True
    shared = {k: v for k, v in node.items() if k.startswith(("ssl", "socket_"))}
    sentinel = {"socket_timeout": SENTINEL_TIMEOUT_S, "socket_connect_timeout": SENTINEL_TIMEOUT_S, **shared,
                **sentinel_auth, "retry": Retry(NoBackoff(), 0)}  # a dead sentinel: ask the next one at once
    return SentinelTarget(sentinels, parts[0], node, sentinel)


def connect(url: str) -> Redis:
    """A client of the primary that `url` names (any accepted form)."""
    if is_sentinel_url(url):
        target = parse_sentinel_url(url)
        return Sentinel(target.sentinels, sentinel_kwargs=target.sentinel_options).master_for(
            target.service, **target.node_options)
    return Redis.from_url(url, connection_class=_SYNC_CLASSES[_scheme(url)])


def connect_async(url: str) -> AsyncRedis:
    """The asyncio client of the primary that `url` names (any accepted form). Each stream the gateway relays holds
    a connection while its blocking read waits, so the pool may open up to ASYNC_MAX_CONNECTIONS (redis-py's
    default of 100 made the 101st concurrent stream fail with "Too many connections")."""
    if is_sentinel_url(url):
        target = parse_sentinel_url(url)
        return AsyncSentinel(target.sentinels, sentinel_kwargs=target.sentinel_options).master_for(
            target.service, max_connections=ASYNC_MAX_CONNECTIONS, **target.node_options)
    return AsyncRedis.from_url(url, connection_class=_ASYNC_CLASSES[_scheme(url)],
                               max_connections=ASYNC_MAX_CONNECTIONS)


def describe(connection: Redis) -> str:
    """Where a client connects, for a log line (never its password)."""
    pool = connection.connection_pool
    service = getattr(pool, "service_name", None)
    if service is not None:
        sentinels = ",".join("{host}:{port}".format_map(s.connection_pool.connection_kwargs)
                             for s in pool.sentinel_manager.sentinels)
        return f"the primary of {service} (sentinels {sentinels})"
    kwargs = pool.connection_kwargs
    return kwargs.get("path") or f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"


def _scheme(url: str) -> str:
    scheme = url.split("://", 1)[0].lower()
    if scheme not in _SYNC_CLASSES:
        raise ValueError(f"a Redis URL starts with redis://, rediss://, unix://, redis+sentinel:// or "
                         f"rediss+sentinel://; got {_redacted(url)}")
    return scheme


def _host_port(part: str, url: str) -> tuple[str, int]:
    host, port = part, ""
    if part.startswith("["):  # [IPv6]:port
        host, _, port = part[1:].partition("]")
        port = port.removeprefix(":")
    elif ":" in part:
        host, _, port = part.rpartition(":")
    if not host or (port and not port.isdigit()):
        raise ValueError(f"a sentinel address is host[:port]; got {part!r} in {_redacted(url)}")
    return unquote(host), int(port) if port else DEFAULT_SENTINEL_PORT


def _redacted(url: str) -> str:
    """The URL without its password, for an error message."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, tail = rest.partition("@")
    if not at or "/" in userinfo:
        return url
    user = userinfo.partition(":")[0]
    return f"{scheme}{sep}{user}:***@{tail}"


class _DemotedIsAFault:
    """Answers READONLY (a demoted primary) as a connection fault: drop the connection, raise ConnectionError."""

    def read_response(self, *args, **kwargs):
        try:
            return super().read_response(*args, **kwargs)
        except ReadOnlyError as exc:
            self.disconnect()
            raise RedisConnectionError(f"{DEMOTED}: {exc}") from exc


class _AsyncDemotedIsAFault:
    async def read_response(self, *args, **kwargs):
        try:
            return await super().read_response(*args, **kwargs)
        except ReadOnlyError as exc:
            await self.disconnect()
            raise RedisConnectionError(f"{DEMOTED}: {exc}") from exc


class FailoverConnection(_DemotedIsAFault, Connection):
    pass


class FailoverSSLConnection(_DemotedIsAFault, SSLConnection):
    pass


class FailoverUnixConnection(_DemotedIsAFault, UnixDomainSocketConnection):
    pass


class AsyncFailoverConnection(_AsyncDemotedIsAFault, aconnection.Connection):
    pass


class AsyncFailoverSSLConnection(_AsyncDemotedIsAFault, aconnection.SSLConnection):
    pass


class AsyncFailoverUnixConnection(_AsyncDemotedIsAFault, aconnection.UnixDomainSocketConnection):
    pass


_SYNC_CLASSES = {"redis": FailoverConnection, "rediss": FailoverSSLConnection, "unix": FailoverUnixConnection}
_ASYNC_CLASSES = {"redis": AsyncFailoverConnection, "rediss": AsyncFailoverSSLConnection,
                  "unix": AsyncFailoverUnixConnection}
