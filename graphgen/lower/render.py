"""Lowering: render a verified graph into target code with jinja2 templates (``templates/``).

The IR decides *what* runs on which stream and where every record/wait sits; templates decide
only how one node is spelled on a target. ``ref`` maps IR names to target expressions; templates
run with ``StrictUndefined`` so a missing attribute is an error, never an empty string.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import jinja2

from ..ir.graph import Graph

TEMPLATE_DIR = Path(__file__).resolve().parents[2] / "templates"
_TAG = re.compile(r"^(kv_cache|pool_staging)\.L(\d+)$")


def _fail(message: str):
    raise jinja2.TemplateError(message)


@functools.lru_cache(maxsize=None)
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["py"] = _py
    env.globals["fail"] = _fail
    return env


def _py(value) -> str:
    """A Python literal for an attribute value (deterministic: dict keys sorted)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_py(value[k])}" for k in sorted(value)) + "}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_py(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    return repr(value)


def layer_of(name: str) -> int:
    m = _TAG.match(name)
    if not m:
        raise ValueError(f"{name!r} is not a per-layer buffer")
    return int(m.group(2))


def make_ref(graph: Graph, inputs_obj: str = "b"):
    """IR name -> expression in generated Python code."""

    def ref(name: str) -> str:
        kind = graph.names[name]
        if kind == "input":
            return f"{inputs_obj}.{name}"
        if kind == "kv_cache":
            return f"kv[{layer_of(name)}]"
        if kind == "pool_staging":
            return f"staging[{layer_of(name)}]"
        return name.replace(".", "_")

    return ref


def layer_list(names) -> str:
    """``range(n)`` when the names are layers 0..n-1 in order, else an explicit tuple."""
    layers = [layer_of(n) for n in names]
    if layers == list(range(len(layers))):
        return f"range({len(layers)})"
    return _py(tuple(layers))


def render(template: str, graph: Graph, **extra) -> str:
    env = environment()
    streams = {s: graph.on_stream(s) for s in graph.streams}
    host_event = next((n.attrs["event"] for n in streams.get("host", ()) if n.op == "wait"), None)
    ref = make_ref(graph)
    return env.get_template(template).render(
        g=graph, meta=graph.meta, streams=streams, ref=ref, refs=lambda names: ", ".join(map(ref, names)),
        layer_list=layer_list,
        events=list(graph.events), host_event=host_event, **extra)
