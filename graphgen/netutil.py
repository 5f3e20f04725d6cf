"""Loopback helpers shared by the rank launcher, the Mooncake launcher, the demo and the server, and
the API-key check the server and the router share."""
from __future__ import annotations

import hmac
import socket
from typing import Sequence

__all__ = ["free_port", "port_is_free", "bind_socket", "is_api_path", "bearer_authorized"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free on ``host`` now (another process may still take it first)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def bind_socket(host: str, port: int):
    """A TCP socket bound to ``host:port`` (0: a free port), not listening yet: ``(sock, None)``, or
    ``(None, "cannot listen on HOST:PORT: why")``."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        return None, f"cannot listen on {host}:{port}: {e}"
    return sock, None


def port_is_free(host: str, port: int) -> bool:
    """Whether ``host:port`` can be bound now (checked before a server loads its model)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def is_api_path(path: str) -> bool:
    """The routes an API key guards: ``/v1`` and below (``/health`` and ``/metrics`` stay open)."""
    return path == "/v1" or path.startswith("/v1/")


def bearer_authorized(authorization: bytes, keys: Sequence[bytes]) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <one of keys>``. Every key is compared, in
    constant time, with no early exit: the time taken says nothing about which key (or prefix) matched."""
    token = authorization[7:] if authorization[:7].lower() == b"bearer " else b""
    ok = False
    for k in keys:
        ok |= hmac.compare_digest(token, k)
    return ok
