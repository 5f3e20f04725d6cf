"""Where the ranks of a layout run: one node, or several (``--nnodes N --node-rank R --master-addr A
--master-port P``, torchrun's names and meaning; or the environment torchrun gives each process).

A `Placement` is what one ``graphgen run``/``serve`` process hosts: its ranks, its node, and the master
address every node reaches. The process on node 0 is the **driver** (`graphgen.runtime.parallel.launcher`):
it drives the engine (and serves HTTP), hosts the rendezvous store, the shared host pool and the command
channel, all on the master address; every other process is a **follower** (`graphgen.runtime.parallel.follower`)
that starts its node's ranks and relays the driver's commands to them (docs/parallel.md, "Ranks across
nodes", says why). Ports on the master address: P the rendezvous store (torch.distributed's TCPStore; under
torchrun, torchrun's own), P + 1 the command channel, P + 2 the shared host pool.

Rank order across nodes: node-major (node ``n`` holds ranks ``n·L … n·L + L - 1``, ``L`` = world / nnodes),
so a TP group (innermost) stays on one node. Under torchrun each process is one rank (``RANK``; its device
``LOCAL_RANK``); the process of ``RANK`` 0 drives, the others follow, each hosting its one rank.

Nothing here binds: `interface_towards` names the network interface a node's ranks use to reach the
master (gloo binds that interface's address, ``GLOO_SOCKET_IFNAME``), never a wildcard. Pure Python.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import ipaddress
import os
import socket
import struct
from typing import Mapping, Optional

__all__ = ["Placement", "TORCHRUN_VARS", "interface_towards", "cluster_key", "spec_digest", "KEY_ENV",
           "DEFAULT_MASTER_PORT", "MOONCAKE_SCHEME", "node_pool_url", "pool_difference"]

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
KEY_ENV = "GRAPHGEN_CLUSTER_KEY"  # the same secret on every node: authenticates the command channel
DEFAULT_MASTER_PORT = 29500  # torchrun's


@dataclasses.dataclass(frozen=True)
class Placement:
    """The ranks one process hosts (``ranks``, with the device index of the first: ``local_rank``) of a
    ``world`` spread over ``nnodes`` nodes of ``local_world`` ranks each; ``torchrun``: its environment
    placed this process (one rank each)."""
    world: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # one node: the driver picks free ports
    ranks: tuple[int, ...] = ()
    local_rank: int = 0
    torchrun: bool = False

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1 or self.torchrun

    @property
    def driver(self) -> bool:
        """This process drives the engine (node 0's, or under torchrun RANK 0's)."""
        return 0 in self.ranks

    @property
    def local_world(self) -> int:
        return self.world // self.nnodes

    @property
    def store_port(self) -> int:
        return self.master_port

    @property
    def channel_port(self) -> int:
        return self.master_port + 1

    @property
    def pool_port(self) -> int:
        return self.master_port + 2

    def device_index(self, rank: int) -> int:
        """The device (local rank) of ``rank``, a rank this process hosts."""
        return self.local_rank + self.ranks.index(rank)

    def members(self) -> dict[int, tuple[int, ...]]:
        """The followers the driver waits for: member id (node rank; under torchrun the rank) -> its ranks."""
        if self.torchrun:
            return {r: (r,) for r in range(1, self.world)}
        n = self.local_world
        return {k: tuple(range(k * n, (k + 1) * n)) for k in range(1, self.nnodes)}

    def describe(self, member: int) -> str:
        """``node 1 (ranks 2-3)`` / under torchrun ``rank 3``: how sentences name a member."""
        if self.torchrun:
            return f"rank {member}"
        ranks = self.members().get(member, self.ranks)
        span = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
        return f"node {member} ({span})"

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def single(cls, world: int) -> "Placement":
        return cls(world, ranks=tuple(range(world)))

    @classmethod
    def of(cls, world: int, *, nnodes: int = 1, node_rank: int = 0, master_addr: str = "127.0.0.1",
           master_port: int = DEFAULT_MASTER_PORT, environ: Optional[Mapping[str, str]] = None) -> "Placement":
        """The placement from the flags, or from torchrun's environment when it set one (``environ``:
        default ``os.environ``). ValueError (one sentence naming the flag) for one that cannot be."""
        env = os.environ if environ is None else environ
        if all(v in env for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK")):
            if nnodes != 1 or node_rank != 0:
                raise ValueError("--nnodes/--node-rank are torchrun's when torchrun launched this process "
                                 "(its RANK/GROUP_RANK are set): drop them")
            return cls._torchrun(world, env)
        if nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {nnodes}")
        if not 0 <= node_rank < nnodes:
            raise ValueError(f"--node-rank must be in [0, {nnodes}) for --nnodes {nnodes}, got {node_rank}")
        if nnodes == 1:
            return cls.single(world)
        if world % nnodes:
            raise ValueError(f"the layout has {world} rank(s) (dp x cp x tp), which --nnodes {nnodes} does not "
                             f"divide: each node runs world / nnodes ranks")
        _check_address(master_addr, master_port)
        n = world // nnodes
        return cls(world, nnodes, node_rank, master_addr, master_port, tuple(range(node_rank * n, (node_rank + 1) * n)))

    @classmethod
    def _torchrun(cls, world: int, env: Mapping[str, str]) -> "Placement":
        try:
            rank, size, local, local_size, group = (int(env[k]) for k in
                                                    ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"))
        except (KeyError, ValueError):
            raise ValueError(f"torchrun's environment is incomplete or not integers: "
                             f"{ {k: env.get(k) for k in TORCHRUN_VARS} }") from None
        if size != world:
            raise ValueError(f"torchrun started {size} processes (WORLD_SIZE) but the layout has {world} ranks "
                             f"(dp x cp x tp): give torchrun --nnodes x --nproc-per-node = {world}")
        if size % local_size:
            raise ValueError(f"WORLD_SIZE {size} is not a multiple of LOCAL_WORLD_SIZE {local_size}")
        addr, port = env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", DEFAULT_MASTER_PORT))
        _check_address(addr, port)
        return cls(world, size // local_size, group, addr, port, (rank,), local, torchrun=True)


def _check_address(addr: str, port: int) -> None:
    try:
        ipaddress.IPv4Address(addr)
    except ValueError:
        raise ValueError(f"--master-addr {addr!r}: an IPv4 address of node 0 (graphgen binds only the address "
                         f"it is given, never a wildcard)") from None
    if not 1 <= port <= 65535 - 2:
        raise ValueError(f"--master-port {port}: must be in [1, 65533] (the command channel and the pool take "
                         f"the next two ports)")


def cluster_key(placement: Placement, environ: Optional[Mapping[str, str]] = None) -> bytes:
    """The command channel's authentication key: ``$GRAPHGEN_CLUSTER_KEY`` (the same secret on every
    node), else one derived from the master address, which only keeps separate clusters apart (as open
    as torch.distributed's own rendezvous store on the master port, which has no authentication)."""
    env = os.environ if environ is None else environ
    secret = env.get(KEY_ENV) or f"graphgen:{placement.master_addr}:{placement.master_port}"
    return hashlib.sha256(secret.encode()).digest()


_SIOCGIFADDR = 0x8915


def _ipv4_of(name: str) -> Optional[str]:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:  # no IPv4 address on it
            return None
    return socket.inet_ntoa(raw[20:24])


def interface_towards(master_addr: str) -> tuple[str, str]:
    """``(interface, address)`` this host reaches ``master_addr`` through (the route's source address
    and the interface holding it): what gloo binds (``GLOO_SOCKET_IFNAME``). Nothing is sent."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((master_addr, 9))  # a UDP "connect" only picks the route
        except OSError as e:
            raise ValueError(f"--master-addr {master_addr}: no route from this host ({e})") from None
        mine = s.getsockname()[0]
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == mine:
            return name, mine
    raise ValueError(f"--master-addr {master_addr}: this host reaches it from {mine}, which no interface holds")


def spec_digest(spec) -> str:
    """What every node must run alike: the spec with its overrides (a frozen dataclass of plain values:
    its repr is the same on every node running the same code)."""
    return hashlib.sha256(repr(spec).encode()).hexdigest()[:16]


MOONCAKE_SCHEME = "mooncake://"  # every rank its own Mooncake client (its own segment and registered buffers)
# a Mooncake URL's options that name the node it runs on: every other part must be the same on every node
NODE_OWN_OPTIONS = ("local_hostname", "device")


def pool_difference(ours, theirs) -> Optional[str]:
    """Why two nodes' ``--pool`` values are not one pool (a phrase), or None: both ``host``, or Mooncake URLs
    naming the same master with the same options but for each node's own address and device
    (`NODE_OWN_OPTIONS`)."""
    if ours == theirs:
        return None
    if not (isinstance(ours, str) and isinstance(theirs, str) and ours.startswith(MOONCAKE_SCHEME)
            and theirs.startswith(MOONCAKE_SCHEME)):
        return f"node 0 has --pool {ours}, this node --pool {theirs} (give every node the same pool)"
    import dataclasses
    from urllib.parse import urlsplit

    from ..pool.mooncake_options import MooncakeOptions  # torch-free

    a, b = urlsplit(ours), urlsplit(theirs)
    if (a.hostname, a.port) != (b.hostname, b.port):
        return (f"node 0's Mooncake master is {a.hostname}:{a.port}, this node's {b.hostname}:{b.port} "
                f"(every node names the one master)")
    try:
        oa, ob = MooncakeOptions.from_query(a.query), MooncakeOptions.from_query(b.query)
    except ValueError as e:
        return f"--pool {theirs}: {e}"
    for f in dataclasses.fields(MooncakeOptions):
        if f.name not in NODE_OWN_OPTIONS and getattr(oa, f.name) != getattr(ob, f.name):
            return (f"its Mooncake option {f.name} is {getattr(ob, f.name)!r}, node 0's {getattr(oa, f.name)!r} "
                    f"(only {' and '.join(NODE_OWN_OPTIONS)} may differ between nodes)")
    return None


def node_pool_url(pool, here: Placement):
    """The pool URL this node's rank processes (and, on node 0, the driver) open: a Mooncake URL without
    ``local_hostname`` gets this node's address towards the master when the ranks span nodes (Mooncake's
    default, 127.0.0.1, is unreachable from the other nodes); anything else as given."""
    if not (here.multi_node and isinstance(pool, str) and pool.startswith(MOONCAKE_SCHEME)):
        return pool
    from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

    parts = urlsplit(pool)
    query = parse_qsl(parts.query, keep_blank_values=True)
    if any(name == "local_hostname" for name, _ in query):
        return pool
    query.append(("local_hostname", interface_towards(here.master_addr)[1]))
    return urlunsplit(parts._replace(query=urlencode(query)))
