"""Op schemas: every IR op's named operands and attributes, in one registry.

A node stores its operands as ordered ``reads``/``writes`` tuples (that is what the golden text
shows); the schema gives each position a *role*, so lowering asks ``node.input("cache")`` and never
``reads[2]``. A role may be *variadic* (``parts`` of a KV write: K and V, or the MLA latent and its
RoPE part): it takes every position not taken by the fixed roles, in order, and reads back as a tuple.
At most one role per side is variadic. A variadic role written ``name*`` may be empty: the ``lora`` operands
of the projections an adapter can target (``lora_index`` then one ``lora_slots`` buffer per adapted weight
of the ``lora`` attribute, in its order; added by the ``insert_lora`` pass, absent without a ``lora:`` section).

``attrs`` are required attributes, ``optional`` may be absent or None. The verifier checks every node
against its schema (:func:`check_node`), so a target can rely on them without looking at the spec.
Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence, Union

# Operand kinds (graph name kinds, see graph.NAME_KINDS); "any" accepts every kind.
ANY = "any"


@dataclass(frozen=True)
class Operand:
    role: str
    kind: str = "value"
    variadic: bool = False
    may_be_empty: bool = False  # a variadic role that may take no operand


@dataclass(frozen=True)
class OpDef:
    name: str
    inputs: tuple[Operand, ...] = ()
    outputs: tuple[Operand, ...] = ()
    attrs: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    doc: str = ""
    # the weight attributes that are linear layers (``x @ W^T``): what W8A8 quantizes (graphgen.ir.quant)
    linear: tuple[str, ...] = ()

    def bind(self, names: tuple[str, ...], side: str = "inputs") -> dict[str, Union[str, tuple[str, ...]]]:
        """Role -> name (a tuple for a variadic role) for the operands of one side of a node."""
        roles = self.inputs if side == "inputs" else self.outputs
        var = [i for i, r in enumerate(roles) if r.variadic]
        fixed = len(roles) - len(var)
        least = fixed + (0 if not var or roles[var[0]].may_be_empty else 1)
        if (not var and len(names) != fixed) or (var and len(names) < least):
            want = f"{fixed}" if not var else f"at least {least}"
            raise SchemaError(f"op {self.name} takes {want} {side} "
                              f"({', '.join(r.role + ('...' if r.variadic else '') for r in roles) or 'none'}), "
                              f"got {len(names)}")
        out: dict[str, Union[str, tuple[str, ...]]] = {}
        if not var:
            return {r.role: n for r, n in zip(roles, names)}
        v = var[0]
        after = len(roles) - v - 1
        for r, n in zip(roles[:v], names[:v]):
            out[r.role] = n
        out[roles[v].role] = tuple(names[v:len(names) - after])
        for r, n in zip(roles[v + 1:], names[len(names) - after:]):
            out[r.role] = n
        return out


class SchemaError(ValueError):
    """A node does not match its op's schema."""


def _op(name: str, inputs: Sequence[str] = (), outputs: Sequence[str] = (), attrs: Sequence[str] = (),
        optional: Sequence[str] = (), doc: str = "", linear: Sequence[str] = ()) -> OpDef:
    def operand(spec: str) -> Operand:
        role, _, kind = spec.partition(":")
        empty = role.endswith("*")
        variadic = role.endswith("...") or empty
        return Operand(role.rstrip(".*"), kind or "value", variadic, empty)

    return OpDef(name, tuple(map(operand, inputs)), tuple(map(operand, outputs)), tuple(attrs), tuple(optional), doc,
                 tuple(linear))


_MOE_LINEAR = ("w_experts_gate", "w_experts_up", "w_experts_down", "w_shared_gate", "w_shared_up", "w_shared_down")


_KV_LAYOUT = ("components", "widths", "block_size", "kv_dtype")
# the LoRA operands of an op with projections an adapter can target (the module docstring; graphgen.lora)
_LORA = "lora*:any"

OPS: dict[str, OpDef] = {o.name: o for o in (
    _op("record", attrs=("event",), doc="Record `event` on this node's stream after the work before it."),
    _op("wait", attrs=("event",), doc="Make this stream wait until `event` is recorded."),
    _op("embedding", ("input_ids:input",), ("h",), ("w_embed",), doc="Token embedding lookup."),
    _op("rope_cos_sin", ("positions:input",), ("cos", "sin"), ("rot_dim", "theta", "scaling", "dtype"),
        doc="RoPE cos/sin tables for the step's positions (scaling: YaRN parameters or None). dtype: the "
            "model/KV dtype the tables are consumed in (the NPU RoPE kernels require cos/sin in q/k's dtype; "
            "the CPU target computes them in float32 and casts like transformers)."),
    _op("rms_norm", ("x",), ("y",), ("w_norm", "eps")),
    _op("qwen3_attn_prolog", ("x", "cos", "sin", _LORA), ("q", "k", "v"),
        ("w_q", "w_k", "w_v", "w_q_norm", "w_k_norm", "num_heads", "num_kv_heads", "head_dim", "eps"), optional=("lora", "lora_widths"),
        doc="q/k/v projections, per-head RMSNorm of q and k, half-rotation RoPE.", linear=("w_q", "w_k", "w_v")),
    _op("mla_prolog", ("x", "cos", "sin", _LORA), ("q_nope", "q_pe", "c_kv", "k_pe"),
        ("w_q_b", "w_kv_a", "w_kv_a_norm", "num_heads", "qk_nope_head_dim", "qk_rope_head_dim", "kv_lora_rank",
         "eps", "interleave"),
        optional=("w_q_a", "w_q_a_norm", "lora", "lora_widths"),
        doc="MLA projections. w_q_a/w_q_a_norm are None for uncompressed queries (q_lora_rank null): then "
            "w_q_b is the plain query projection.", linear=("w_q_a", "w_q_b", "w_kv_a")),
    _op("kv_write", ("parts...", "slot_mapping:input"), ("cache:kv_cache",), _KV_LAYOUT,
        doc="Write the step's new KV (one part per cache component) at its slots."),
    _op("paged_attention", ("q", "cache:kv_cache", "block_tables:input", "seq_lens:input", "query_lens:input"),
        ("out",), ("mode", "scale", "num_heads", "num_kv_heads", "head_dim", *_KV_LAYOUT),
        doc="Causal attention of the new tokens over the paged cache (history + new)."),
    _op("mla_attention", ("q_nope", "q_pe", "cache:kv_cache", "block_tables:input", "seq_lens:input",
                          "query_lens:input"), ("out",),
        ("mode", "scale", "w_kv_b", "num_heads", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank",
         "qk_rope_head_dim", *_KV_LAYOUT),
        doc="MLA attention over the compressed latent cache."),
    _op("o_proj_residual", ("attn", "residual", _LORA), ("h",), ("w_o",), optional=("lora", "lora_widths"), linear=("w_o",)),
    _op("swiglu_mlp_residual", ("x", "residual", _LORA), ("h",), ("w_gate", "w_up", "w_down"), optional=("lora", "lora_widths"),
        linear=("w_gate", "w_up", "w_down")),
    _op("moe_residual", ("x", "residual"), ("h",),
        ("w_router", "w_bias", "w_experts_gate", "w_experts_up", "w_experts_down", "top_k", "n_group",
         "topk_group", "routed_scaling_factor", "norm_topk_prob", "num_experts"),
        optional=("w_shared_gate", "w_shared_up", "w_shared_down"), linear=_MOE_LINEAR),
    _op("lm_head", ("h", "logits_indices:input"), ("logits",), ("w_norm", "eps", "w_head")),
    _op("mtp_eh_proj", ("embed", "hidden:input"), ("h",), ("w_enorm", "w_hnorm", "w_eh", "eps"),
        doc="An MTP layer's input: eh_proj(cat[enorm(embedding of token t+1), hnorm(previous hidden at t)])."),
    _op("kv_save", ("caches...:kv_cache", "block_ids:input"), ("staging...:pool_staging",), optional=("writers",),
        doc="Copy the saved blocks of each listed layer's cache into that layer's pool staging. writers: "
            "cp0 when KV is replicated over CP ranks (only CP rank 0's ranks save; absent: every rank)."),
    _op("kv_load", ("loads...:pool_load", "block_ids:input"), ("caches...:kv_cache",),
        doc="Copy each listed layer's loaded history blocks (host-filled load staging) into that layer's "
            "cache at `block_ids`."),
    _op("pool_put", ("staging...:pool_staging",), optional=("writers",),
        doc="Host: commit the staged blocks to the pool (writers: as kv_save's)."),
)}

# Parallel ranks (graphgen.passes.shard): the rank-local halves of the fused ops above, and the
# collectives. Every attribute is the same on every rank (graphs are rank-symmetric); a rank's
# slice of a weight or of the vocabulary/experts follows from its rank at run time.
_COLLECTIVE = ("group", "size")
OPS.update({o.name: o for o in (
    _op("all_reduce", ("x",), ("y",), (*_COLLECTIVE, "reduce"),
        doc="Collective: element-wise `reduce` (sum) of x over the ranks of `group` (`size` ranks)."),
    _op("all_gather", ("x",), ("y",), (*_COLLECTIVE, "dim", "length"),
        doc="Collective: concatenate every rank's x along `dim`, keep the first `length` (vocab padding; "
            "null keeps all: the tokens of sequence parallel and of DP attention's MoE)."),
    _op("reduce_scatter", ("x",), ("y",), (*_COLLECTIVE, "reduce", "dim"),
        doc="Collective: element-wise `reduce` (sum) of x over the ranks of `group`, each rank keeping its "
            "1/`size` chunk along `dim` (the tokens, padded by the runner to a multiple of `size`)."),
    _op("embedding_shard", ("input_ids:input",), ("partial",), ("w_embed", "vocab_size", *_COLLECTIVE),
        doc="Vocab-parallel lookup: rows of this rank's vocabulary slice, zeros elsewhere (a partial sum)."),
    _op("o_proj", ("attn",), ("partial",), ("w_o",), doc="Row-parallel output projection (a partial sum).",
        linear=("w_o",)),
    _op("swiglu_mlp", ("x",), ("partial",), ("w_gate", "w_up", "w_down"),
        doc="SwiGLU MLP, gate/up column- and down row-parallel (a partial sum).", linear=("w_gate", "w_up", "w_down")),
    _op("moe", ("x",), ("partial",),
        ("w_router", "w_bias", "w_experts_gate", "w_experts_up", "w_experts_down", "top_k", "n_group",
         "topk_group", "routed_scaling_factor", "norm_topk_prob", "num_experts", "ep"),
        optional=("w_shared_gate", "w_shared_up", "w_shared_down"),
        doc="MoE over this rank's experts (ep > 1: num_experts/ep whole experts; else a TP slice of "
            "every expert), routing replicated, for all tokens (a partial sum).", linear=_MOE_LINEAR),
    _op("residual_add", ("x", "residual"), ("h",), doc="h = x + residual."),
)})
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter")
# Ops whose output is one rank's partial sum: only an all_reduce or a reduce_scatter may read it.
PARTIAL_OPS = ("embedding_shard", "o_proj", "swiglu_mlp", "moe")


def opdef(op: str) -> OpDef:
    try:
        return OPS[op]
    except KeyError:
        raise SchemaError(f"unknown op {op!r}; known ops: {', '.join(sorted(OPS))}") from None


class NodeFields(Protocol):
    """What :func:`check_node` reads of a node (a `graphgen.ir.graph.Node`, which imports this module)."""

    id: str
    op: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    attrs: dict[str, Any]


def check_node(node: NodeFields, kinds: Optional[dict[str, str]] = None) -> list[str]:
    """Problems of one node against its schema (``kinds``: graph name -> kind, to check operand kinds)."""
    try:
        d = opdef(node.op)
    except SchemaError as e:
        return [f"node {node.id}: {e}"]
    problems = []
    for side, names, roles in (("inputs", node.reads, d.inputs), ("outputs", node.writes, d.outputs)):
        try:
            bound = d.bind(tuple(names), side)
        except SchemaError as e:
            problems.append(f"node {node.id}: {e}")
            continue
        if kinds is None:
            continue
        for r in roles:
            if r.kind == ANY:
                continue
            got = bound[r.role]
            for name in (got if isinstance(got, tuple) else (got,)):
                if kinds.get(name) not in (None, r.kind):
                    problems.append(f"node {node.id}: {side[:-1]} {r.role} of {node.op} must be a {r.kind}, "
                                    f"{name} is a {kinds[name]}")
    missing = [a for a in d.attrs if a not in node.attrs]
    if missing:
        problems.append(f"node {node.id}: op {node.op} lacks attribute(s) {', '.join(missing)}")
    unknown = sorted(set(node.attrs) - set(d.attrs) - set(d.optional))
    if unknown:
        problems.append(f"node {node.id}: op {node.op} has unknown attribute(s) {', '.join(unknown)}")
    return problems
