"""How a weight's name says it is sharded: ``<checkpoint key>[d<dim>/<parts>]`` (the ``shard`` pass
writes these names into the graphs; a rank slices its checkpoint tensors by them). Here, in ``ir``,
because the passes, the lowering and the runtime's rank code all read the same convention."""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Iterable, Optional

if TYPE_CHECKING:
    from .graph import Graph

__all__ = ["parse_shard", "shard_index", "shard_name", "graph_weight_names"]

_SHARD = re.compile(r"^(?P<key>.+)\[d(?P<dim>\d+)/(?P<parts>\d+)\]$")


def shard_name(key: str, dim: int, parts: int) -> str:
    return key if parts == 1 else f"{key}[d{dim}/{parts}]"


def parse_shard(name: str) -> tuple[str, Optional[int], int]:
    """``(checkpoint key, dim, parts)`` of a weight name (``dim``/``parts`` None/1 when whole)."""
    m = _SHARD.match(name)
    if m is None:
        return name, None, 1
    return m["key"], int(m["dim"]), int(m["parts"])


def shard_index(rank: int, parts: int, tp: int) -> int:
    """Which chunk of a ``parts``-way split rank ``rank`` of ``tp`` holds."""
    return rank * parts // tp


def graph_weight_names(graphs: Iterable[Graph]) -> set[str]:
    """Every weight name (``w_*`` attribute value) the given graphs read."""
    return {v for g in graphs for n in g.nodes for k, v in n.attrs.items() if k.startswith("w_") and isinstance(v, str)}
