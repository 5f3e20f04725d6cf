"""`MooncakeOptions`: a Mooncake client's settings, and their ``mooncake://HOST:PORT?name=value&...``
URL form (`graphgen.runtime.pool.make_pool`); what each one does to the store is `MooncakePool`'s
(`graphgen.runtime.pool.mooncake`) and docs/mooncake.md's "URL and options"."""
from __future__ import annotations

import dataclasses
from typing import Any
from urllib.parse import parse_qsl

from .codec import HEADER, parse_size

__all__ = ["MooncakeOptions"]


@dataclasses.dataclass(frozen=True)
class MooncakeOptions:
    """Client options. ``segment_bytes``: storage this process contributes to the pool (0: none,
    blocks go to other clients' segments, e.g. ``mooncake_server``'s; Mooncake needs >= 16 MiB when
    not 0). ``buffer_bytes``: each of the two registered buffers (put, get) that zero-copy
    transfers go through; a value larger than it is refused. ``local_buffer_bytes``: Mooncake's own
    staging buffer (for plain get/put). ``layout``: text mixed into every value's fingerprint
    (the caller's model / block size / dtype / shapes); the key's ``model@layout@rank`` part is
    always mixed in."""
    segment_bytes: int = 0
    buffer_bytes: int = 64 << 20
    local_buffer_bytes: int = 16 << 20
    protocol: str = "tcp"
    metadata: str = "P2PHANDSHAKE"
    local_hostname: str = "127.0.0.1"
    device: str = ""
    layout: str = ""
    max_backoff_s: float = 8.0
    probe_timeout_s: float = 0.5

    def __post_init__(self):
        if self.segment_bytes and self.segment_bytes < 16 << 20:
            raise ValueError(f"segment_bytes must be 0 or >= 16 MiB (Mooncake's minimum), "
                             f"got {self.segment_bytes}")
        if self.buffer_bytes < HEADER.size + 1:
            raise ValueError(f"buffer_bytes too small: {self.buffer_bytes}")
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"protocol must be tcp or rdma, got {self.protocol!r}")

    _URL_NAMES = {"segment": "segment_bytes", "buffer": "buffer_bytes",
                  "local_buffer": "local_buffer_bytes", "protocol": "protocol",
                  "metadata": "metadata", "local_hostname": "local_hostname", "device": "device",
                  "layout": "layout", "max_backoff": "max_backoff_s"}

    @classmethod
    def from_query(cls, query: str) -> "MooncakeOptions":
        kw: dict[str, Any] = {}
        for name, value in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
            field = cls._URL_NAMES.get(name)
            if field is None:
                raise ValueError(f"unknown mooncake pool option {name!r}; known: "
                                 + ", ".join(sorted(cls._URL_NAMES)))
            if field in kw:
                raise ValueError(f"mooncake pool option {name!r} given twice")
            kw[field] = (parse_size(value) if field.endswith("_bytes") else
                         float(value) if field.endswith("_s") else value)
        return cls(**kw)
