"""How the driver reaches each rank: a pipe to a rank process of its own node (`LocalRank`), or the command
channel to the follower hosting it on another node (`RemoteRank` over a `NodeLink`); `Channel` is the
driver's listener the followers join (docs/parallel.md, "Ranks across nodes").

The channel is a `multiprocessing.connection` over TCP on the master address, authenticated with the
cluster key (`graphgen.runtime.parallel.cluster.cluster_key`: an HMAC challenge before anything is
unpickled). Messages, each a tuple:

* follower -> driver: ``("hello", {...})`` once; ``(rank, reply)`` for each of its ranks' replies and
  progress events, as a local rank sends them on its pipe; ``("lost", sentence)`` when one of its rank
  processes exited; ``("ping",)`` every `HEARTBEAT_S`;
* driver -> follower: ``("welcome", cfg)`` or ``("refused", sentence)``; ``("cmd", command)`` (the follower
  sends it to each of its ranks); ``("abort", sentence)`` (the engine ended: the follower ends its ranks);
  ``("ping",)`` every `HEARTBEAT_S`.

A link is lost when its connection closes (the node's process died: at once) or when nothing came
from it for `SILENCE_S` while the driver waits on it (a frozen node, a cut network).
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Listener
from typing import Callable, Optional

__all__ = ["LocalRank", "RemoteRank", "PendingRank", "NodeLink", "Channel", "HEARTBEAT_S", "SILENCE_S",
           "connect_channel"]

HEARTBEAT_S = 1.0  # pings both ways while the link is up (a silent driver is also a lost one)
SILENCE_S = 30.0   # nothing from a peer for this long while waiting on it: lost (frozen, or the network cut)


class LocalRank:
    """A rank process of this node, on a pipe."""

    def __init__(self, rank: int, conn, proc):
        self.rank, self.conn, self.proc = rank, conn, proc

    def send(self, msg) -> None:
        self.conn.send(msg)

    def recv(self):
        """Its next message, or None; a closed pipe (the process died) is its `failure`'s sentence."""
        if not self.conn.poll(0):
            return None
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(1.0)
            return ("exited", self.failure() or f"rank {self.rank} closed its pipe")

    def failure(self, since: float = 0.0) -> Optional[str]:
        return None if self.proc.is_alive() else f"rank {self.rank} exited (code {self.proc.exitcode})"

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()


class NodeLink:
    """The driver's end of one follower's channel: ``ranks`` it hosts; a reader thread files each rank's
    messages in its inbox and notes pings and losses. ``name``: how sentences name it (``node 1 (ranks 2-3)``)."""

    def __init__(self, conn, ranks: tuple[int, ...], name: str, *, clock: Callable[[], float] = time.monotonic,
                 on_lost: Optional[Callable[["NodeLink"], None]] = None):
        """``on_lost(link)``: called from the reader thread once the link is lost (its connection closed, or
        its follower reported a rank's death)."""
        self.conn, self.ranks, self.name, self._clock, self._on_lost = conn, ranks, name, clock, on_lost
        self.inbox: dict[int, collections.deque] = {r: collections.deque() for r in ranks}
        self.lost: Optional[str] = None
        self.last = clock()
        self._send_lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True, name=f"graphgen-link-{name}").start()

    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                self.lost = self.lost or f"{self.name} was lost: its connection to the driver closed"
                if self._on_lost is not None:
                    self._on_lost(self)
                return
            self.last = self._clock()
            if msg[0] == "ping":
                continue
            if msg[0] == "lost":
                self.lost = f"{self.name}: {msg[1]}"
                if self._on_lost is not None:
                    self._on_lost(self)
                continue
            rank, reply = msg
            self.inbox[rank].append(reply)

    def send(self, msg) -> None:
        with self._send_lock:
            try:
                self.conn.send(msg)
            except OSError:
                self.lost = self.lost or f"{self.name} was lost: its connection to the driver closed"

    def failure(self, since: float) -> Optional[str]:
        """Why the link is down, or None: lost, or silent for `SILENCE_S` since ``since`` (when the
        driver began waiting: while it does not read, pings pile up unread)."""
        if self.lost:
            return self.lost
        silent = self._clock() - max(self.last, since)
        if silent > SILENCE_S:
            return f"{self.name} stopped answering: nothing came from it for {silent:.0f} s"
        return None

    def close(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass


class RemoteRank:
    """A rank on another node: its messages come through its follower's `NodeLink` (which carries each
    command once for all its ranks, so `send` does nothing here)."""

    def __init__(self, rank: int, link: NodeLink):
        self.rank, self.link = rank, link

    def send(self, msg) -> None:
        pass

    def recv(self):
        box = self.link.inbox[self.rank]
        return box.popleft() if box else None

    def failure(self, since: float = 0.0) -> Optional[str]:
        return self.link.failure(since)

    def kill(self) -> None:
        pass


class PendingRank:
    """A rank on a node that has not joined yet: nothing comes; its start deadline names the node."""

    def __init__(self, rank: int, member: int):
        self.rank, self.member = rank, member

    def send(self, msg) -> None:
        pass

    def recv(self):
        return None

    def failure(self, since: float = 0.0) -> Optional[str]:
        return None

    def kill(self) -> None:
        pass


class Channel:
    """The driver's listener on ``address`` for the followers (a taken port fails here, at once). `start`
    runs the accepting thread: each follower's hello is checked (``check(hello) -> sentence or None``) and
    answered with ``("welcome", cfg)`` (then `joined` gets ``("joined", member, link)``) or ``("refused",
    sentence)`` (``("refused", member, sentence)``). While open, every link gets a ping each `HEARTBEAT_S`."""

    def __init__(self, address: tuple[str, int], key: bytes, *, clock: Callable[[], float] = time.monotonic):
        self.address, self._key, self._clock = address, key, clock
        try:
            self._listener = Listener(address, family="AF_INET", backlog=64, authkey=key)
        except OSError as e:
            raise ValueError(f"the command channel cannot listen on {address[0]}:{address[1]} ({e}): "
                             f"--master-addr must be this node's address, and --master-port + 1 free") from None
        self.joined: queue.Queue = queue.Queue()
        self.links: list[NodeLink] = []
        self.on_lost: Optional[Callable[[NodeLink], None]] = None  # a link lost (from its reader thread)
        self._closed = threading.Event()

    def start(self, check: Callable[[dict], Optional[str]], welcome: Callable[[dict], object],
              name: Callable[[int], str]) -> None:
        threading.Thread(target=self._accept, args=(check, welcome, name), daemon=True,
                         name="graphgen-channel").start()
        threading.Thread(target=self._ping, daemon=True, name="graphgen-heartbeat").start()

    def _accept(self, check, welcome, name) -> None:
        while not self._closed.is_set():
            try:
                conn = self._listener.accept()
            except (OSError, AuthenticationError):  # closed, or a peer without the key
                if self._closed.is_set():
                    return
                continue
            try:
                if not conn.poll(30):
                    conn.close()
                    continue
                kind, hello = conn.recv()
            except (EOFError, OSError, ValueError, TypeError):
                conn.close()
                continue
            problem = "expected a hello" if kind != "hello" else check(hello)
            member = hello.get("member", -1) if isinstance(hello, dict) else -1
            if problem is not None:
                try:
                    conn.send(("refused", problem))
                finally:
                    conn.close()
                self.joined.put(("refused", member, problem))
                continue
            conn.send(("welcome", welcome(hello)))
            link = NodeLink(conn, tuple(hello["ranks"]), name(member), clock=self._clock,
                            on_lost=lambda lost: self.on_lost(lost) if self.on_lost is not None else None)
            self.links.append(link)
            self.joined.put(("joined", member, link))

    def _ping(self) -> None:
        while not self._closed.wait(HEARTBEAT_S):
            for link in list(self.links):
                if not link.lost:
                    link.send(("ping",))

    def broadcast(self, msg) -> None:
        for link in self.links:
            if not link.lost:
                link.send(msg)

    def close(self, reason: Optional[str] = None) -> None:
        """Stop accepting; ``reason``: the engine failed (each follower is told, then its link closed)."""
        if self._closed.is_set():
            return
        self._closed.set()
        if reason is not None:
            self.broadcast(("abort", reason))
        for link in self.links:
            link.close()
        self._listener.close()


def connect_channel(address: tuple[str, int], key: bytes, deadline_s: float, *, retry_s: float = 0.2):
    """A follower's connection to the driver's channel, retried until ``deadline_s`` (node 0 may start
    later); None when it never answered. A wrong key raises `multiprocessing.AuthenticationError`."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            return Client(address, family="AF_INET", authkey=key)
        except OSError:  # nothing listens yet (refused), or the route is not up yet
            if time.monotonic() + retry_s > end:
                return None
            time.sleep(retry_s)
