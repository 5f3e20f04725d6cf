"""The verifier's parallel-rank checks (run by ``verify.check`` on graphs with ``meta tp``/``ep``/``dp``).

What they prove, on the one graph every rank runs:

- **collectives are forward work**: every collective is on the main stream (never on the save stream
  or the host, whose work is not issued in the same order on every rank), in a group of the layout
  with its size: ``tp`` (size tp), ``dp`` (size dp: the MoE's token all-gather under DP attention),
  ``ep`` (size ep = dp × tp: the MoE's reduce-scatter under DP attention), ``cp`` (size cp: the
  prefill's KV all-gather);
- **no rank-dependent graph**: no attribute names a rank (the rank enters only at run time, through
  the weights' slices), and the main stream has no data-dependent control flow, so every rank runs
  the same graph. That the ranks then really issue the same collectives in the same order is checked
  at run time, by recording what each rank process issues (tests/parallel/test_parallel_collectives.py);
- **the same collectives in the same order**: the graph's collectives, in issue order, equal the
  sequence its compute ops ask for under the layout (:func:`expected_collectives`): one reduction
  after every partial sum (all_reduce, or reduce_scatter with ``sp``), an all-gather of the tokens
  after every norm under ``sp`` and before the LM head, the DP all-gather / EP reduce-scatter / TP
  all-gather around every MoE under ``dp`` (no TP all-gather with ``sp``: the residual stays sharded),
  the vocabulary all-gather after a sharded LM head. A golden
  with a collective line deleted, duplicated or moved fails here;
- **no partial sum escapes**: the output of a row-parallel op (``PARTIAL_OPS``) is read only by an
  ``all_reduce`` or ``reduce_scatter`` with ``reduce=sum``, and the local logits of a sharded LM head
  only by an ``all_gather``;
- **context parallel** (``cp``): every part a prefill's (or an MTP draft run's) ``kv_write`` writes is all-gathered over group
  ``cp`` first (each CP rank computed only its head-tail chunks), and the saves and the pool commit
  carry ``writers=cp0`` (KV is replicated over CP: one writer), never without CP;
- **no token shard escapes** (``sp``, ``dp``): a value holding 1/size of the step's tokens (a
  reduce-scatter's output, and the residual adds and norms computed from it) is read only by a
  residual add, a norm or the all-gather that restores the tokens; a residual add never mixes a shard
  with the whole; an MoE under DP attention reads the DP all-gather's tokens.
Pure Python, no torch.
"""

from __future__ import annotations

from typing import Any

from ..ir.graph import MAIN_STREAM, Graph, Node
from ..ir.ops import COLLECTIVE_OPS, PARTIAL_OPS

# the phases whose steps the CP ranks split head-tail (their kv_write gathered over cp; passes/context_parallel.py):
# a prompt's prefill and the MTP layer's draft runs (the verify and decode steps run unsplit and replicated)
SPLIT_PHASES = ("prefill", "mtp")

_RANK_WORDS = ("rank", "tp_rank", "ep_rank", "dp_rank", "cp_rank")
# ops that may read a token shard (they work row by row): the rest need every token of the step
_SHARD_READERS = ("residual_add", "rms_norm", "all_gather")


def _layout(graph: Graph) -> dict[str, Any]:
    m = graph.meta
    return {"tp": m.get("tp", 1), "ep": m.get("ep", 1), "dp": m.get("dp", 1), "cp": m.get("cp", 1),
            "sp": m.get("sp", False), "prefill": m.get("phase") in SPLIT_PHASES}


def _sharded_head(n: Node, tp: int) -> bool:
    return n.op == "lm_head" and tp > 1 and str(n.attrs.get("w_head", "")).endswith(f"/{tp}]")


def expected_collectives(graph: Graph) -> list[tuple[str, str]]:
    """``(op, group)`` of every collective the graph's compute ops need under its layout, in issue order."""
    lay = _layout(graph)
    tp, dp, sp = lay["tp"], lay["dp"], lay["sp"]
    reduce = ("reduce_scatter", "tp") if sp else ("all_reduce", "tp")
    out: list[tuple[str, str]] = []
    for n in graph.nodes:
        if n.op == "kv_write" and lay["cp"] > 1 and lay["prefill"]:
            out += [("all_gather", "cp")] * len(n.input("parts"))
        elif n.op == "moe" and dp > 1:
            # the TP all-gather back to the group's tokens, unless sp keeps the reduce-scatter's shard
            out += [("all_gather", "dp"), ("reduce_scatter", "ep")]
            out += [("all_gather", "tp")] if tp > 1 and not sp else []
        elif n.op in PARTIAL_OPS:
            out.append(reduce)
        elif n.op == "rms_norm" and sp:
            out.append(("all_gather", "tp"))
        elif n.op == "lm_head":
            out += ([("all_gather", "tp")] if sp else []) + ([("all_gather", "tp")] if _sharded_head(n, tp) else [])
    return out


def parallel_problems(graph: Graph) -> list[str]:
    lay = _layout(graph)
    tp = lay["tp"]
    sizes = {"tp": tp, "dp": lay["dp"], "ep": lay["ep"], "cp": lay["cp"]}
    problems: list[str] = []
    colls = [n for n in graph.nodes if n.op in COLLECTIVE_OPS]
    if tp == 1 and lay["ep"] == 1 and lay["dp"] == 1 and lay["cp"] == 1:
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
        group = n.attrs.get("group")
        if group not in sizes or n.attrs.get("size") != sizes[group] or sizes[group] == 1:
            problems.append(f"collective {n.id}: group {group!r} size {n.attrs.get('size')!r}, expected one of "
                            + ", ".join(f"group {g!r} size {s}" for g, s in sizes.items() if s > 1))
    readers: dict[str, list[Node]] = {}
    writer: dict[str, Node] = {}
    for n in graph.nodes:
        for r in n.reads:
            readers.setdefault(r, []).append(n)
        for w in n.writes:
            writer[w] = n
    for n in graph.nodes:
        sharded_head = _sharded_head(n, tp)
        if n.op not in PARTIAL_OPS and not sharded_head:
            continue
        out = n.writes[0]
        users = readers.get(out, [])
        want = "all_gather" if sharded_head else "all_reduce or reduce_scatter"
        if not users:
            problems.append(f"partial result {out} of {n.id} is never reduced: missing {want} after {n.id}")
        for u in users:
            ok = (u.op == "all_gather") if sharded_head else (
                u.op in ("all_reduce", "reduce_scatter") and u.attrs.get("reduce") == "sum")
            if not ok:
                problems.append(f"partial result {out} of {n.id} is read by {u.id} ({u.op}) before an {want}")
    problems += _token_shard_problems(graph, writer, lay)
    problems += _context_parallel_problems(graph, writer, lay)
    expected, got = expected_collectives(graph), [(n.op, str(n.attrs.get("group"))) for n in colls]
    if expected != got:
        first = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
        at = colls[first].id if first < len(colls) else "the end"
        problems.append(f"collectives: {len(got)} in the graph, expected {len(expected)} for its layout "
                        f"(tp={tp}, dp={lay['dp']}, ep={lay['ep']}, cp={lay['cp']}, sp={str(lay['sp']).lower()}); "
                        f"first "
                        f"difference at #{first + 1} ({at}): expected "
                        f"{' '.join(expected[first]) if first < len(expected) else 'none'}, got "
                        f"{' '.join(got[first]) if first < len(got) else 'none'}")
    return problems


def _token_shard_problems(graph: Graph, writer: dict[str, Node], lay: dict[str, Any]) -> list[str]:
    """A token shard (1/size of the step's tokens) read where every token is needed, or mixed with them."""
    problems: list[str] = []
    shard: set[str] = set()
    for n in graph.nodes:
        if n.op == "reduce_scatter":
            # over group ep (dp × tp) the chunks are the DP groups' tokens cut in tp: whole at tp == 1
            if n.attrs.get("group") != "ep" or lay["tp"] > 1:
                shard.update(n.writes)
            continue
        sharded_in = [r for r in n.reads if r in shard]
        if not sharded_in:
            if n.op == "moe" and lay["dp"] > 1:
                src = writer.get(n.input("x"))
                if src is None or src.op != "all_gather" or src.attrs.get("group") != "dp":
                    problems.append(f"MoE {n.id} under DP attention reads {n.input('x')}, not the DP all-gather "
                                    f"of every group's tokens")
            continue
        if n.op not in _SHARD_READERS:
            problems.append(f"{n.id} ({n.op}) reads the token shard {sharded_in[0]} before its all_gather")
        elif n.op == "residual_add" and len(sharded_in) != len(n.reads):
            whole = [r for r in n.reads if r not in shard]
            problems.append(f"{n.id} adds the token shard {sharded_in[0]} to the whole {whole[0]}")
        elif n.op != "all_gather":
            shard.update(n.writes)
    return problems


def _context_parallel_problems(graph: Graph, writer: dict[str, Node], lay: dict[str, Any]) -> list[str]:
    """CP: a prefill writes the whole step's KV (every part CP-all-gathered); KV is replicated over the
    CP ranks, so only CP rank 0's ranks save it (``writers=cp0`` on the save and the pool commit)."""
    problems = []
    cp = lay["cp"]
    for n in graph.nodes:
        if n.op == "kv_write" and cp > 1 and lay["prefill"]:
            for part in n.input("parts"):
                src = writer.get(part)
                if src is None or src.op != "all_gather" or src.attrs.get("group") != "cp":
                    problems.append(f"{n.id} writes {part}, this CP rank's tokens only: its KV is not "
                                    f"all-gathered over group cp")
        if n.op in ("kv_save", "pool_put"):
            want = "cp0" if cp > 1 else None
            if n.attrs.get("writers") != want:
                problems.append(f"{n.id} ({n.op}) has writers={n.attrs.get('writers')!r}, expected {want!r}"
                                + (" (KV is replicated over the CP ranks: CP rank 0 saves it)" if cp > 1 else ""))
    return problems
