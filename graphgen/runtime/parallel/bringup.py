"""What the driver makes and checks before its ranks start (split from `graphgen.runtime.parallel.launcher`,
which drives them): the layout check against the one refusal table and the pool a rank process can open, the
CPU sources compiled once for every rank, the rendezvous store, the shared host pool's process, and the check
of a follower node's hello."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Optional

from ..pool.shared import RemotePool, connect_pool, serve_pool
from .cluster import MOONCAKE_SCHEME, Placement, node_pool_url, pool_difference, spec_digest
from .procs import _child
from .rank import RANK_TARGETS
from .rank_process import SHARED_SCHEME
from ...netutil import bind_socket, free_port



class RankFailure(RuntimeError):
    """A rank process died, raised, or did not answer in time."""


def _compile_once(spec, spec_file: str) -> tuple[dict[str, str], set[str]]:
    """(variant -> CPU source, the weight names those graphs read), compiled here once for every rank
    (the rank module differs per rank only in the ``rt.rank`` its runtime holds, not in its code)."""
    from ...ir.weights import graph_weight_names
    from ...lower.compile import compile_spec

    compiled = compile_spec(spec, spec_file=spec_file, targets=("cpu",))
    sources = {c.variant: next(iter(c.sources.values())) for c in compiled}
    return sources, graph_weight_names(c.graph for c in compiled)


def _checked(spec, weights, pool, target: str):
    """(the rank builder's name, the weights as the ranks get them) for a layout the ranks can run;
    ValueError naming what cannot be."""
    from ...families.parallel import layout_rules, runtime_layout_gap

    if target not in RANK_TARGETS:
        raise ValueError(f"no rank builder for target {target!r}: expected one of {sorted(RANK_TARGETS)}")
    # a --tp/--ep override is checked here (the loader checked the file's own layout)
    problems = list(layout_rules(spec.family, spec.dims, spec.parallel, mtp=spec.mtp is not None))
    if problems:
        raise ValueError("; ".join(f"{where}: {msg} (fix: {fix})" for where, msg, fix in problems))
    gap = runtime_layout_gap(spec.parallel, target, mtp=spec.mtp is not None)  # the one table of what ranks cannot run
    if gap is not None:
        raise ValueError(gap)
    if weights is None:
        raise ValueError("weights are required: a Hugging Face checkpoint folder or a dict of tensors")
    if pool != "host" and not (isinstance(pool, str) and pool.startswith(MOONCAKE_SCHEME)):
        # a pool object lives in this process: a rank process cannot use it (it opens its own from a URL)
        raise ValueError(f"parallel ranks take pool='host' (the embedded pool, shared by the ranks) or a "
                         f"'mooncake://HOST:PORT' URL (each rank its own Mooncake client), got {pool!r}")
    if pool != "host":  # the URL is checked here (one sentence), not in every rank process
        from ...install import require
        from ..pool.mooncake_options import MooncakeOptions
        from urllib.parse import urlsplit

        parts = urlsplit(pool)
        if not parts.hostname or parts.port is None or parts.path not in ("", "/"):
            raise ValueError(f"bad pool URL {pool!r}: expected mooncake://HOST:PORT[?option=value]")
        MooncakeOptions.from_query(parts.query)
        require("mooncake", "--pool mooncake:// with ranks")
    return target, weights if isinstance(weights, dict) else str(weights)  # (open_engine checked its config.json)


def _host_store(host: str, port: int, timeout_s: float):
    """The ranks' rendezvous store (torch.distributed's TCPStore), listening on ``host`` only: given a
    socket bound there (TCPStore's own listener takes every address). ``port`` 0: a free one."""
    import datetime

    import torch.distributed as dist

    sock, problem = bind_socket(host, port)
    if sock is None:
        raise ValueError(f"the rendezvous store {problem}: --master-addr must be this node's address and "
                         f"--master-port free")
    sock.listen(1024)
    bound = sock.getsockname()[1]
    return dist.TCPStore(host, bound, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False, master_listen_fd=sock.detach())  # the store owns it now


def _start_pool(ctx, env: dict, capacity: int, address, authkey: bytes, timeout: float):
    """The shared host pool's process, serving on ``address`` once it returns."""
    ready = ctx.Event()
    proc = ctx.Process(target=_child, args=(env, serve_pool, capacity, address, authkey, ready), daemon=True,
                       name="graphgen-pool")
    proc.start()
    deadline = time.monotonic() + timeout
    while not ready.wait(0.05):
        if not proc.is_alive() or time.monotonic() > deadline:
            proc.kill()
            raise RankFailure(f"the shared pool process did not start (exit code {proc.exitcode}); "
                              f"a script that starts ranks needs an `if __name__ == '__main__':` guard")
    return proc


def _check_hello(hello: dict, here: Placement, spec, members: dict, pool="host") -> Optional[str]:
    """Why a follower cannot join (one sentence), or None. It must be an expected node, hosting that
    node's ranks, for the same layout and spec (and settings) as this one, on the same pool (``pool``: this
    node's ``--pool``; a Mooncake URL may differ in the node's own address only)."""
    member = hello.get("member", -1)
    if member not in members or tuple(hello.get("ranks", ())) != members[member]:
        return (f"a follower announced itself as node/rank {member} hosting ranks {hello.get('ranks')}, which "
                f"this cluster of {here.nnodes} node(s) x {here.local_world} rank(s) does not have")
    if hello.get("spec") != spec_digest(spec):
        return (f"{here.describe(member)} runs {hello.get('spec_name')!r} with another layout or settings than "
                f"node 0 ({spec.name!r}): every node must be given the same spec and flags")
    different = pool_difference(pool, hello.get("pool", "host"))
    if different is not None:
        return f"{here.describe(member)} is on another pool than node 0: {different}"
    return None


def _start_host_pool(ctx, env: dict, pool, host: str, here: Placement, authkey: bytes, capacity: int,
                     timeout: float) -> tuple[Optional[mp.process.BaseProcess], Optional[RemotePool], str]:
    """(the pool's process, this process's client, the URL every rank opens): with ``pool="host"`` the embedded
    pool, one process every rank of every node reaches; with a Mooncake URL nothing here (each rank process
    opens its own client from the URL)."""
    if pool != "host":
        return None, None, node_pool_url(pool, here)
    address = (host, here.pool_port if here.multi_node else free_port(host))
    proc = _start_pool(ctx, env, capacity, address, authkey, timeout)
    return proc, connect_pool(address, authkey), f"{SHARED_SCHEME}{address[0]}:{address[1]}"

