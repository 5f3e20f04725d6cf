"""KV block pools behind one small contract (`base.PoolBackend`), torch-free.

Backends: `host.HostPool` (embedded, the default), `mooncake.MooncakePool` (Mooncake Store, the
distributed pool; needs the ``mooncake`` extra), `shared.RemotePool` (the host pool shared by rank
processes), `faulty.FaultyPool` (injected put faults). `make_pool` builds one from a ``--pool`` URL.
"""
from __future__ import annotations

from urllib.parse import urlsplit

from ...install import require
from .base import PoolBackend, count_leading
from .host import HostPool
from .keys import KEY_SEP, BlockKey, KVShard, block_keys

__all__ = ["DEFAULT_POOL_BYTES", "BlockKey", "HostPool", "KEY_SEP", "KVShard", "PoolBackend", "block_keys",
           "count_leading", "make_pool"]

# the embedded pool's capacity when none is given (engines, ranks' shared pool, `graphgen run`)
DEFAULT_POOL_BYTES = 256 << 20


def make_pool(url: str, *, capacity_bytes: int = DEFAULT_POOL_BYTES) -> PoolBackend:
    """``host`` -> the embedded ``HostPool(capacity_bytes)``; ``mooncake://HOST:PORT[?opt=v&...]``
    -> a ``MooncakePool`` on that master (options: see ``MooncakeOptions._URL_NAMES``). Mooncake is
    imported only for a ``mooncake://`` URL, so the embedded pool needs no optional package."""
    if url == "host":
        return HostPool(capacity_bytes)
    if url.startswith("mooncake://"):
        parts = urlsplit(url)
        if not parts.hostname or parts.port is None or parts.path not in ("", "/"):
            raise ValueError(f"bad pool URL {url!r}: expected mooncake://HOST:PORT[?option=value]")
        require("mooncake", "--pool mooncake://")  # one sentence naming the extra, not a bare ImportError
        from .mooncake import MooncakeOptions, MooncakePool

        return MooncakePool(f"{parts.hostname}:{parts.port}", MooncakeOptions.from_query(parts.query))
    raise ValueError(f"unknown pool {url!r}: expected 'host' (the embedded pool) or "
                     f"'mooncake://HOST:PORT' (a Mooncake master, see docs/mooncake.md)")
