"""One HTTP POST to an address already checked (`addresses.resolve`), never to a new resolution of the host: the
Host header and TLS (SNI and certificate) name the host, the TCP connection goes to the address. It follows no
redirect (a 3xx is an answer like any other) and reads at most a few kB of the answer."""

from __future__ import annotations

import http.client
import socket
import ssl

from rqbatcher.webhooks.addresses import Target

MAX_ANSWER_BYTES = 4096


class _PinnedHTTPConnection(http.client.HTTPConnection):
    def __init__(self, target: Target, timeout: float) -> None:
        super().__init__(target.host, target.port, timeout=timeout)
        self._address = target.address

    def connect(self) -> None:
        self.sock = socket.create_connection((self._address, self.port), self.timeout)


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    def __init__(self, target: Target, timeout: float) -> None:
        super().__init__(target.host, target.port, timeout=timeout, context=ssl.create_default_context())
        self._address = target.address

    def connect(self) -> None:
        sock = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)


def post(target: Target, body: bytes, headers: dict[str, str], timeout: float) -> tuple[int, bytes]:
    """POST `body` as JSON; the answer's status and its first MAX_ANSWER_BYTES. Raises OSError (ssl and socket
    errors, a timeout) and http.client.HTTPException where no answer came."""
    kind = _PinnedHTTPSConnection if target.scheme == "https" else _PinnedHTTPConnection
    connection = kind(target, timeout)
    try:
        connection.request("POST", target.path, body=body,
                           headers={**headers, "content-type": "application/json", "connection": "close"})
        answer = connection.getresponse()
        return answer.status, answer.read(MAX_ANSWER_BYTES)
    finally:
        connection.close()
