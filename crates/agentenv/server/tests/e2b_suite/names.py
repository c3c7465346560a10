"""A pytest plugin (`-p names`): resolves the suite's sandbox domain and every name under it
(E2B_SUITE_DOMAIN, server.sh) to loopback, as a deployment's wildcard DNS name resolves to its server."""

import os
import socket

_domain = os.environ.get("E2B_SUITE_DOMAIN", "")
_getaddrinfo = socket.getaddrinfo


def _loopback(host, *args, **kw):
    # anyio (async httpx) passes the name IDNA-encoded, as bytes.
    name = host.decode("ascii", "replace") if isinstance(host, bytes) else host
    if _domain and isinstance(name, str) and (name == _domain or name.endswith("." + _domain)):
        host = "127.0.0.1"
    return _getaddrinfo(host, *args, **kw)


socket.getaddrinfo = _loopback
