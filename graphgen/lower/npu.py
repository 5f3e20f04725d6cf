"""Ascend NPU target (torchair): each IR op as torch_npu / torchair calls, in a standalone module.

``EMIT`` maps an op to its emitter, ``emitter(node, ctx) -> list of code lines`` (no indentation, no
node-id tag: :func:`render_npu` adds both). Operands are taken by role, never by position, and every
number comes from node attributes: lowering never sees the spec. Events are spelled per compile mode:

- max-autotune:    ``torchair.ops.record()`` / ``torchair.ops.wait([...])`` (tagged events raise there);
- reduce-overhead: module-level tagged events, ``npu_tagged_event_record`` / ``_wait``
  (``npu_wait_tensor`` raises there).

KV write and save follow docs/npu-research.md: ``npu_scatter_nd_update_`` into whole graph inputs,
so torchair's re-inplace turns the functionalised write back into an in-place write at its position.
Multi-kernel ops call helpers from :mod:`graphgen.lower.npu_helpers`, copied verbatim into the module.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ..ir.graph import HIDDEN, HOST_STREAM, LOAD_STREAM, MAIN_STREAM, Graph, Node
from ..ir.quant import NONE, quant_of
from .npu_parallel import EMIT_PARALLEL, named_groups
from .npu_calls import dense_weight, moe_call, o_proj_call, swiglu_mlp_call
from .render import (Emitter, LoweringError, Names, emit_with, load_time_weights_literal, py, render_frame,
                     weight)

COMPILE_MODES = ("max-autotune", "reduce-overhead")
HELPERS_FILE = Path(__file__).with_name("npu_helpers.py")
_CALL = re.compile(r"\b(_[A-Za-z]\w*)\(")


@dataclass(frozen=True)
class NpuOptions:
    """What the NPU target needs beyond the graph: the compile mode and the save stream's tag/priority."""

    mode: str
    save_stream_tag: str = "kv_save"
    save_stream_priority: int = 0

    def __post_init__(self) -> None:
        if self.mode not in COMPILE_MODES:
            raise LoweringError(f"no NPU event lowering for compile mode '{self.mode}'; modes: {', '.join(COMPILE_MODES)}")


@dataclass(frozen=True)
class NpuCtx:
    ref: Names
    mode: str
    events: dict[str, tuple[str, str]]  # event -> (from stream, to stream)
    components: dict[str, tuple[str, ...]]  # kv_cache name -> its component names (from the kv_write that fills it)
    loaded: dict[str, Any] = field(default_factory=dict)  # load-time weight key -> recipe (the module's LOAD_TIME_WEIGHTS)
    world: int = 1  # ranks of the layout (dp x cp x tp): a collective over all of them uses the world group
    tp: int = 1
    cp: int = 1  # context-parallel ranks: a prefill's queries are this rank's head-tail pieces (lower/npu_parallel.py)
    quant: str = NONE  # the graph's quantization (graphgen.ir.quant): W8A8 multiplies the linear layers in int8


def evname(event: str) -> str:
    """Python name of an event: ``ev.L00.kv_write`` -> ``ev_L00_kv_write``."""
    base = event[3:] if event.startswith("ev.") else event
    return "ev_" + base.replace(".", "_").replace("-", "_")


def _record(n: Node, ctx: NpuCtx) -> list[str]:
    ev = n.event
    if ctx.events[ev][1] == HOST_STREAM:
        # NPU only: the save -> host event also becomes an in-graph record, waited on the main stream
        # before the op producing the logits (render_npu emits that wait: "save join"), so the event the
        # runner records after the graph covers the save whatever GE's end-of-graph semantics (audit 2,
        # row 8).  The CPU target keeps the host-event commit: its first token never waits for the save.
        head = f"# {ev} ({n.stream} -> host): the runner commits after the graph; explicit join on the main stream"
        return [head, *_record_line(ev, ctx)]
    return _record_line(ev, ctx)


def _record_line(ev: str, ctx: NpuCtx) -> list[str]:
    if ctx.mode == "max-autotune":
        return [f"{evname(ev)} = torchair.ops.record()"]
    return [f"torchair.ops.npu_tagged_event_record({evname(ev)})"]


def save_join_events(graph: Graph) -> list[str]:
    """The save -> host events: recorded in the save scope, waited on the main stream (the save join)."""
    return [n.event for n in graph.nodes if n.op == "record" and n.stream not in (HOST_STREAM, LOAD_STREAM)
            and graph.events[n.event][1] == HOST_STREAM]


def _save_join(events: Iterable[str], ctx: NpuCtx) -> list[str]:
    """The main-stream wait on every save -> host event, placed just before the op producing the logits:
    in GE, wait adds a control edge from the save stream's last op to the next main-stream op
    (torchair fx2ge_converter.py:2096-2132), so the logits -- and the post-graph event -- follow the save."""
    if ctx.mode == "max-autotune":
        return [f"torchair.ops.wait([{', '.join(map(evname, events))}])"]
    return [f"torchair.ops.npu_tagged_event_wait({evname(ev)})" for ev in events]


def _wait(n: Node, ctx: NpuCtx) -> list[str]:
    if ctx.events[n.event][0] == LOAD_STREAM:
        return [f"# {n.event} (kv_load -> {n.stream}) is no in-graph event: load() ran before the graph (see load())"]
    if ctx.mode == "max-autotune":
        return [f"torchair.ops.wait([{evname(n.event)}])"]
    return [f"torchair.ops.npu_tagged_event_wait({evname(n.event)})"]


def _out(n: Node, ctx: NpuCtx) -> str:
    return ctx.ref.all(n.writes)


def _embedding(n: Node, ctx: NpuCtx) -> list[str]:
    return [f"{_out(n, ctx)} = F.embedding({ctx.ref(n.input('input_ids'))}, {weight(n, 'w_embed')})"]


def _rope_cos_sin(n: Node, ctx: NpuCtx) -> list[str]:
    # Both RoPE kernels require cos/sin in q/k's dtype (npu_apply_rotary_pos_emb: _op_plugin_docs.py:15821;
    # npu_interleave_rope: cos/sin dtype = x dtype): the table is used in the node's dtype, whatever the
    # dtype it was built in (a no-op cast when the host built it in that dtype).
    return [f"{_out(n, ctx)} = W[ROPE_CACHE_KEY].index_select(0, {ctx.ref(n.input('positions'))})"
            f".to(torch.{n.attrs['dtype']}).chunk(2, dim=-1)"]


def _rms_norm(n: Node, ctx: NpuCtx) -> list[str]:
    return [f"{_out(n, ctx)} = torch_npu.npu_rms_norm({ctx.ref(n.input('x'))}, {weight(n, 'w_norm')}, "
            f"{py(n.attrs['eps'])})[0]"]


def _qwen3_attn_prolog(n: Node, ctx: NpuCtx) -> list[str]:
    a, r = n.attrs, ctx.ref
    qkv = dense_weight(n, ctx, "w_q", "w_k", "w_v")  # one matmul, split after
    args = [r(n.input("x")), qkv, *(weight(n, w) for w in ("w_q_norm", "w_k_norm")),
            r(n.input("cos")), r(n.input("sin")), f"num_heads={a['num_heads']}", f"num_kv_heads={a['num_kv_heads']}",
            f"head_dim={a['head_dim']}", f"eps={py(a['eps'])}"]
    return [f"{_out(n, ctx)} = _qwen3_attn_prolog({', '.join(args)})"]


def _kv_write(n: Node, ctx: NpuCtx) -> list[str]:
    cache = ctx.ref(n.output("cache"))
    return [f"torch_npu.npu_scatter_nd_update_({cache}[{i}], b.kv_index, {p}.reshape({p}.shape[0], -1))"
            for i, p in enumerate(map(ctx.ref, n.input("parts")))]


def _sparse_mode(n: Node) -> int:
    """0: decode (no mask); 3: prefill/splitfuse with the compressed causal mask ``b.atten_mask``."""
    mode = n.attrs["mode"]
    if mode not in ("prefill", "splitfuse", "decode"):
        raise LoweringError(f"unknown attention mode '{mode}' (node {n.id})")
    return 0 if mode == "decode" else 3


def _mask(sparse: int) -> str:
    return "None" if sparse == 0 else "b.atten_mask"


def _paged_attention(n: Node, ctx: NpuCtx) -> list[str]:
    a, r, sparse = n.attrs, ctx.ref, _sparse_mode(n)
    cache = r(n.input("cache"))
    if n.attrs["mode"] == "decode":
        # the static decode graph (tiling sink): BSH through the v2 API, docs/npu.md "Decode as a static graph"
        args = [r(n.input("q")), cache, r(n.input("block_tables")), "b.actual_seq_lengths_kv",
                f"num_heads={a['num_heads']}", f"num_kv_heads={a['num_kv_heads']}", f"head_dim={a['head_dim']}",
                f"scale={py(a['scale'])}", f"block_size={a['block_size']}"]
        return [f"{_out(n, ctx)} = _gqa_decode_attention({', '.join(args)})"]
    return [f"{_out(n, ctx)} = torch_npu.npu_fused_infer_attention_score({r(n.input('q'))}, {cache}[0], {cache}[1], "
            f"atten_mask={_mask(sparse)}, actual_seq_lengths=b.actual_seq_lengths, "
            f"actual_seq_lengths_kv=b.actual_seq_lengths_kv, block_table={r(n.input('block_tables'))}, "
            f"num_heads={a['num_heads']}, num_key_value_heads={a['num_kv_heads']}, scale={py(a['scale'])}, "
            f"input_layout=\"TND\", sparse_mode={sparse}, block_size={a['block_size']})[0]"]


def _mla_prolog(n: Node, ctx: NpuCtx) -> list[str]:
    a, r = n.attrs, ctx.ref
    args = [r(n.input("x")), dense_weight(n, ctx, "w_q_a"), weight(n, "w_q_a_norm"), dense_weight(n, ctx, "w_q_b"),
            dense_weight(n, ctx, "w_kv_a"), weight(n, "w_kv_a_norm"), r(n.input("cos")), r(n.input("sin")),
            f"num_heads={a['num_heads']}",
            f"qk_nope_head_dim={a['qk_nope_head_dim']}", f"qk_rope_head_dim={a['qk_rope_head_dim']}",
            f"kv_lora_rank={a['kv_lora_rank']}", f"eps={py(a['eps'])}", f"interleave={py(a['interleave'])}"]
    return [f"{_out(n, ctx)} = _mla_prolog({', '.join(args)})"]


def _mla_attention(n: Node, ctx: NpuCtx) -> list[str]:
    """MLA by phase (the KV cache always holds the compressed latent): decode -> absorbed FIA v2 (BNSD, for
    the static decode graph) over the paged latent (documented for 1-16 query tokens per sequence); prefill/splitfuse -> un-absorbed
    (kv_b_proj up-projection, non-paged TND FIA, Q_D = K_D = qk_nope + qk_rope, V_D = v_head_dim);
    splitfuse gathers the history latent by host-packed rows.  See docs/npu.md, "MLA by phase"."""
    a, r, mode = n.attrs, ctx.ref, n.attrs["mode"]
    _sparse_mode(n)  # rejects an unknown mode
    heads = [f"num_heads={a['num_heads']}", f"qk_nope_head_dim={a['qk_nope_head_dim']}",
             f"v_head_dim={a['v_head_dim']}"]
    q_nope, q_pe, cache = r(n.input("q_nope")), r(n.input("q_pe")), r(n.input("cache"))
    if mode == "decode":
        args = [q_nope, q_pe, cache, weight(n, "w_kv_b"), r(n.input("block_tables")), "b.actual_seq_lengths_kv",
                "b.atten_mask", *heads, f"kv_lora_rank={a['kv_lora_rank']}", f"scale={py(a['scale'])}",
                f"block_size={a['block_size']}"]
        return [f"{_out(n, ctx)} = _mla_attention_absorbed({', '.join(args)})"]
    if mode == "prefill" and ctx.cp == 1:
        args = [q_nope, q_pe, cache, weight(n, "w_kv_b"), "b.kv_index", "b.actual_seq_lengths", "b.atten_mask",
                *heads, f"scale={py(a['scale'])}"]
        return [f"{_out(n, ctx)} = _mla_prefill({', '.join(args)})"]
    # splitfuse: the history rows come packed from the host (b.kv_gather_rows), not from the block
    # table in the graph: the in-graph order needed aten.sort.stable, which GE cannot convert. A context-parallel
    # prefill too: a CP rank's pieces attend over every rank's earlier tokens (the gathered KV in its cache), not
    # over the rows its own KV write filled (docs/npu.md, "Context parallel on the NPU runner").
    args = [q_nope, q_pe, cache, weight(n, "w_kv_b"), "b.kv_gather_rows", "b.actual_seq_lengths",
            "b.actual_seq_lengths_kv", "b.atten_mask", *heads, f"scale={py(a['scale'])}"]
    return [f"{_out(n, ctx)} = _mla_splitfuse({', '.join(args)})"]


def _o_proj_residual(n: Node, ctx: NpuCtx) -> list[str]:
    return [f"{_out(n, ctx)} = {ctx.ref(n.input('residual'))} + {o_proj_call(n, ctx)}"]


def _swiglu_mlp_residual(n: Node, ctx: NpuCtx) -> list[str]:
    return [f"{_out(n, ctx)} = {ctx.ref(n.input('residual'))} + {swiglu_mlp_call(n, ctx)}"]


def _moe_residual(n: Node, ctx: NpuCtx) -> list[str]:
    return [f"{_out(n, ctx)} = {moe_call(n, ctx, ctx.ref(n.input('residual')))}"]


def _lm_head(n: Node, ctx: NpuCtx) -> list[str]:
    return [f"{_out(n, ctx)} = F.linear(torch_npu.npu_rms_norm({ctx.ref(n.input('h'))}.index_select(0, "
            f"{ctx.ref(n.input('logits_indices'))}), {weight(n, 'w_norm')}, {py(n.attrs['eps'])})[0], "
            f"{weight(n, 'w_head')})"]


def _mtp_eh_proj(n: Node, ctx: NpuCtx) -> list[str]:
    # eh_proj(cat[enorm(embedding), hnorm(prev_hidden)]): the calls of _rms_norm and _lm_head (traced at
    # full size in specs/deepseek_v3_1_mtp.yaml's mtp_draft; docs/npu.md, "MTP graphs")
    r, eps = ctx.ref, py(n.attrs["eps"])
    return [f"{_out(n, ctx)} = F.linear(torch.cat((torch_npu.npu_rms_norm({r(n.input('embed'))}, "
            f"{weight(n, 'w_enorm')}, {eps})[0], torch_npu.npu_rms_norm({r(n.input('hidden'))}, "
            f"{weight(n, 'w_hnorm')}, {eps})[0]), dim=-1), {weight(n, 'w_eh')})"]


def _kv_save(n: Node, ctx: NpuCtx) -> list[str]:
    """Copy each listed layer's cache components (as many as its kv_write fills) into its staging."""
    r, ids = ctx.ref, ctx.ref(n.input("block_ids"))
    return [f"torch_npu.npu_scatter_nd_update_({r(s)}[{i}], b.save_rows, {r(c)}[{i}].index_select(0, {ids}))"
            for c, s in zip(n.input("caches"), n.output("staging")) for i in range(len(ctx.components[c]))]


def _kv_load(n: Node, ctx: NpuCtx) -> list[str]:
    """Scatter each listed layer's loaded blocks (``loads[L][i]``: [R, *KV_SHAPES[i]]) into the cache
    blocks ``b.load_rows`` ([R, 1] int64 = the destination block ids): updates.shape =
    indices.shape[:-1] + input.shape[1:] = [R, *KV_SHAPES[i]] (_op_plugin_docs.py:6875-6900)."""
    r = ctx.ref
    return [f"torch_npu.npu_scatter_nd_update_({r(c)}[{i}], b.load_rows, {r(s)}[{i}])"
            for s, c in zip(n.input("loads"), n.output("caches")) for i in range(len(ctx.components[c]))]


EMIT: dict[str, Emitter] = {
    "record": _record, "wait": _wait, "embedding": _embedding, "rope_cos_sin": _rope_cos_sin,
    "rms_norm": _rms_norm, "qwen3_attn_prolog": _qwen3_attn_prolog, "kv_write": _kv_write,
    "paged_attention": _paged_attention, "mla_prolog": _mla_prolog, "mla_attention": _mla_attention,
    "o_proj_residual": _o_proj_residual, "swiglu_mlp_residual": _swiglu_mlp_residual,
    "moe_residual": _moe_residual, "lm_head": _lm_head, "kv_save": _kv_save, "kv_load": _kv_load,
    "mtp_eh_proj": _mtp_eh_proj,
}
EMIT.update(EMIT_PARALLEL)  # the parallel-rank ops (collectives, partial sums)

# Load-stream nodes are not part of the compiled graph either: load() runs them eagerly before forward.
# A cache input written twice in one graph (the load's scatter, then the KV write's) is not re-inplaced
# by torchair's input-mutation pass (one functional op feeding the copy_ epilogue; see
# graphgen.npu.check.aotcheck.model_torchair_reinplace): the writes would land in a copy_ after the final
# scope_exit, after the save stream read the cache. So on the NPU the load is ordered before the graph.
LOAD_EMIT: dict[str, Emitter] = {
    "kv_load": lambda n, ctx: _kv_load(n, ctx),
    "record": lambda n, ctx: [f"# {n.event}: the graph starts after load() returned"],
}

def emit(node: Node, ctx: NpuCtx) -> list[str]:
    return emit_with(EMIT, "NPU", node, ctx)


@functools.lru_cache(maxsize=None)
def helper_sources() -> dict[str, tuple[str, frozenset[str]]]:
    """Helper name -> (its exact source, the other helpers it calls), in file order; torch-free (ast)."""
    text = HELPERS_FILE.read_text(encoding="utf-8")
    lines = text.splitlines()
    defs = [f for f in ast.parse(text).body if isinstance(f, ast.FunctionDef)]
    names = {f.name for f in defs}
    return {f.name: ("\n".join(lines[f.lineno - 1:f.end_lineno]),
                     frozenset(x.id for x in ast.walk(f) if isinstance(x, ast.Name) and x.id in names))
            for f in defs}


def helpers_for(code_lines: Iterable[str]) -> list[str]:
    """Sources of the helpers the code calls, with the helpers those call, in file order."""
    helpers = helper_sources()
    todo = [m for line in code_lines for m in _CALL.findall(line) if m in helpers]
    need: set[str] = set()
    while todo:
        h = todo.pop()
        if h not in need:
            need.add(h)
            todo.extend(helpers[h][1])
    return [src for name, (src, _) in helpers.items() if name in need]


def _kv_layout(graph: Graph) -> dict[str, Any]:
    layouts = {(n.attrs["components"], n.attrs["widths"], n.attrs["block_size"], n.attrs["kv_dtype"])
               for n in graph.nodes if n.op == "kv_write"}
    if len(layouts) != 1:
        raise LoweringError(f"{graph.name}: the NPU module needs one KV layout for every layer, found {len(layouts)}")
    comps, widths, bs, dtype = layouts.pop()
    return {"kv_components": comps, "kv_shapes": tuple((bs, w) for w in widths), "kv_dtype": dtype}


def tiling_sink(graph: Graph, mode: str) -> bool:
    """Whether the module compiles with the tiling sunk (GE static graph, torchair's path 4): decode in
    max-autotune, whose attention the emitters spell BSH/BNSD; prefill and splitfuse keep TND (host tiling)."""
    return mode == "max-autotune" and graph.meta.get("phase") == "decode"


EVENTS_DOC = {
    "max-autotune": "Events: torchair.ops.record() on the recording stream, torchair.ops.wait([...]) on the waiting one.",
    "reduce-overhead": "Events: tagged events created once at import (outside the compiled region; tags are "
                       "process-unique),\nrecorded/waited in forward with npu_tagged_event_record / "
                       "npu_tagged_event_wait.",
}


_STEP_FIELD = re.compile(r"\bb\.(\w+)")  # a step input field as the emitted code reads it


def render_npu(graph: Graph, options: NpuOptions) -> str:
    tp = graph.meta.get("tp", 1)
    world = graph.meta.get("dp", 1) * graph.meta.get("cp", 1) * tp
    layout = _kv_layout(graph)
    # every cache layer has the one layout; the MTP graph writes only its own layer but saves them all
    ctx = NpuCtx(Names(graph), options.mode, graph.events,
                 {name: layout["kv_components"] for name, kind in graph.names.items() if kind == "kv_cache"},
                 world=world, tp=tp, cp=graph.meta.get("cp", 1), quant=quant_of(graph))
    tag, prio = py(options.save_stream_tag), py(options.save_stream_priority)
    body: list[str] = []
    prev = None
    joins, recorded = save_join_events(graph), set()
    for n in graph.nodes:
        if n.stream in (HOST_STREAM, LOAD_STREAM):  # host: the runner commits; load: load() (LOAD_EMIT)
            continue
        if n.op == "record":
            recorded.add(n.event)
        if joins and n.stream == MAIN_STREAM and "logits" in n.writes:
            if set(joins) - recorded:
                raise LoweringError(f"{graph.name}: the save is issued after {n.id}, which produces the logits; "
                                    f"the NPU save join needs the save recorded before it")
            body += [f"    {line}  # save.join" for line in _save_join(joins, ctx)]
            joins = []
        side = n.stream != MAIN_STREAM
        if side and prev != n.stream:
            body.append(f"    with torchair.scope.npu_stream_switch({tag}, {prio}):  # stream {n.stream} (SAVE_STREAM)")
        prev = n.stream
        ind = "        " if side else "    "
        body += [f"{ind}{line} [{n.id}]" if line.startswith("#") else f"{ind}{line}  # {n.id}"
                 for line in emit(n, ctx)]
    if joins:
        raise LoweringError(f"{graph.name}: no main-stream node writes 'logits': nowhere to join the save")
    load = [f"    {line} [{n.id}]" if line.startswith("#") else f"    {line}  # {n.id}"
            for n in graph.on_stream(LOAD_STREAM) for line in emit_with(LOAD_EMIT, "NPU load", n, ctx)]
    tagged = ""
    if options.mode == "reduce-overhead":
        tagged = "\n# Tagged events: created here, eagerly, once per process (torchair rejects a reused tag).\n" + "".join(
            f"{evname(ev)} = torchair.ops.npu_create_tagged_event("
            f"tag={py('graphgen.' + graph.meta['model'] + '.' + graph.meta['variant'] + '.' + ev)})  # {s} -> {d}\n"
            for ev, (s, d) in graph.events.items() if LOAD_STREAM != s)
    rope = next(n.attrs for n in graph.nodes if n.op == "rope_cos_sin")
    # graphs of a spec with MTP layers also return the last hidden state the MTP layer drafts from
    returns = f"logits, {ctx.ref(HIDDEN)}" if HIDDEN in graph.names else "logits"
    reads = tuple(sorted(set(_STEP_FIELD.findall("\n".join(body + load)))))
    return render_frame(
        "npu/variant.py.j2", graph=graph, meta=graph.meta, mode=options.mode, events_doc=EVENTS_DOC[options.mode],
        step_reads=reads,
        save_stream=f"({tag}, {prio})", rope=rope, process_groups=named_groups(graph.nodes, world), returns=returns,
        returns_doc="(logits [B, V], hidden [T, hidden])" if HIDDEN in graph.names else "logits [B, V]",
        tiling_sink=tiling_sink(graph, options.mode), tagged_events=tagged, **layout,
        load_time_weights=load_time_weights_literal(ctx.loaded),
        helpers="\n\n" + "\n\n\n".join(helpers_for(body)), forward_body="\n".join(body),
        load_body="\n".join(load) or "    pass  # this graph loads nothing")
