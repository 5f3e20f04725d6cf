"""Which backend serves a request: the pool of backends, their health and load, and the policies.

A leaf (it imports nothing of graphgen), torch-free and HTTP-free, so every router picks with the
same code: the P/D router (`graphgen.route.app`, its HTTP transport) and the data-parallel engine's
rank choice (`graphgen.runtime.parallel.data_parallel.DPRouter`), neither importing the other:

* ``round_robin``: the healthy backends in turn;
* ``least_loaded``: the healthy backend with the fewest requests in flight (ties: in turn);
* ``prefix``: rendezvous hashing of the request's prefix key over the healthy backends, so one
  prefix keeps going to one backend while it is up (and only its share moves when one goes down).
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from dataclasses import dataclass, field
from typing import Optional, Sequence

POLICIES = ("round_robin", "least_loaded", "prefix")
SLOW_CHECKS_DOWN = 3  # timed-out health checks in a row that mark a backend down

__all__ = ["POLICIES", "Backend", "Pool", "prefix_key"]


@dataclass(eq=False)
class Backend:
    """One backend server: its base URL, whether its last health check passed, requests in flight."""

    url: str
    healthy: bool = True
    inflight: int = 0
    failures: int = 0          # requests that could not reach it (connection refused, timed out)
    slow_checks: int = 0       # health checks in a row that timed out (a busy backend, not yet down)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def checked(self, answered: Optional[bool]) -> None:
        """One health check's outcome: True (200), False (refused, or another status) or None (timed
        out). A refusal is down at once; a backend only slow to answer (its event loop busy on a loaded
        host) stays up until ``SLOW_CHECKS_DOWN`` checks in a row timed out."""
        if answered is None:
            self.slow_checks += 1
            if self.slow_checks >= SLOW_CHECKS_DOWN:
                self.healthy = False
        else:
            self.slow_checks = 0
            self.healthy = answered

    def begin(self) -> None:
        with self._lock:
            self.inflight += 1

    def end(self) -> None:
        with self._lock:
            self.inflight -= 1


class Pool:
    """Backends of one kind (e.g. the prefill instances) and the policy that picks among them (none:
    ``pick`` is always None)."""

    def __init__(self, urls: Sequence[str], policy: str = "round_robin"):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.backends = [Backend(u.rstrip("/")) for u in urls]
        self.policy = policy
        self._turn = itertools.count()

    def healthy(self, exclude: Sequence[Backend] = ()) -> list[Backend]:
        return [b for b in self.backends if b.healthy and b not in exclude]

    def pick(self, key: str = "", exclude: Sequence[Backend] = ()) -> Optional[Backend]:
        """A healthy backend not in ``exclude`` by the policy, or None when none is up."""
        up = self.healthy(exclude)
        if not up:
            return None
        if self.policy == "prefix":
            return max(up, key=lambda b: hashlib.sha256(f"{b.url}\0{key}".encode()).digest())
        turn = next(self._turn)
        if self.policy == "least_loaded":
            low = min(b.inflight for b in up)
            up = [b for b in up if b.inflight == low]
        return up[turn % len(up)]


def prefix_key(body: dict, chars: int = 256) -> str:
    """The part of a request that names its prefix: the prompt's (or the messages') first ``chars``."""
    if "messages" in body:
        text = repr(body.get("messages"))
    else:
        text = repr(body.get("prompt"))
    return text[:chars]
