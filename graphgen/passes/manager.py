"""The pass pipeline: the builder, then one explicit list of passes, the same for every variant.

    build -> insert_lora -> shard -> sequence_parallel -> context_parallel -> insert_kv_load -> insert_kv_save
          -> insert_events -> verify

(``insert_lora`` changes nothing without a ``lora:`` section; ``shard`` changes nothing unless the spec's ``parallel`` has tp, ep or dp > 1; ``sequence_parallel``
nothing unless it has ``sp``, ``context_parallel`` nothing unless ``cp`` > 1; ``insert_kv_load``
nothing unless the variant has ``history``.)

``run_pipeline`` can stop after any stage (``graphgen dump --after STAGE``; ``build_layers`` is kept
as another name of ``build``), and reports a failure with the pass's name and the stages before it.
In checked mode (``check=True``, the default; tests run it) every pass's ``requires`` runs before it
and its ``ensures`` after it, and every node is re-checked against its op schema after each stage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from ..families.build import build_graph
from ..ir.graph import Graph
from ..ir.ops import check_node
from .base import ContractError, PassContext, PassError
from .insert_events import InsertEvents
from .insert_kv_load import InsertKvLoad
from .insert_kv_save import InsertKvSave
from .insert_lora import InsertLora
from .context_parallel import ContextParallel
from .sequence_parallel import SequenceParallel
from .shard import Shard
from .verify import Verify

if TYPE_CHECKING:
    from ..modelspec.model import ModelSpec

BUILD = "build"
PIPELINE = (InsertLora(), Shard(), SequenceParallel(), ContextParallel(), InsertKvLoad(), InsertKvSave(), InsertEvents(), Verify())
PASS_NAMES = (BUILD, *(p.name for p in PIPELINE))  # the stages on_pass reports, in order
ALIASES = {"build_layers": BUILD}  # the builder's name when it was a pass
AFTER_CHOICES = (*PASS_NAMES, *ALIASES)  # what ``until`` (``graphgen dump --after``) accepts


def schema_problems(graph: Graph) -> list[str]:
    return [p for n in graph.nodes for p in check_node(n, graph.names)]


def run_pipeline(spec: ModelSpec, variant_name: str, *, spec_file: str = "", until: Optional[str] = None,
                 on_pass: Optional[Callable[[str, Graph], None]] = None, check: bool = True) -> Graph:
    """Build the verified graph of one variant (or the graph after stage ``until``)."""
    until = ALIASES.get(until, until) if until is not None else None
    if until is not None and until not in PASS_NAMES:
        raise ValueError(f"unknown pass {until!r}; passes: {', '.join(PASS_NAMES)}")
    ctx = PassContext(spec=spec, variant_name=variant_name, spec_file=spec_file)
    try:
        graph = build_graph(spec, variant_name, spec_file)
    except Exception as e:
        raise PassError(BUILD, [], f"{spec.name}.{variant_name}", e) from e
    done = [BUILD]
    if on_pass is not None:
        on_pass(BUILD, graph)
    if until == BUILD:
        return graph
    for p in PIPELINE:
        try:
            if check:
                _contract("requires", p.requires(graph, ctx))
            p.run(graph, ctx)
            if check:
                _contract("ensures", p.ensures(graph, ctx) + schema_problems(graph))
        except Exception as e:  # name the pass; keep the cause
            raise PassError(p.name, done, graph.name, e) from e
        done.append(p.name)
        if on_pass is not None:
            on_pass(p.name, graph)
        if p.name == until:
            break
    return graph


def _contract(which: str, problems: list[str]) -> None:
    if problems:
        raise ContractError(which, problems)
