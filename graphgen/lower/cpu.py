"""CPU target: each IR op as one line of Python calling graphgen's runtime ops through ``rt``.

``EMIT`` maps an op to its emitter, ``emitter(node, ctx) -> list of code lines`` (no indentation, no
trailing ``# <node id>``: :func:`render_cpu` adds both). Operands are taken by role
(``node.input("cache")``), never by position. Save- and load-stream work each run in a nested
function launched first (``rt.launch``), so that only waits order them against the forward. After
a main-stream line, ``del`` drops the local values that line used last (`_frees`).

Dense projections read load-time weights (`render.load_time_weight`, the module's ``LOAD_TIME_WEIGHTS``):
q/k/v merged into one, gate/up merged into one, and each stored ``[in, out]`` (``transpose01``), so
a projection is one ``x @ W^T`` on a contiguous ``W^T`` (`graphgen.runtime.core.weights` says why).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from ..ir.graph import HIDDEN, HOST_STREAM, LOAD_STREAM, MAIN_STREAM, Graph, Node
from ..ir.quant import NONE, quant_of
from .cpu_parallel import EMIT_PARALLEL, moe_weights, projection, raw_linear
from .render import (Emitter, Names, emit_with, layer_list, load_time_weights_literal, lora_segments, moe_kwargs, py,
                     render_frame, weight)


@dataclass(frozen=True)
class CpuCtx:
    ref: Names
    loaded: dict[str, Any] = field(default_factory=dict)  # load-time weight key -> recipe (the module's LOAD_TIME_WEIGHTS)
    quant: str = NONE  # the graph's quantization (graphgen.ir.quant): W8A8 multiplies the linear layers in int8


def _out(n: Node, ctx: CpuCtx) -> str:
    return ctx.ref.all(n.writes)


def _call(n: Node, ctx: CpuCtx, fn: str, *args: str) -> list[str]:
    return [f"{_out(n, ctx)} = rt.{fn}({', '.join(args)})"]


def _record(n: Node, ctx: CpuCtx) -> list[str]:
    return [f"rt.record(ev[{n.attrs['event']!r}])"]


def _wait(n: Node, ctx: CpuCtx) -> list[str]:
    return [f"rt.wait(ev[{n.attrs['event']!r}])"]


def _embedding(n: Node, ctx: CpuCtx) -> list[str]:
    return _call(n, ctx, "embedding", weight(n, "w_embed"), ctx.ref(n.input("input_ids")))


def _rope_cos_sin(n: Node, ctx: CpuCtx) -> list[str]:
    a = n.attrs
    return _call(n, ctx, "rope_cos_sin", ctx.ref(n.input("positions")), f"rot_dim={py(a['rot_dim'])}",
                 f"theta={py(a['theta'])}", f"scaling={py(a['scaling'])}")


def _rms_norm(n: Node, ctx: CpuCtx) -> list[str]:
    return _call(n, ctx, "rms_norm", ctx.ref(n.input("x")), weight(n, "w_norm"), py(n.attrs["eps"]))


def _lora(n: Node, ctx: CpuCtx, expr: str, *merged: str) -> str:
    """``expr`` (the weight of the projections ``merged``, concatenated along the output) wrapped with the
    adapter slots of those of them the node adapts (``rt.lora``: graphgen.runtime.lora.delta), each at the
    offset of its output columns; ``expr`` itself for a node without LoRA operands."""
    segs = lora_segments(n, ctx, merged)
    if segs is None:
        return expr
    return f"rt.lora({expr}, {ctx.ref(n.input('lora')[0])}, {segs})"


def _qwen3_attn_prolog(n: Node, ctx: CpuCtx) -> list[str]:
    a, r = n.attrs, ctx.ref
    return _call(n, ctx, "qwen3_attn_prolog", r(n.input("x")),
                 _lora(n, ctx, projection(n, ctx, "w_q", "w_k", "w_v"), "w_q", "w_k", "w_v"),
                 *(weight(n, w) for w in ("w_q_norm", "w_k_norm")), r(n.input("cos")), r(n.input("sin")),
                 f"num_heads={a['num_heads']}", f"num_kv_heads={a['num_kv_heads']}", f"head_dim={a['head_dim']}",
                 f"eps={py(a['eps'])}")


def _kv_write(n: Node, ctx: CpuCtx) -> list[str]:
    r = ctx.ref
    return [f"rt.kv_write({r(n.output('cache'))}, ({r.all(n.input('parts'))}), {r(n.input('slot_mapping'))})"]


def _paged_attention(n: Node, ctx: CpuCtx) -> list[str]:
    r = ctx.ref
    return _call(n, ctx, "paged_attention", *(r(n.input(x)) for x in
                 ("q", "cache", "block_tables", "seq_lens", "query_lens")), f"scale={py(n.attrs['scale'])}")


def _mla_prolog(n: Node, ctx: CpuCtx) -> list[str]:
    a, r = n.attrs, ctx.ref
    return _call(n, ctx, "mla_prolog", r(n.input("x")), _lora(n, ctx, raw_linear(n, ctx, "w_q_a"), "w_q_a"),
                 weight(n, "w_q_a_norm"), _lora(n, ctx, raw_linear(n, ctx, "w_q_b"), "w_q_b"),
                 _lora(n, ctx, raw_linear(n, ctx, "w_kv_a"), "w_kv_a"), weight(n, "w_kv_a_norm"),
                 r(n.input("cos")), r(n.input("sin")),
                 f"num_heads={a['num_heads']}", f"qk_nope_head_dim={a['qk_nope_head_dim']}",
                 f"qk_rope_head_dim={a['qk_rope_head_dim']}", f"kv_lora_rank={a['kv_lora_rank']}",
                 f"eps={py(a['eps'])}", f"interleave={py(a['interleave'])}")


def _mla_attention(n: Node, ctx: CpuCtx) -> list[str]:
    a, r = n.attrs, ctx.ref
    return _call(n, ctx, "mla_attention", r(n.input("q_nope")), r(n.input("q_pe")), r(n.input("cache")),
                 weight(n, "w_kv_b"), *(r(n.input(x)) for x in ("block_tables", "seq_lens", "query_lens")),
                 f"num_heads={a['num_heads']}", f"qk_nope_head_dim={a['qk_nope_head_dim']}",
                 f"v_head_dim={a['v_head_dim']}", f"scale={py(a['scale'])}")


def _o_proj_residual(n: Node, ctx: CpuCtx) -> list[str]:
    return _call(n, ctx, "o_proj_residual", ctx.ref(n.input("attn")), _lora(n, ctx, projection(n, ctx, "w_o"), "w_o"),
                 ctx.ref(n.input("residual")))


def _swiglu_mlp_residual(n: Node, ctx: CpuCtx) -> list[str]:
    return _call(n, ctx, "swiglu_mlp_residual", ctx.ref(n.input("x")),
                 _lora(n, ctx, projection(n, ctx, "w_gate", "w_up"), "w_gate", "w_up"),
                 _lora(n, ctx, projection(n, ctx, "w_down"), "w_down"), ctx.ref(n.input("residual")))


def _moe_residual(n: Node, ctx: CpuCtx) -> list[str]:
    return _call(n, ctx, "moe_residual", ctx.ref(n.input("x")), *moe_weights(n, ctx),
                 ctx.ref(n.input("residual")), *moe_kwargs(n.attrs))


def _lm_head(n: Node, ctx: CpuCtx) -> list[str]:
    return _call(n, ctx, "lm_head", ctx.ref(n.input("h")), weight(n, "w_norm"), py(n.attrs["eps"]),
                 weight(n, "w_head"), ctx.ref(n.input("logits_indices")))


def _mtp_eh_proj(n: Node, ctx: CpuCtx) -> list[str]:
    return _call(n, ctx, "mtp_eh_proj", ctx.ref(n.input("embed")), ctx.ref(n.input("hidden")), weight(n, "w_enorm"),
                 weight(n, "w_hnorm"), weight(n, "w_eh"), py(n.attrs["eps"]))


def _kv_save(n: Node, ctx: CpuCtx) -> list[str]:
    r, caches, staging = ctx.ref, n.input("caches"), n.output("staging")
    if len(caches) == 1:  # one layer's save (layer granularity)
        return [f"rt.kv_save({r(caches[0])}, {r(n.input('block_ids'))}, {r(staging[0])})"]
    return [f"rt.kv_save_layers(kv, {layer_list(caches)}, {r(n.input('block_ids'))}, staging)"]


def _kv_load(n: Node, ctx: CpuCtx) -> list[str]:
    r, loads, caches = ctx.ref, n.input("loads"), n.output("caches")
    if len(caches) == 1:  # one layer's load (layer granularity)
        return [f"rt.kv_load({r(caches[0])}, {r(loads[0])}, {r(n.input('block_ids'))})"]
    return [f"rt.kv_load_layers(kv, {layer_list(caches)}, loads, {r(n.input('block_ids'))})"]


EMIT: dict[str, Emitter] = {
    "record": _record, "wait": _wait, "embedding": _embedding, "rope_cos_sin": _rope_cos_sin,
    "rms_norm": _rms_norm, "qwen3_attn_prolog": _qwen3_attn_prolog, "kv_write": _kv_write,
    "paged_attention": _paged_attention, "mla_prolog": _mla_prolog, "mla_attention": _mla_attention,
    "o_proj_residual": _o_proj_residual, "swiglu_mlp_residual": _swiglu_mlp_residual,
    "moe_residual": _moe_residual, "lm_head": _lm_head, "kv_save": _kv_save, "kv_load": _kv_load,
    "mtp_eh_proj": _mtp_eh_proj,
}
EMIT.update(EMIT_PARALLEL)  # the parallel-rank ops (collectives, partial sums)


def emit(node: Node, ctx: CpuCtx) -> list[str]:
    return emit_with(EMIT, "CPU", node, ctx)


def _lines(nodes: Iterable[Node], ctx: CpuCtx, indent: str, frees: Optional[dict[int, list[str]]] = None) -> list[str]:
    out: list[str] = []
    for i, n in enumerate(nodes):
        out += [f"{indent}{line}  # {n.id}" for line in emit(n, ctx)]
        if frees and frees.get(i):
            out.append(f"{indent}del {', '.join(frees[i])}")
    return out


def _frees(graph: Graph, main: list[Node], side_reads: set[str], returned: tuple[str, ...]) -> dict[int, list[str]]:
    """Main-stream node index -> the local values to drop right after it (their last use).
    Holding every layer's activations until ``run`` returns keeps hundreds of MB alive on a long
    prefill, so each new activation lands in fresh pages (page faults, zeroing) instead of memory
    the allocator just got back: the elementwise ops then cost 2-3x. Values a side stream reads
    (its closure) and the returned values (``returned``: logits, and the MTP hidden state) are kept."""
    last: dict[str, int] = {}
    for i, n in enumerate(main):
        for name in (*n.reads, *n.writes):
            if graph.names.get(name) == "value":
                last[name] = i
    out: dict[int, list[str]] = {}
    for name, i in last.items():
        local = Names(graph)(name)
        if name in side_reads or name in returned or local == "logits":
            continue
        out.setdefault(i, []).append(local)
    return out


def render_cpu(graph: Graph) -> str:
    ctx = CpuCtx(Names(graph), quant=quant_of(graph))
    by_stream = {s: graph.on_stream(s) for s in graph.streams}
    side = [s for s in graph.streams if s not in (MAIN_STREAM, HOST_STREAM)]
    run_body: list[str] = []
    for s in side:
        run_body += ["", f"    def {s}_stream():", *_lines(by_stream[s], ctx, "        "), "",
                     f"    rt.launch({s!r}, {s}_stream)", ""]
    side_reads = {r for s in side for n in by_stream[s] for r in n.reads}
    main = list(by_stream[MAIN_STREAM])
    returned = (HIDDEN,) if HIDDEN in graph.names else ()
    run_body += _lines(main, ctx, "    ", _frees(graph, main, side_reads, returned))
    # The host stream (its wait and host.pool_put) is not lowered: the engine's KV connector commits
    # the staged blocks once HOST_EVENT is recorded. The IR keeps the nodes for the race verifier.
    host_event = next((n.event for n in by_stream.get(HOST_STREAM, ()) if n.op == "wait"), None)
    streams_note = "".join(f"; {s} runs on a worker thread, launched\nfirst so that only "
                           + ("the forward's waits order it before the KV writes" if s == LOAD_STREAM
                              else "its waits order it after the forward") for s in side)
    # graphs of a spec with MTP layers also return the last hidden state the MTP layer drafts from
    returns = f"logits, {ctx.ref(HIDDEN)}" if returned else "logits"
    return render_frame("cpu/variant.py.j2", graph=graph, meta=graph.meta, streams_note=streams_note,
                        events=tuple(graph.events), host_event=host_event, run_body="\n".join(run_body),
                        returns=returns, load_time_weights=load_time_weights_literal(ctx.loaded))
