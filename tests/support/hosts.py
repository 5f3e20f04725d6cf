"""Several "hosts" on one machine, for multi-node tests: network namespaces joined by a veth pair
(`TwoHosts`) or, for more than two, each joined by its own veth pair to a bridge in a namespace of its own
(`SwitchedHosts`: the "switch").

Namespaces get unique names (``gg<tag><suffix>``: the pid and a random tag, so concurrent runs never meet)
and the addresses given (default `ADDRESSES`; all in 192.0.2.0/24, TEST-NET-1: a documentation range nothing
routes; each namespace has only its loopback and its end of a pair, so nothing else is ever addressed).
Every process a test starts in one (`Host.start`) is tracked; ``close`` kills them and whatever else still
runs in the namespaces, then deletes them all (the veth pairs and the bridge go with them). Use it as a
fixture whose finalizer calls ``close``, so a failing test leaves nothing behind (`leftover_namespaces`
checks). Needs root (CAP_SYS_ADMIN) and iproute2.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys

from .netns import _Proc

__all__ = ["TwoHosts", "SwitchedHosts", "Host", "ADDRESSES", "leftover_namespaces"]

ADDRESSES = ("192.0.2.1", "192.0.2.2")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


class Host:
    """One namespace: ``name`` (also its veth end's name), ``addr``."""

    def __init__(self, name: str, addr: str, logdir: str):
        self.name, self.addr, self.logdir = name, addr, logdir
        self.procs: list[_Proc] = []

    def argv(self, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.name, *args]

    def start(self, *args: str, log: str) -> _Proc:
        """``args`` in this namespace (its own session: `_Proc.kill` ends its process group); stdout
        lines readable with ``wait_line``, stderr to ``<logdir>/<log>.log``."""
        p = _Proc(self.argv(*args), log=open(os.path.join(self.logdir, log + ".log"), "a"))
        p.log = log  # type: ignore[attr-defined]  (`Host.log(p.log)`: its stderr so far)
        self.procs.append(p)
        return p

    def graphgen(self, *args: str, log: str) -> _Proc:
        return self.start(sys.executable, "-m", "graphgen", *map(str, args), log=log)

    def kill_all(self) -> None:
        """The host dies: SIGKILL to every process in the namespace (a launcher may have put its children
        in sessions of their own, as torchrun does)."""
        for pid in _ip("netns", "pids", self.name, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass

    def rx_bytes(self) -> int:
        """Bytes received on this end of the veth pair so far."""
        out = _ip("-n", self.name, "-s", "-o", "link", "show", self.name).stdout
        # "... RX: bytes packets ... \\    <bytes> <packets> ..."
        fields = out.split("RX:")[1].split("\\")[1].split()
        return int(fields[0])

    def log(self, name: str) -> str:
        path = os.path.join(self.logdir, name + ".log")
        return open(path).read() if os.path.exists(path) else ""


class _Namespaces:
    """Namespaces made by this process (``hosts`` plus any other, e.g. the switch): ``close`` removes them."""

    hosts: list[Host]
    others: list[str]

    def _tag(self) -> str:
        if shutil.which("ip") is None:
            raise RuntimeError("the multi-node tests need `ip` (iproute2) and root to make network namespaces")
        self.hosts, self.others = [], []
        return f"{os.getpid() % 0xffff:04x}{secrets.token_hex(2)}"

    def _made(self, build, what: str) -> None:
        try:
            build()
        except (subprocess.CalledProcessError, OSError) as e:
            self.close()
            detail = e.stderr.strip() if isinstance(e, subprocess.CalledProcessError) else str(e)
            raise RuntimeError(f"could not make {what} (needs root): {detail}") from None

    def _address(self, h: Host) -> None:
        _ip("-n", h.name, "addr", "add", f"{h.addr}/24", "dev", h.name)
        _ip("-n", h.name, "link", "set", h.name, "up")
        _ip("-n", h.name, "link", "set", "lo", "up")

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.hosts] + self.others

    def close(self) -> None:
        """Kill every process started in any namespace (and any other left in them), delete them all."""
        for h in self.hosts:
            for p in reversed(h.procs):
                p.kill()
            h.kill_all()
        for name in self.names:
            _ip("netns", "del", name, check=False)


class TwoHosts(_Namespaces):
    """Two namespaces (suffixes ``a``, ``b``) joined by one veth pair."""

    def __init__(self, logdir: str, addresses: tuple[str, str] = ADDRESSES):
        tag = self._tag()
        self.hosts = [Host(f"gg{tag}{s}", addr, logdir) for s, addr in zip("ab", addresses)]
        a, b = self.hosts

        def build():
            for h in self.hosts:
                _ip("netns", "add", h.name)
            _ip("link", "add", a.name, "type", "veth", "peer", "name", b.name)
            for h in self.hosts:
                _ip("link", "set", h.name, "netns", h.name)
                self._address(h)

        self._made(build, "two network namespaces joined by a veth pair")


class SwitchedHosts(_Namespaces):
    """``len(addresses)`` namespaces (suffixes ``a``, ``b``, ...), each its veth pair's one end, the other end
    in the switch namespace (``gg<tag>sw``) on its bridge: every host reaches every other on one /24."""

    def __init__(self, logdir: str, addresses: tuple[str, ...]):
        if not 2 <= len(addresses) <= 26:
            raise ValueError(f"2 to 26 hosts, got {len(addresses)}")
        tag = self._tag()
        switch = f"gg{tag}sw"
        self.hosts = [Host(f"gg{tag}{chr(97 + i)}", addr, logdir) for i, addr in enumerate(addresses)]

        def build():
            _ip("netns", "add", switch)
            self.others.append(switch)
            _ip("-n", switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", switch, "link", "set", "br0", "up")
            for i, h in enumerate(self.hosts):
                _ip("netns", "add", h.name)
                _ip("link", "add", h.name, "netns", h.name, "type", "veth", "peer", "name", f"port{i}",
                    "netns", switch)
                _ip("-n", switch, "link", "set", f"port{i}", "master", "br0")
                _ip("-n", switch, "link", "set", f"port{i}", "up")
                self._address(h)

        self._made(build, f"{len(addresses)} network namespaces on a bridge")


def leftover_namespaces(hosts: _Namespaces) -> list[str]:
    """Which of ``hosts``' namespaces still exist (after ``close``: none)."""
    listed = {line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines() if line.strip()}
    return [n for n in hosts.names if n in listed]
