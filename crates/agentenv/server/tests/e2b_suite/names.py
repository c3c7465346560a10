"""A pytest plugin (`-p names`): resolves the suite's sandbox domain and every name under it
(E2B_SUITE_DOMAIN, server.sh) to loopback, as a deployment's wildcard DNS name resolves to its server."""

import os
import socket

_domain = os.environ.get("E2B_SUITE_DOMAIN", "")
_getaddrinfo = socket.getaddrinfo


def _loopback(host, *args, **kw):
    if _domain and isinstance(host, str) and (host == _domain or host.endswith("." + _domain)):
        host = "127.0.0.1"
    return _getaddrinfo(host, *args, **kw)


socket.getaddrinfo = _loopback
