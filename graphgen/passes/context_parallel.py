"""Pass 4 of 8, ``context_parallel``: a prefill split over the CP ranks (``parallel.cp``), PCP-style.

What vLLM and vllm-ascend do for long prefill (not ring attention): the runner cuts each sequence's
new tokens into ``2 × cp`` chunks (sizes within one; the gather pads) and gives CP rank ``i`` chunks
``i`` and ``2 × cp - 1 - i`` (head-tail: every rank gets the same causal work); every op is per token
but attention, so the graph changes only around the KV:

- before each layer's ``kv_write`` its parts (Qwen3's K and V, MLA's latent and RoPE key) are
  all-gathered over the CP group (``all_gather`` group ``cp``, dim 0): every CP rank writes the whole
  step's KV into its cache (the runner's ``slot_mapping`` lists the slots in gathered order);
- attention then reads this rank's queries against the whole cache; the runner describes the two
  chunks of a sequence as two query ranges over the same block table (causal by position; the CPU
  ranks' runner: ``graphgen.runtime.parallel.context_parallel``).

The same holds for every chunk of a chunked prefill (the history variants: history KV is already in
every rank's cache), so the pass applies to every prefill variant, and to the MTP layer's graph
(``phase: mtp``): its draft runs are split head-tail like the prefill they follow (row t holds token
t+1, which every rank knows; the runner: `graphgen.runtime.parallel.context_parallel`), so its one
``kv_write`` is gathered the same way. **Decode** at ``cp > 1`` keeps
the KV replicated (every CP rank holds all of it, written by the prefill's gathers) and runs the
unchanged decode graph; interleaved-block sharding of decode KV (DCP) is not done (docs/parallel.md
says why). Replicated KV is saved once: ``insert_kv_save`` marks the saves ``writers=cp0``.

requires: no collective in group cp yet; ensures: each prefill (and MTP) kv_write reads only CP all-gathers,
and the parallel checks hold. With ``cp == 1`` the pass changes nothing. Pure Python, no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..ir.graph import MAIN_STREAM, Graph, Node
from ..ir.ops import COLLECTIVE_OPS
from .base import Pass, PassContext
# the phases whose steps the CP ranks split head-tail: the checker's constant (it reads them too, and must not
# import this pass, which calls it)
from .verify_parallel import SPLIT_PHASES

if TYPE_CHECKING:
    from ..modelspec.model import ModelSpec

CP_GROUP = "cp"


def cp_of(spec: ModelSpec) -> int:
    cp: int = getattr(getattr(spec, "parallel", None), "cp", 1)
    return cp


class ContextParallel(Pass):
    name = "context_parallel"

    def requires(self, graph: Graph, ctx: PassContext) -> list[str]:
        return [f"collective {n.id} is already in group {CP_GROUP}" for n in graph.nodes
                if n.op in COLLECTIVE_OPS and n.attrs.get("group") == CP_GROUP]

    def run(self, graph: Graph, ctx: PassContext) -> None:
        cp = cp_of(ctx.spec)
        if cp == 1:
            return
        graph.meta["cp"] = cp
        if ctx.variant.phase not in SPLIT_PHASES:
            return  # decode: KV replicated, the graph is the one every CP rank runs unchanged
        out: list[Node] = []
        for n in graph.nodes:
            if n.op == "kv_write":
                gathered = []
                for part in n.input("parts"):
                    whole = graph.declare(f"{part}.cp", "value")
                    out.append(Node(f"{n.id}.gather_{part.split('.')[0]}", "all_gather", MAIN_STREAM, reads=(part,),
                                    writes=(whole,), attrs={"group": CP_GROUP, "size": cp, "dim": 0, "length": None},
                                    layer=n.layer))
                    gathered.append(whole)
                out.append(Node(n.id, n.op, n.stream, (*gathered, n.input("slot_mapping")), n.writes, n.attrs, n.layer))
                continue
            out.append(n)
        graph.replace_nodes(out)

    def ensures(self, graph: Graph, ctx: PassContext) -> list[str]:
        if cp_of(ctx.spec) == 1:
            return []
        from .verify_parallel import parallel_problems

        return parallel_problems(graph)
