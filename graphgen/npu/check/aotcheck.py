"""Assertions on post-AOT FX graphs of NPU-targeted code (KV write -> record -> wait -> save).

Works on any ``torch.fx.GraphModule`` whose stream structure is expressed with torchair's
``air::scope_enter/scope_exit`` and ``air::record/wait`` (or ``air::tagged_event_record/wait``)
ops: the CPU stand-in's captured graphs today, the real generated NPU modules later.

Also holds ``model_torchair_reinplace``: OUR model of the one torchair rule that decides whether
a functionalised graph-input write goes back in place.  It is written from reading
torchair 2.14 (``_acl_concrete_graph/graph_pass.py::_mutated_input_reinplace``, reached from
``fx2acl_converter.py::optimize_graph_without_runtime`` in reduce-overhead mode); it is not
torchair's code and only models the single-output case graphgen relies on.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

SCOPE_ENTER = "air.scope_enter.default"
SCOPE_EXIT = "air.scope_exit.default"
RECORD = "air.record.default"
WAIT = "air.wait.default"
TAGGED_RECORD = "air.tagged_event_record.default"
TAGGED_WAIT = "air.tagged_event_wait.default"


def _t(n: Node) -> str:
    return str(n.target) if n.op == "call_function" else ""


# --------------------------------------------------------------------------- stream labels
def _user_scopes(gm: GraphModule):
    """(node, stream label, scope instance) for every node, walking nested scope_enter/scope_exit pairs:
    only scopes carrying ``_user_stream_label`` switch streams (and open a new instance); other scopes
    inherit -- the convention torchair uses (``_utils/graph_utils.py::add_stream_label_to_node_meta``)."""
    stack: list[tuple[str | None, int | None]] = []
    label: str | None = None
    region: int | None = None
    count = 0
    for n in gm.graph.nodes:
        t = _t(n)
        if t == SCOPE_ENTER:
            stack.append((label, region))
            keys, values = n.args[0], n.args[1]
            if "_user_stream_label" in keys:
                label, region, count = values[list(keys).index("_user_stream_label")], count, count + 1
            yield n, label, region
        elif t == SCOPE_EXIT:
            yield n, label, region
            label, region = stack.pop() if stack else (None, None)
        else:
            yield n, label, region


def stream_labels(gm: GraphModule) -> dict[Node, str | None]:
    """Node -> stream label (None = main stream)."""
    return {n: label for n, label, _ in _user_scopes(gm)}


def scope_region(gm: GraphModule) -> dict[Node, int | None]:
    """Node -> index of the enclosing user-stream scope instance (None outside any)."""
    return {n: region for n, _, region in _user_scopes(gm)}


# --------------------------------------------------------------------------- aliasing / writes
def _schema(n: Node):
    return getattr(n.target, "_schema", None) if n.op == "call_function" else None


def _bound_args(n: Node):
    """(schema argument, value) pairs for a call_function node with an OpOverload target."""
    sch = _schema(n)
    if sch is None:
        return []
    out = []
    for i, a in enumerate(sch.arguments):
        if i < len(n.args) and not a.kwarg_only:
            out.append((a, n.args[i]))
        elif a.name in n.kwargs:
            out.append((a, n.kwargs[a.name]))
    return out


def alias_roots(gm: GraphModule) -> dict[Node, Node]:
    """Node -> the placeholder whose memory it aliases (in-place op results and views of inputs)."""
    roots: dict[Node, Node] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            roots[n] = n
            continue
        sch = _schema(n)
        if sch is None:
            if n.target is operator.getitem and n.args[0] in roots:
                pass  # getitem of a tuple-returning op: not an alias unless the op says so
            continue
        rets = sch.returns
        if len(rets) == 1 and rets[0].alias_info is not None:
            # returns an alias of the argument carrying the same alias set (views, in-place ops)
            ret_set = rets[0].alias_info.before_set
            for a, v in _bound_args(n):
                if a.alias_info is not None and a.alias_info.before_set == ret_set and isinstance(v, Node) \
                        and v in roots:
                    roots[n] = roots[v]
                    break
    return roots


def writes_of(n: Node, roots: dict[Node, Node]) -> list[Node]:
    """Placeholders written by node ``n`` (arguments with a ``(a!)`` annotation)."""
    out = []
    for a, v in _bound_args(n):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        vals = v if isinstance(v, (list, tuple)) else [v]
        for x in vals:
            if isinstance(x, Node) and x in roots:
                out.append(roots[x])
    return out


def reads_of(n: Node, roots: dict[Node, Node]) -> list[Node]:
    out = []
    for x in n.all_input_nodes:
        if x in roots:
            out.append(roots[x])
    return out


# --------------------------------------------------------------------------- the checks
@dataclass
class _Ctx:
    order: dict
    labels: dict
    region: dict
    roots: dict


def _ctx(gm: GraphModule) -> _Ctx:
    return _Ctx({n: i for i, n in enumerate(gm.graph.nodes)}, stream_labels(gm), scope_region(gm), alias_roots(gm))


def _ph(gm: GraphModule, name) -> Node:
    if isinstance(name, Node):
        return name
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.name == name:
            return n
    raise KeyError(f"no graph input named {name!r}")


def check_kv_save_graph(gm: GraphModule, cache_inputs, staging_inputs, save_stream: str = "kv_save") -> list[str]:
    """Problems with the KV write -> record -> wait -> save ordering in a post-AOT graph.

    For each cache input C and staging input S:
    1. every write into C happens on the main stream, outside any save scope;
    2. every read of C on the save stream is preceded, inside the same save scope, by a wait whose
       events were recorded on the main stream after every earlier write into C (record follows
       write; the gather follows its wait);
    3. every write into S happens on the save stream, inside a save scope, after such a wait;
    4. nothing writes into C or S after the final scope_exit (the functionalisation pitfall:
       trailing ``copy_`` epilogues land there, outside the stream and after every sync).
    Returns a list of human-readable problems (empty when the graph is fine).
    """
    ctx = _ctx(gm)
    caches = [_ph(gm, c) for c in cache_inputs]
    stagings = [_ph(gm, s) for s in staging_inputs]
    nodes = list(gm.graph.nodes)
    exits = [n for n in nodes if _t(n) == SCOPE_EXIT]
    last_exit = ctx.order[exits[-1]] if exits else -1
    problems: list[str] = []
    if not exits:
        problems.append("no stream scope at all (expected npu_stream_switch around the save)")

    def write_nodes(ph):
        return [n for n in nodes if ph in writes_of(n, ctx.roots)]

    # record nodes (main stream) and the waits that consume them
    def waits_covering(write: Node, before: Node) -> bool:
        """Is there a wait in before's scope region, before it, on a record placed after write?"""
        region = ctx.region[before]
        for n in nodes:
            if ctx.order[n] >= ctx.order[before]:
                break
            if ctx.region.get(n) != region or region is None:
                continue
            if _t(n) == WAIT:
                recs = [r for r in n.args[0] if isinstance(r, Node) and _t(r) == RECORD]
                if any(ctx.order[r] > ctx.order[write] and ctx.labels[r] == ctx.labels[write] for r in recs):
                    return True
            if _t(n) == TAGGED_WAIT:
                tag = n.args[0]
                for r in nodes:
                    if _t(r) == TAGGED_RECORD and r.args[0] == tag and ctx.order[write] < ctx.order[r] < ctx.order[n] \
                            and ctx.labels[r] == ctx.labels[write]:
                        return True
        return False

    for c in caches:
        ws = write_nodes(c)
        if not ws:
            problems.append(f"{c.name}: no write into the KV cache input in the graph")
        for w in ws:
            if ctx.labels[w] == save_stream or ctx.region[w] is not None:
                problems.append(f"{c.name}: write {w.name} is inside a stream scope (expected main stream)")
            if ctx.order[w] > last_exit:
                problems.append(f"{c.name}: write {w.name} ({w.target}) comes after the final scope_exit")
        save_reads = [n for n in nodes if c in reads_of(n, ctx.roots) and ctx.labels[n] == save_stream
                      and _t(n) not in (WAIT, SCOPE_ENTER, SCOPE_EXIT)]
        for rd in save_reads:
            for w in ws:
                if ctx.order[w] < ctx.order[rd] and not waits_covering(w, rd):
                    problems.append(f"{c.name}: save-stream read {rd.name} is not ordered after write {w.name} "
                                    f"by a record (after the write) and a wait (before the read, same scope)")
    for s in stagings:
        ws = write_nodes(s)
        if not ws:
            problems.append(f"{s.name}: no write into the staging input in the graph")
        for w in ws:
            if ctx.labels[w] != save_stream:
                problems.append(f"{s.name}: staging write {w.name} ({w.target}) is not on stream {save_stream!r}")
            if ctx.order[w] > last_exit:
                problems.append(f"{s.name}: staging write {w.name} comes after the final scope_exit")
            region = ctx.region[w]
            if region is not None and not any(_t(n) in (WAIT, TAGGED_WAIT) and ctx.region[n] == region
                                               and ctx.order[n] < ctx.order[w] for n in nodes):
                problems.append(f"{s.name}: staging write {w.name} is not preceded by a wait in its scope")
    return problems


def assert_kv_save_graph(gm: GraphModule, cache_inputs, staging_inputs, save_stream: str = "kv_save") -> None:
    problems = check_kv_save_graph(gm, cache_inputs, staging_inputs, save_stream)
    if problems:
        raise AssertionError("post-AOT graph violates the KV save ordering:\n  " + "\n  ".join(problems)
                             + "\n" + gm.code)


# --------------------------------------------------------------------------- modelled torchair re-inplace
def _inplace_twin(target):
    """foo -> foo_ in the same namespace with a matching schema (torch.fx's own lookup)."""
    from torch.fx.passes.reinplace import _maybe_get_inplace_op

    return _maybe_get_inplace_op(target)


def model_torchair_reinplace(gm: GraphModule, mode: str) -> list[str]:
    """Model of torchair 2.14's input-mutation re-inplacing; mutates ``gm``; returns what it did.

    Rule (as read in ``_acl_concrete_graph/graph_pass.py::_mutated_input_reinplace``): a trailing
    ``copy_(input, f(input, ...))`` where ``f`` is a single-output functional op whose in-place twin
    ``f_`` exists, and nothing reads ``input`` between ``f`` and the ``copy_``, becomes ``f_(input, ...)``
    at ``f``'s position and the ``copy_`` is erased.  In reduce-overhead torchair additionally
    requires all other users of ``input`` to be on one stream (``ReinplaceStreamChecker``).
    Multi-output functional ops (e.g. ``npu_scatter_pa_kv_cache_functional``) are only handled for the
    three ops torchair registers in ``inplaceable_npu_ops`` -- none of which graphgen uses -- so this
    model leaves them functional.  In max-autotune the GE converter maps the trailing copy to an
    Assign/ref output instead (``_ge_concrete_graph/fx2ge_converter.py``); we model that with the same
    rule minus the stream check, which is an approximation (unverified without an NPU).
    """
    done: list[str] = []
    labels = stream_labels(gm)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for copy in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.copy_.default]:
        dst, src = copy.args[0], copy.args[1]
        if not (isinstance(dst, Node) and dst.op == "placeholder" and isinstance(src, Node)
                and src.op == "call_function" and src.args and src.args[0] is dst):
            continue
        twin = _inplace_twin(src.target)
        if twin is None:
            continue
        between = [u for u in dst.users if u is not src and u is not copy and order[src] < order[u] < order[copy]]
        if between:
            continue
        if mode == "reduce-overhead":
            users = [u for u in dst.users if u is not copy] + list(copy.users)
            if len({labels.get(u) for u in users}) > 1:
                continue
        src.target = twin
        copy.replace_all_uses_with(dst)
        gm.graph.erase_node(copy)
        done.append(f"{src.name}: {twin} in place into {dst.name}")
    gm.graph.lint()
    gm.recompile()
    return done


# --------------------------------------------------------------------------- the explicit save join
_EVENT_OPS = (RECORD, WAIT, TAGGED_RECORD, TAGGED_WAIT, SCOPE_ENTER, SCOPE_EXIT)


def check_save_join(gm: GraphModule, graph: str, save_stream: str = "kv_save") -> list[str]:
    """Problems with the explicit save -> main join of a post-AOT graph (empty when it holds, or when
    the graph has no save stream).  The join (audit 2, row 8): a record on the save stream after its
    last op, waited on the main stream, and the first main-stream op after that wait an ancestor of the
    graph's output -- in GE, record/wait become a control edge from the save stream's last op to that
    next op (torchair ``fx2ge_converter.py:2096-2132``), so the logits, and the event the runner records
    after the graph, come after the save whatever GE does at the end of the graph.  One stream label is
    one stream (FIFO): a record after the label's last op covers every earlier save scope."""
    ctx = _ctx(gm)
    nodes = list(gm.graph.nodes)
    side = [n for n in nodes if ctx.labels[n] == save_stream and _t(n) not in _EVENT_OPS and n.op == "call_function"]
    if not side:
        return []
    last = max(ctx.order[n] for n in side)
    recs = [n for n in nodes if ctx.labels[n] == save_stream and ctx.order[n] > last
            and _t(n) in (RECORD, TAGGED_RECORD)]
    if not recs:
        return [f"{graph}: the save stream's last op {nodes[last].name} is not joined to the main stream: no "
                f"record on {save_stream!r} after it (AOT drops a record that nothing waits on); the save join is "
                f"a record in the save scope, waited on the main stream before the op producing the logits"]
    tags = {r.args[0] for r in recs if _t(r) == TAGGED_RECORD}
    waits = [n for n in nodes if ctx.labels[n] is None and (
        (_t(n) == WAIT and any(r in recs for r in n.args[0])) or (_t(n) == TAGGED_WAIT and n.args[0] in tags))]
    if not waits:
        return [f"{graph}: the save stream's last op {nodes[last].name} is not joined to the main stream: its "
                f"record {recs[0].name} is not waited on the main stream (the save join's wait is missing)"]
    out = next(n for n in nodes if n.op == "output")
    ancestors, todo = set(), [x for x in out.all_input_nodes]
    while todo:
        x = todo.pop()
        if x not in ancestors:
            ancestors.add(x)
            todo.extend(x.all_input_nodes)
    problems = []
    for w in waits:
        nxt = next((n for n in nodes[ctx.order[w] + 1:] if ctx.labels[n] is None and n.op == "call_function"
                    and _t(n) not in _EVENT_OPS and n.target is not operator.getitem), None)
        if nxt is None or nxt not in ancestors:
            problems.append(f"{graph}: the save join's wait {w.name} is followed on the main stream by "
                            f"{'nothing' if nxt is None else nxt.name}, which the output does not depend on: "
                            f"the wait must sit before the op producing the logits")
    return problems if len(problems) == len(waits) else []


# The attention ops the static decode graph may feed its only symbolic values to: their SymInt[] length
# arguments are what torchair turns into a host Data input whose values tiling sink reads on the device
# (path 4; audit 2 §2.1), so changing lengths neither recompiles nor makes the GE graph dynamic.
_SINK_LENGTH_ARGS = {"npu.npu_fused_infer_attention_score_v2.default": ("actual_seq_qlen", "actual_seq_kvlen")}


def check_static_graph(gm: GraphModule, graph: str) -> list[str]:
    """Problems that keep a graph compiled with tiling sink (``TILING_SINK``) from being one static GE graph:
    a tensor with a symbolic dimension; a symbolic int used anywhere but as a length argument of the
    tiling-sunk attention (``_SINK_LENGTH_ARGS``); a TND attention call (tiling sink does not support it,
    ``_op_plugin_docs.py:8113-8114``, ``:8632-8633``).  The graph structure only: what GE builds is unverified."""
    import torch

    problems = []
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and any(not isinstance(d, int) for d in v.shape):
            problems.append(f"{graph}: {n.name} ({_t(n)}) has a symbolic shape {tuple(v.shape)}")
        if n.op == "call_function" and "fused_infer_attention_score" in _t(n) and n.kwargs.get("input_layout", "BSH") \
                in ("TND", "TND_NTD", "NTD_TND"):
            problems.append(f"{graph}: {n.name} ({_t(n)}) uses input_layout {n.kwargs['input_layout']!r}, "
                            f"which tiling sink does not support")
        if n.op == "placeholder" and isinstance(v, torch.SymInt):
            for u in n.users:
                allowed = _SINK_LENGTH_ARGS.get(_t(u), ())
                if not any(n in (u.kwargs.get(k) or ()) for k in allowed):
                    problems.append(f"{graph}: symbolic int {n.name} feeds {u.name} ({_t(u)}), not a length "
                                    f"argument of the tiling-sunk attention")
    return problems
