"""The pass pipeline: one explicit list, the same for every variant.

    build_layers -> insert_kv_save -> insert_events -> verify

``run_pipeline`` can stop after any pass (``graphgen dump --after PASS``), re-verify structure
after every pass (tests), and reports a failure with the pass's name and the passes before it.
"""

from __future__ import annotations

from typing import Callable, Optional

from ..ir.graph import Graph
from .base import PassContext, PassError
from .build_layers import BuildLayers
from .insert_events import InsertEvents
from .insert_kv_save import InsertKvSave
from .verify import Verify

PIPELINE = (BuildLayers(), InsertKvSave(), InsertEvents(), Verify())
PASS_NAMES = tuple(p.name for p in PIPELINE)


def run_pipeline(spec, variant_name: str, *, spec_file: str = "", until: Optional[str] = None,
                 on_pass: Optional[Callable[[str, Graph], None]] = None) -> Graph:
    """Build the verified graph of one variant (or the graph after pass ``until``)."""
    if until is not None and until not in PASS_NAMES:
        raise ValueError(f"unknown pass {until!r}; passes: {', '.join(PASS_NAMES)}")
    ctx = PassContext(spec=spec, variant_name=variant_name, spec_file=spec_file)
    graph = Graph(name=f"{spec.name}.{variant_name}")
    done: list[str] = []
    for p in PIPELINE:
        try:
            p.run(graph, ctx)
        except Exception as e:  # name the pass; keep the cause
            raise PassError(p.name, done, graph.name, e) from e
        done.append(p.name)
        if on_pass is not None:
            on_pass(p.name, graph)
        if p.name == until:
            break
    return graph
