"""Two "hosts" on one machine: two network namespaces joined by a veth pair, for multi-node tests.

`TwoHosts` creates ``ip netns`` namespaces with unique names (``gg<tag>a``/``gg<tag>b``: the pid and a
random tag, so concurrent runs never meet), a veth pair between them and the addresses of
`ADDRESSES` (192.0.2.0/24, TEST-NET-1: a documentation range nothing routes; each namespace has only
its loopback and its end of the pair, so nothing else is ever addressed). Every process a test starts
in one (`Host.start`) is tracked; `TwoHosts.close` kills them and whatever else still runs in the
namespaces, then deletes both (the veth pair goes with them). Use it as a fixture whose finalizer
calls `close`, so a failing test leaves nothing behind. Needs root (CAP_SYS_ADMIN) and iproute2.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys

from .netns import _Proc

__all__ = ["TwoHosts", "Host", "ADDRESSES"]

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


class TwoHosts:
    def __init__(self, logdir: str):
        for tool in ("ip",):
            if shutil.which(tool) is None:
                raise RuntimeError("the multi-node tests need `ip` (iproute2) and root to make network namespaces")
        tag = f"{os.getpid() % 0xffff:04x}{secrets.token_hex(2)}"
        self.hosts = [Host(f"gg{tag}{s}", addr, logdir) for s, addr in zip("ab", ADDRESSES)]
        a, b = self.hosts
        try:
            for h in self.hosts:
                _ip("netns", "add", h.name)
            _ip("link", "add", a.name, "type", "veth", "peer", "name", b.name)
            for h in self.hosts:
                _ip("link", "set", h.name, "netns", h.name)
                _ip("-n", h.name, "addr", "add", f"{h.addr}/24", "dev", h.name)
                _ip("-n", h.name, "link", "set", h.name, "up")
                _ip("-n", h.name, "link", "set", "lo", "up")
        except (subprocess.CalledProcessError, OSError) as e:
            self.close()
            detail = e.stderr.strip() if isinstance(e, subprocess.CalledProcessError) else str(e)
            raise RuntimeError(f"could not make two network namespaces joined by a veth pair (needs root): "
                               f"{detail}") from None

    def close(self) -> None:
        """Kill every process started in either namespace (and any other left in them), delete both."""
        for h in self.hosts:
            for p in reversed(h.procs):
                p.kill()
            h.kill_all()
            _ip("netns", "del", h.name, check=False)
