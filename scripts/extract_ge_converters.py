#!/usr/bin/env python
"""Extract torchair's GE converter table and its AOT decomposition table from the torch-npu wheel.

The wheel is read as a zip archive and its Python sources are parsed with ``ast``; nothing from it
is imported or executed (as ``scripts/extract_npu_manifest.py``).  The result is
``graphgen/npu/check/ge_converters.json``: sorted, deterministic, with the wheel's name and sha256
and, for every entry, the file:line it came from.  ``graphgen.npu.check.geops`` checks post-AOT FX
graphs against it; CI reads only the committed JSON and never downloads.

What is extracted (``air/`` = ``torch_npu/dynamo/torchair/``):

* ``converters``: every ``register_fx_node_ge_converter(X)`` in ``air/`` (decorator or call form;
  most live under ``air/_ge_concrete_graph/ge_converter/``, a few under ``air/ops/``), keyed by the
  target as ``str()`` prints it.  ``X`` may be an overload (``torch.ops.aten.sort.stable``), an
  optional overload (``getattr(torch.ops.aten.rand, "names", None)``: registered only if this torch
  has it, else ``register_fx_node_ge_converter(None)`` is a no-op, ``fx2ge_converter.py:539-551``),
  a packet (``torch.ops.aten.sym_size``) or a Python callable (``operator.add``).  A packet
  registration sets ``packet._ge_converter`` (``fx2ge_converter.py:500-504``); the lookup for an FX
  node reads ``target._ge_converter`` on the node's OpOverload (``:813-817``, ``:323-338``), which an
  OpOverload does not inherit from its packet, so a packet entry covers only a node whose target is
  the packet itself, never its overloads: that is how torchair maps it, and how the check maps it.
  Each converter is ``real`` or ``raises``: ``raises`` when its body (docstring ignored) raises on
  every path (a bare ``raise RuntimeError("... not supported!")``, ``NotImplementedError``, or
  ifs whose every branch raises).  Converters registered only in lite-export mode
  (``ge_converter/lite/``, imported under ``lite_converter_mode`` at ``npu_fx_compiler.py:678-682``
  when ``enable_lite_export`` is set) are kept apart under ``lite_converters``.
* ``decompositions``: the table torchair hands to ``aot_module_simplified``
  (``get_npu_backend`` -> ``_get_merged_decompositions`` -> ``get_npu_default_decompositions``,
  ``air/_utils/__init__.py``) and the implicit-decomposition adjustments ``add_npu_patch`` makes
  (``air/_utils/adjust_implicit_decomposition.py``).
* ``special_targets``: targets ``_parse_node_internal`` handles before any converter lookup
  (``str(target) == ...`` comparisons: scopes, record/wait, sym_stride, auto_functionalized_v2).
* ``builtin_rule``: builtin callables other than the binary operators are executed by the FX
  interpreter, not converted (``npu_fx_compiler.py`` ``_wrap``: ``is_builtin_callable(target) and not
  _is_binary_operator(target)``); the binary operators need a converter (``builtin_converters.py``).

Usage::

    python scripts/extract_ge_converters.py                       # pip download torch-npu==2.14.0
    python scripts/extract_ge_converters.py --wheel /tmp/w/torch_npu-...whl
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling script: one wheel reader
from extract_npu_manifest import Wheel as _ManifestWheel, download_wheel  # noqa: E402

from graphgen.npu.check.conformance import _dotted  # noqa: E402  (one dotted-name reader)

TORCH_NPU_VERSION = "2.14.0"
AIR = "torch_npu/dynamo/torchair/"
LITE_DIR = AIR + "_ge_concrete_graph/ge_converter/lite/"
FX2GE = AIR + "_ge_concrete_graph/fx2ge_converter.py"
FX_COMPILER = AIR + "npu_fx_compiler.py"
UTILS = AIR + "_utils/__init__.py"
ADJUST = AIR + "_utils/adjust_implicit_decomposition.py"
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "graphgen" / "npu" / "check" / "ge_converters.json"
REGISTER = "register_fx_node_ge_converter"


class Wheel(_ManifestWheel):
    """The manifest script's read-only wheel view (one home), with its files in sorted order and parsed."""

    def __init__(self, path: Path):
        super().__init__(path)
        self.names = sorted(self.names)

    def tree(self, name: str) -> ast.Module:
        return ast.parse(self.text(name), filename=name)


def _short(path: str) -> str:
    """Wheel path as the audit cites it: ``air/...`` for torchair files."""
    return "air/" + path[len(AIR):] if path.startswith(AIR) else path


# --------------------------------------------------------------------------- targets
# Python callables torchair registers converters for, spelled as graphgen's check prints targets
# (``module.qualname``): ``operator.add`` is ``_operator.add`` at run time.
_CALLABLE_MODULES = {"operator": "_operator", "math": "math", "torch": "torch"}


def parse_target(node: ast.AST) -> dict | None:
    """The registered target: {"target", "form"} or None when it is computed at run time."""
    if isinstance(node, ast.Call) and _dotted(node.func) == "getattr" and len(node.args) == 3:
        base, attr = _dotted(node.args[0]), node.args[1]
        if base and base.startswith("torch.ops.") and isinstance(attr, ast.Constant):
            return {"target": base[len("torch.ops."):] + "." + attr.value, "form": "optional_overload"}
        return None
    d = _dotted(node)
    if d is None:
        return None
    if d.startswith("torch.ops."):
        parts = d[len("torch.ops."):].split(".")
        if parts[0] == "higher_order":  # HigherOrderOperator: str() is its name
            return {"target": parts[1], "form": "higher_order"}
        if len(parts) == 3:
            return {"target": ".".join(parts), "form": "overload"}
        if len(parts) == 2:
            return {"target": ".".join(parts), "form": "packet"}
        return None
    head, _, rest = d.partition(".")
    if head in _CALLABLE_MODULES and rest:
        return {"target": f"{_CALLABLE_MODULES[head]}.{rest}", "form": "callable"}
    if "." not in d:  # a bare imported name (e.g. sym_sqrt): resolved below from the module's imports
        return {"target": d, "form": "name"}
    return None


def _imported_names(tree: ast.Module) -> dict[str, str]:
    out = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module:
            for a in n.names:
                out[a.asname or a.name] = f"{n.module}.{a.name}"
    return out


# --------------------------------------------------------------------------- raises?
def _body(fn: ast.FunctionDef) -> list[ast.stmt]:
    b = list(fn.body)
    if b and isinstance(b[0], ast.Expr) and isinstance(b[0].value, ast.Constant) and isinstance(b[0].value.value, str):
        b = b[1:]
    return b


def always_raises(stmts: list[ast.stmt]) -> bool:
    """Does this block raise on every path?  (Reaching a return, or the end, means it does not.)"""
    for s in stmts:
        if isinstance(s, ast.Raise):
            return True
        if isinstance(s, ast.Return):
            return False
        if isinstance(s, ast.If) and s.orelse and always_raises(s.body) and always_raises(s.orelse):
            return True
    return False


def _raise_message(stmts: list[ast.stmt]) -> str:
    for s in ast.walk(ast.Module(body=stmts, type_ignores=[])):
        if isinstance(s, ast.Raise) and s.exc is not None:
            return ast.unparse(s.exc)
    return ""


# --------------------------------------------------------------------------- converters
def extract_converters(wheel: Wheel) -> tuple[list[dict], list[dict]]:
    """(registrations, unresolved): one dict per register_fx_node_ge_converter(...) in air/."""
    regs, unresolved = [], []
    for path in [n for n in wheel.names if n.startswith(AIR) and n.endswith(".py")]:
        text = wheel.text(path)
        if REGISTER not in text:
            continue
        tree = ast.parse(text, filename=path)
        imports = _imported_names(tree)
        funcs = {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}

        def add(call: ast.Call, fn: ast.AST | None):
            if path == AIR + "__init__.py" or not call.args:
                return  # the public re-export wrapper, not a registration
            t = parse_target(call.args[0])
            if t is not None and t["form"] == "name":
                full = imports.get(t["target"])
                t = {"target": full.replace("torch.fx.experimental.", "torch.fx.experimental."), "form": "callable"} \
                    if full else None
            where = f"{_short(path)}:{call.lineno}"
            if t is None or fn is None:
                unresolved.append({"source": where, "expr": ast.unparse(call)})
                return
            body = _body(fn)
            raises = always_raises(body)
            regs.append({"target": t["target"], "form": t["form"], "kind": "raises" if raises else "real",
                         "function": fn.name, "source": where, "lite": path.startswith(LITE_DIR),
                         **({"message": _raise_message(body)} if raises else {})})

        for fn in funcs.values():
            for dec in fn.decorator_list:
                if isinstance(dec, ast.Call) and _dotted(dec.func) == REGISTER:
                    add(dec, fn)
        for n in ast.walk(tree):  # call form: register_fx_node_ge_converter(X)(func)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Call) and _dotted(n.func.func) == REGISTER:
                arg = n.args[0] if n.args else None
                add(n.func, funcs.get(arg.id) if isinstance(arg, ast.Name) else None)
    return regs, unresolved


def merge(regs: list[dict]) -> dict[str, dict]:
    """target -> entry.  A target registered twice keeps every source; its kind is ``raises`` if any
    registration only raises (which one wins depends on import order, so the check assumes the worse)."""
    out: dict[str, dict] = {}
    for r in sorted(regs, key=lambda r: (r["target"], r["source"])):
        e = out.setdefault(r["target"], {"form": r["form"], "kind": "real", "sources": []})
        e["sources"].append(f'{r["source"]} {r["function"]}' + (f' raises {r["message"]}' if r["kind"] == "raises"
                                                                  else ""))
        if r["kind"] == "raises":
            e["kind"] = "raises"
    return out


# --------------------------------------------------------------------------- decompositions
def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    for n in ast.walk(tree):
        if isinstance(n, ast.FunctionDef) and n.name == name:
            return n
    raise SystemExit(f"{name} not found: the wheel's layout changed; update scripts/extract_ge_converters.py")


def extract_decompositions(wheel: Wheel) -> dict:
    """The AOT decomposition table get_npu_default_decompositions() builds, entry by entry."""
    fn = _function(wheel.tree(UTILS), "get_npu_default_decompositions")
    table = []

    def visit(stmts, cond):
        for s in stmts:
            if isinstance(s, ast.If):
                visit(s.body, ast.unparse(s.test))
                continue
            for c in ast.walk(s):
                if (isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == "update"
                        and c.args and isinstance(c.args[0], ast.Dict)):
                    for k, v in zip(c.args[0].keys, c.args[0].values):
                        t = parse_target(k)
                        table.append({"target": t["target"] if t else ast.unparse(k), "decomposition": ast.unparse(v),
                                      "source": f"{_short(UTILS)}:{k.lineno}", **({"condition": cond} if cond else {})})

    visit(fn.body, None)
    adjust = wheel.tree(ADJUST)
    implicit = []
    for n in adjust.body:
        if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name) and n.targets[0].id in (
                "replace_aten_ops", "disable_aten_ops"):
            elts = n.value.keys if isinstance(n.value, ast.Dict) else n.value.elts
            for k in elts:
                implicit.append({"target": k.value, "action": n.targets[0].id.split("_")[0],
                                 "source": f"{_short(ADJUST)}:{k.lineno}"})
    backend = _function(wheel.tree(FX_COMPILER), "_get_merged_decompositions")
    return {"aot_table": sorted(table, key=lambda e: e["target"]),
            "implicit_adjustments": sorted(implicit, key=lambda e: e["target"]),
            "merged_in": f"{_short(FX_COMPILER)}:{backend.lineno} _get_merged_decompositions "
                         f"(defaults, then the caller's custom_decompositions; graphgen passes none)"}


def extract_special_targets(wheel: Wheel) -> list[dict]:
    """Targets _parse_node_internal handles itself: ``str(target) == 'x'`` / ``in [...]`` tests."""
    fn = _function(wheel.tree(FX2GE), "_parse_node_internal")
    out = []
    for n in ast.walk(fn):
        if not (isinstance(n, ast.Compare) and ast.unparse(n.left) == "str(target)"):
            continue
        for op, cmp in zip(n.ops, n.comparators):
            if isinstance(op, (ast.Eq, ast.In)):
                vals = [cmp] if isinstance(cmp, ast.Constant) else getattr(cmp, "elts", [])
                out += [{"target": v.value, "source": f"{_short(FX2GE)}:{n.lineno}"} for v in vals
                        if isinstance(v, ast.Constant)]
    return sorted(out, key=lambda e: e["target"])


def extract_builtin_rule(wheel: Wheel) -> dict:
    tree = wheel.tree(FX_COMPILER)
    binop = _function(tree, "_is_binary_operator")
    ops = []
    for n in ast.walk(binop):
        if isinstance(n, ast.Tuple):
            ops = [parse_target(e)["target"] for e in n.elts]
    rule = next(n for n in ast.walk(tree) if isinstance(n, ast.If)
                and "is_builtin_callable(target)" in ast.unparse(n.test) and "_is_binary_operator" in ast.unparse(n.test))
    return {"binary_operators": sorted(ops), "binary_operators_source": f"{_short(FX_COMPILER)}:{binop.lineno}",
            "source": f"{_short(FX_COMPILER)}:{rule.lineno}",
            "rule": "builtin callables other than the binary operators are executed by the FX interpreter "
                    "(no converter); binary operators go through parse_node and need one"}


def build(wheel_path: Path) -> dict:
    wheel = Wheel(wheel_path)
    regs, unresolved = extract_converters(wheel)
    return {
        "format": 1,
        "generated_by": "scripts/extract_ge_converters.py (ast over the wheel; nothing imported)",
        "wheel": {"name": wheel_path.name, "sha256": wheel.sha256(), "torch_npu_version": TORCH_NPU_VERSION},
        "converters": merge([r for r in regs if not r["lite"]]),
        "lite_converters": merge([r for r in regs if r["lite"]]),
        "unresolved_registrations": sorted(unresolved, key=lambda e: e["source"]),
        "decompositions": extract_decompositions(wheel),
        "special_targets": extract_special_targets(wheel),
        "builtin_rule": extract_builtin_rule(wheel),
    }


def dump(table: dict) -> str:
    """One converter per line (reviewable diffs), keys sorted: byte-deterministic."""
    lines = ["{"]
    keys = sorted(table)
    for i, k in enumerate(keys):
        v, comma = table[k], "," if i < len(keys) - 1 else ""
        if k in ("converters", "lite_converters") and v:
            lines.append(f" {json.dumps(k)}: {{")
            items = sorted(v.items())
            for j, (t, e) in enumerate(items):
                lines.append(f"  {json.dumps(t)}: {json.dumps(e, sort_keys=True, separators=(',', ':'))}"
                             + ("," if j < len(items) - 1 else ""))
            lines.append(" }" + comma)
        else:
            lines.append(f" {json.dumps(k)}: {json.dumps(v, sort_keys=True)}{comma}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheel", type=Path, help="use this torch_npu wheel instead of downloading it")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    if args.wheel:
        table = build(args.wheel)
    else:
        with tempfile.TemporaryDirectory() as d:
            table = build(download_wheel(Path(d)))
    args.out.write_text(dump(table))
    n = table["converters"]
    print(f"{args.out}: {len(n)} converter targets ({sum(e['kind'] == 'raises' for e in n.values())} only raise), "
          f"{len(table['decompositions']['aot_table'])} AOT decompositions, "
          f"{len(table['unresolved_registrations'])} registrations computed at run time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
