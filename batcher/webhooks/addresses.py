"""Which hosts a webhook may reach: by default only public addresses, so that an endpoint URL cannot make the
deliveries probe the operator's own network (SSRF). Checked when an endpoint is added and again at each delivery
(DNS can change), and a delivery connects to the address it checked, never to a second resolution."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from rqbatcher.errors import BatcherError

DEFAULT_PORTS = {"http": 80, "https": 443}  # the schemes a webhook URL may have


class RefusedAddress(BatcherError):
    """A webhook URL that may not be reached: a scheme other than http(s), or a host with a non-public address."""


class UnresolvedHost(BatcherError):
    """A webhook URL's host has no address now (perhaps only for now: a delivery tries again later)."""


@dataclass(frozen=True)
class Target:
    """Where one delivery goes: the URL's parts, and the checked address to connect to."""

    scheme: str
    host: str
    port: int
    path: str  # with the query
    address: str


def split_url(url: str) -> tuple[str, str, int, str]:
    """The scheme, host, port and path of a webhook URL; RefusedAddress if it is not an http(s) URL with a host."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise RefusedAddress(f"not a URL: {url!r} ({exc})") from None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise RefusedAddress(f"a webhook URL is http or https, got {url!r}")
    if not parts.hostname:
        raise RefusedAddress(f"a webhook URL names a host, got {url!r}")
    if parts.username is not None or parts.password is not None:
        raise RefusedAddress("a webhook URL carries no credentials: the signature authenticates the sender")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return scheme, parts.hostname, port or DEFAULT_PORTS[scheme], path


def is_public(address: str) -> bool:
    """Whether an address is reachable on the public internet: not loopback, private, link-local, multicast,
    reserved, unspecified or shared (CGNAT). An IPv6 address that carries an IPv4 one (mapped, 6to4, Teredo) is
    judged by that one too."""
    if "%" in address:  # an IPv6 zone index names a local link
        return False
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return is_public(str(ip.ipv4_mapped))
        embedded = ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if embedded is not None and not is_public(str(embedded)):
            return False
    flags = (ip.is_loopback, ip.is_private, ip.is_link_local, ip.is_multicast, ip.is_reserved, ip.is_unspecified)
    return ip.is_global and not any(flags)


def resolve(url: str, allow_private_addresses: bool = False) -> Target:
    """Where a delivery to `url` connects: the first address of its host. RefusedAddress if any of the host's
    addresses is not public (unless allowed): a host that resolves to one public and one private address could
    otherwise reach the private one."""
    scheme, host, port, path = split_url(url)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as exc:
        raise UnresolvedHost(f"cannot resolve the webhook host {host!r}: {exc}") from None
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    if not addresses:
        raise UnresolvedHost(f"the webhook host {host!r} has no address")
    refused = [a for a in addresses if not is_public(a)]
    if refused and not allow_private_addresses:
        raise RefusedAddress(f"the webhook host {host!r} resolves to a non-public address ({', '.join(refused)}); "
                             "an operator allows it with `batcher webhooks add --allow-private-addresses`")
    return Target(scheme, host, port, path, addresses[0])
