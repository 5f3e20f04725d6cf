"""Loopback helpers shared by the rank launcher, the Mooncake launcher, the demo and the server."""
from __future__ import annotations

import socket

__all__ = ["free_port", "port_is_free"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free on ``host`` now (another process may still take it first)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    """Whether ``host:port`` can be bound now (checked before a server loads its model)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True
