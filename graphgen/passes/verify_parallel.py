"""The verifier's parallel-rank checks (run by ``verify.check`` on graphs with ``meta tp``/``ep``).

What they prove, on the one graph every rank runs:

- **collectives are forward work**: every ``all_reduce``/``all_gather`` is on the main stream (never
  on the save stream or the host, whose work is not issued in the same order on every rank), in
  group ``tp`` with ``size`` = the graph's ``tp``;
- **no rank-dependent graph**: no attribute names a rank (the rank enters only at run time, through
  the weights' slices), and the main stream has no data-dependent control flow, so every rank runs
  the same graph. That the ranks then really issue the same collectives in the same order is checked
  at run time, by recording what each rank process issues (tests/parallel/test_parallel_collectives.py);
- **no partial sum escapes**: the output of a row-parallel op (``PARTIAL_OPS``) is read only by an
  ``all_reduce`` with ``reduce=sum``, and the local logits of a sharded LM head only by an
  ``all_gather``; so deleting a collective (or wiring around it) fails here as well as in the
  data-flow check;
- **expected collectives**: one all_reduce after the embedding, two per layer, one all_gather at the
  end (a golden with a collective line deleted or duplicated fails).
Pure Python, no torch.
"""

from __future__ import annotations

from ..ir.graph import MAIN_STREAM, Graph
from ..ir.ops import COLLECTIVE_OPS, PARTIAL_OPS

_RANK_WORDS = ("rank", "tp_rank", "ep_rank")


def parallel_problems(graph: Graph) -> list[str]:
    tp = graph.meta.get("tp", 1)
    problems: list[str] = []
    colls = [n for n in graph.nodes if n.op in COLLECTIVE_OPS]
    if tp == 1 and graph.meta.get("ep", 1) == 1:
        return [f"collective {n.id} in a single-rank graph (meta has no tp)" for n in colls]
    for n in graph.nodes:
        bad = [k for k in n.attrs if k in _RANK_WORDS]
        if bad:
            problems.append(f"node {n.id} has rank-dependent attribute(s) {', '.join(bad)}: graphs must be "
                            f"the same on every rank")
    for n in colls:
        if n.stream != MAIN_STREAM:
            problems.append(f"collective {n.id} is on stream {n.stream}: collectives belong on {MAIN_STREAM} "
                            f"(every rank issues them in forward order)")
        if n.attrs.get("group") != "tp" or n.attrs.get("size") != tp:
            problems.append(f"collective {n.id}: group {n.attrs.get('group')!r} size {n.attrs.get('size')!r}, "
                            f"expected group 'tp' size {tp}")
    readers: dict[str, list] = {}
    for n in graph.nodes:
        for r in n.reads:
            readers.setdefault(r, []).append(n)
    for n in graph.nodes:
        sharded_head = n.op == "lm_head" and str(n.attrs.get("w_head", "")).endswith(f"/{tp}]")
        if n.op not in PARTIAL_OPS and not sharded_head:
            continue
        want = ("all_gather", None) if sharded_head else ("all_reduce", "sum")
        out = n.writes[0]
        users = readers.get(out, [])
        if not users:
            problems.append(f"partial result {out} of {n.id} is never reduced: missing {want[0]} after {n.id}")
        for u in users:
            if u.op != want[0] or (want[1] and u.attrs.get("reduce") != want[1]):
                problems.append(f"partial result {out} of {n.id} is read by {u.id} ({u.op}) before an {want[0]}")
    layers = graph.meta.get("layers", 0)
    n_reduce = sum(1 for n in colls if n.op == "all_reduce")
    n_gather = sum(1 for n in colls if n.op == "all_gather")
    if n_reduce != 1 + 2 * layers or n_gather != 1:
        problems.append(f"collectives: {n_reduce} all_reduce and {n_gather} all_gather, expected "
                        f"{1 + 2 * layers} all_reduce (embedding + 2 per layer) and 1 all_gather (LM head)")
    return problems
