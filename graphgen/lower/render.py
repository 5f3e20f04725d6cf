"""Lowering infrastructure: how IR names and attribute values are spelled in generated Python, and the
jinja2 frame a target's lines are put into (``templates/<target>/variant.py.j2``, beside ``graphgen/``).

The IR decides *what* runs on which stream and where every record/wait sits; a target's emitters
(:mod:`graphgen.lower.cpu`, :mod:`graphgen.lower.npu`) decide how one node is spelled; the templates
hold only the file frame (header, constants, function signatures) with the bodies as slots. They run
with ``StrictUndefined``, so a missing slot is an error, never an empty string.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Protocol

import jinja2

from ..ir.graph import Graph, Node
from ..ir.quant import NONE, W8A8, quantized_attrs, scale_name

# The frames live in the checkout's top-level templates/; a wheel carries them as graphgen/lower/templates/
# (pyproject.toml maps the package graphgen.lower.templates to templates/). The package's copy comes
# first: an installed graphgen never reads a stray templates/ folder beside site-packages.
PACKAGE_TEMPLATES = Path(__file__).resolve().parent / "templates"
CHECKOUT_TEMPLATES = Path(__file__).resolve().parents[2] / "templates"
_TAG = re.compile(r"^(kv_cache|pool_staging|pool_load)\.L(\d+)$")

# An emitter spells one node as lines of Python, given its target's context (a `cpu.CpuCtx`, an
# `npu.NpuCtx`; Any here, so one table type holds both targets' emitters).
Emitter = Callable[[Node, Any], list[str]]


class EmitContext(Protocol):
    """What the emitters shared by the targets (or by a target and its parallel-rank ops) read of a context."""

    @property
    def ref(self) -> Names: ...

    @property
    def loaded(self) -> dict[str, Any]: ...  # load-time weight key -> recipe (the module's LOAD_TIME_WEIGHTS)


class RankEmitContext(EmitContext, Protocol):
    """... and, for the NPU's collectives, the layout's ranks."""

    @property
    def world(self) -> int: ...  # ranks of the layout (dp x cp x tp)

    @property
    def tp(self) -> int: ...


class LoweringError(ValueError):
    """A node a target cannot spell (unknown op, unknown attention mode, unknown compile mode)."""


def template_dir() -> Path:
    """Where the jinja2 frames are: in the package (a wheel) or in the checkout (a source tree, an
    editable install); LoweringError naming both when neither holds them."""
    for where in (PACKAGE_TEMPLATES, CHECKOUT_TEMPLATES):
        if (where / "cpu" / "variant.py.j2").is_file():
            return where
    raise LoweringError(f"the lowering's jinja2 frames are in neither {PACKAGE_TEMPLATES} nor {CHECKOUT_TEMPLATES}: "
                        f"reinstall graphgen (pip install .) or restore templates/ in the checkout")


@functools.lru_cache(maxsize=None)
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["py"] = py
    return env


def render_frame(template: str, **slots: Any) -> str:
    return environment().get_template(template).render(**slots)


def py(value: Any) -> str:
    """A Python literal for an attribute value (deterministic: dict keys sorted)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {py(value[k])}" for k in sorted(value)) + "}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(py(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    return repr(value)


def layer_of(name: str) -> int:
    m = _TAG.match(name)
    if not m:
        raise ValueError(f"{name!r} is not a per-layer buffer")
    return int(m.group(2))


def layer_list(names: Iterable[str]) -> str:
    """``range(n)`` when the names are layers 0..n-1 in order, else an explicit tuple."""
    layers = [layer_of(n) for n in names]
    if layers == list(range(len(layers))):
        return f"range({len(layers)})"
    return py(tuple(layers))


class Names:
    """IR name -> expression in generated Python: inputs are fields of the step inputs ``b``, KV
    caches ``kv[L]``, pool staging ``staging[L]``, load staging ``loads[L]``, LoRA slots ``b.lora[weight]``,
    values local variables."""

    def __init__(self, graph: Graph, inputs_obj: str = "b"):
        self.kinds, self.inputs_obj = graph.names, inputs_obj

    def __call__(self, name: str) -> str:
        kind = self.kinds[name]
        if kind == "input":
            return f"{self.inputs_obj}.{name}"
        if kind == "kv_cache":
            return f"kv[{layer_of(name)}]"
        if kind == "pool_staging":
            return f"staging[{layer_of(name)}]"
        if kind == "pool_load":
            return f"loads[{layer_of(name)}]"
        if kind == "lora_slots":  # one projection's adapter slots (graphgen.lora), by checkpoint weight
            return f"{self.inputs_obj}.lora[{name.split('.', 1)[1] + '.weight'!r}]"
        return name.replace(".", "_")

    def all(self, names: Iterable[str]) -> str:
        return ", ".join(map(self, names))


# The MoE op's weights in argument order and its routing keywords: the same on both targets (and
# their rank-local forms), so they live here rather than in one target's emitters.
MOE_WEIGHTS = ("w_router", "w_bias", "w_experts_gate", "w_experts_up", "w_experts_down", "w_shared_gate",
               "w_shared_up", "w_shared_down")


def moe_kwargs(a: dict[str, Any]) -> list[str]:
    return [f"top_k={a['top_k']}", f"n_group={a['n_group']}", f"topk_group={a['topk_group']}",
            f"routed_scaling_factor={py(a['routed_scaling_factor'])}", f"norm_topk_prob={py(a['norm_topk_prob'])}"]


def weight(node: Node, attr: str) -> str:
    """``W['<checkpoint key>']`` for a weight attribute, ``None`` where an optional weight is absent."""
    key = node.attrs.get(attr)
    return "None" if key is None else f"W[{key!r}]"


LOAD_KEY_PREFIX = "graphgen.load:"


def _load_time_key(node: Node, loaded: dict[str, Any], attrs: tuple[str, ...], *, dim: int, transpose12: bool,
                   transpose01: bool, quant: Optional[str]) -> Optional[str]:
    present = [node.attrs.get(a) for a in attrs]
    if all(k is None for k in present):
        return None
    keys = [k for k in present if k is not None]
    if len(keys) != len(present):
        raise LoweringError(f"node {node.id}: {attrs} must be all present or all absent to merge them")
    key = (f"{LOAD_KEY_PREFIX}{'+'.join(keys)}:cat{dim}" + (":t12" if transpose12 else "")
           + (":t01" if transpose01 else "") + (f":{quant}" if quant else ""))
    recipe: dict[str, Any] = {"cat": tuple(keys), "dim": dim, "transpose12": transpose12}
    if transpose01:  # only where used, so the NPU modules' recipes read as before
        recipe["transpose01"] = True
    if quant:  # int8, plus W[key + ':scale'] (graphgen.ir.quant)
        recipe["quant"] = quant
    loaded[key] = recipe
    return key


def load_time_weight(node: Node, loaded: dict[str, Any], attrs: tuple[str, ...], *, dim: int, transpose12: bool = False,
                     transpose01: bool = False) -> str:
    """``W['<key>']`` of a weight built once at load time (`graphgen.runtime.core.weights.load_time_weights`)
    from the checkpoint tensors of ``attrs``: concatenated along ``dim``, then made contiguous transposed —
    ``transpose(1, 2)`` when ``transpose12`` (3-d: the NPU's expert stacks), ``t()`` when ``transpose01``
    (2-d: the CPU's ``[in, out]`` projections). The recipe is recorded in ``loaded`` (the module's
    ``LOAD_TIME_WEIGHTS``); ``None`` when every attribute is absent (an optional weight)."""
    key = _load_time_key(node, loaded, attrs, dim=dim, transpose12=transpose12, transpose01=transpose01, quant=None)
    return "None" if key is None else f"W[{key!r}]"


def linear_weight(node: Node, ctx: Any, attrs: tuple[str, ...], *, pair: str, dim: int = 0, transpose12: bool = False,
                  transpose01: bool = False, quant_transpose01: Optional[bool] = None) -> str:
    """The weight of a linear layer (``attrs``: merged along ``dim``, as `load_time_weight`). Under W8A8
    (``ctx.quant``, `graphgen.ir.quant`) the int8 load-time weight and its per-output-channel scales,
    spelled by ``pair`` (a format of ``{w}`` and ``{scale}``: the target's), laid out as the unquantized
    one unless ``quant_transpose01`` says otherwise; else the load-time weight, or the checkpoint tensor
    itself where nothing is merged or transposed."""
    quantized = quantized_attrs(node, getattr(ctx, "quant", NONE))
    if any(node.attrs.get(a) is not None for a in attrs) and all(a in quantized for a in attrs
                                                                 if node.attrs.get(a) is not None):
        t01 = transpose01 if quant_transpose01 is None else quant_transpose01
        key = _load_time_key(node, ctx.loaded, attrs, dim=dim, transpose12=transpose12, transpose01=t01, quant=W8A8)
        assert key is not None
        return pair.format(w=f"W[{key!r}]", scale=f"W[{scale_name(key)!r}]")
    if len(attrs) == 1 and not (transpose12 or transpose01):
        return weight(node, attrs[0])
    return load_time_weight(node, ctx.loaded, attrs, dim=dim, transpose12=transpose12, transpose01=transpose01)


def load_time_weights_literal(loaded: dict[str, Any]) -> str:
    """A module's ``LOAD_TIME_WEIGHTS`` as Python source: one recipe per line, keys sorted (deterministic)."""
    return "{" + "".join(f"\n    {k!r}: {py(loaded[k])}," for k in sorted(loaded)) + ("\n}" if loaded else "}")


def emit_with(table: dict[str, Emitter], target: str, node: Node, ctx: Any) -> list[str]:
    fn = table.get(node.op)
    if fn is None:
        raise LoweringError(f"no {target} lowering for op '{node.op}' (node {node.id})")
    return fn(node, ctx)


def lora_segments(n: Node, ctx: "EmitContext", merged: tuple[str, ...]) -> Optional[str]:
    """The adapter slots of those of the projections ``merged`` (concatenated along the output) that node ``n``
    adapts, as the targets' LoRA wrappers take them: ``"((offset, slot), ...,)"``, each at the offset of its
    output columns; None when the node adapts none of them (both targets' emitters: `graphgen.lower.cpu._lora`,
    `graphgen.lower.npu_calls.lora_weight`)."""
    adapted = tuple(n.attrs.get("lora") or ())
    if not any(w in adapted for w in merged):
        return None
    slots = dict(zip(adapted, n.input("lora")[1:]))
    widths = dict(n.attrs["lora_widths"])
    segs, off = [], 0
    for w in merged:
        if w in slots:
            segs.append(f"({off}, {ctx.ref(slots[w])})")
        off += widths[w]
    return f"({', '.join(segs)},)"
