"""Strict spec loading: YAML (with line numbers) -> :class:`ModelSpec`.

Contract:
- every problem of a file is collected and reported at once (:class:`SpecError`), each with
  ``file:line:col``, what is wrong and how to fix it;
- unknown keys get a did-you-mean, duplicate keys are errors (plain YAML keeps the last silently),
  types are exact (no string "2" for an int), names that reach generated code are identifiers;
- the compatibility matrix (``compat.py``) runs on the parsed spec;
- ``dump_spec`` writes a spec back to plain data, and ``parse(dump(spec)) == spec``.
"""

from __future__ import annotations

import dataclasses
import difflib
import keyword
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from . import model as m
from .errors import Diagnostic, SpecError

_MISSING = object()


class _Node:
    """A YAML value with its position (1-based line/col)."""

    __slots__ = ("value", "line", "col", "key_pos")

    def __init__(self, value, line, col, key_pos=None):
        self.value = value
        self.line = line
        self.col = col
        self.key_pos = key_pos or {}  # for mappings: key -> (line, col) of the key


class _Ctx:
    def __init__(self, file: str):
        self.file = file
        self.diags: list[Diagnostic] = []

    def error(self, where, message: str, fix: str = "") -> None:
        line, col = where if isinstance(where, tuple) else (where.line, where.col)
        self.diags.append(Diagnostic(self.file, line, col, message, fix))


def _compose(text: str, ctx: _Ctx):
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        ctx.error((line, col), f"invalid YAML: {e.problem or e.context}",
                  "fix the YAML syntax at this position")
        return None
    if root is None:
        ctx.error((1, 1), "the spec file is empty", "start from specs/tiny_qwen3.yaml")
        return None
    return _convert(root, ctx)


def _convert(node, ctx: _Ctx) -> _Node:
    line, col = node.start_mark.line + 1, node.start_mark.column + 1
    if isinstance(node, yaml.MappingNode):
        out, pos = {}, {}
        for knode, vnode in node.value:
            key = knode.value
            kpos = (knode.start_mark.line + 1, knode.start_mark.column + 1)
            if key in out:
                ctx.error(kpos, f"duplicate key '{key}' (first defined on line {pos[key][0]})",
                          "remove one of the two entries")
                continue
            out[key] = _convert(vnode, ctx)
            pos[key] = kpos
        return _Node(out, line, col, pos)
    if isinstance(node, yaml.SequenceNode):
        return _Node([_convert(v, ctx) for v in node.value], line, col)
    # Scalars: resolve with the safe loader's implicit tags (int, float, bool, null, str).
    loader = yaml.SafeLoader("")
    try:
        value = loader.construct_object(node, deep=True)
    finally:
        loader.dispose()
    return _Node(value, line, col)


def _type_name(tp) -> str:
    if tp is bool:
        return "a boolean (true/false)"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    return str(tp)


def _hints(cls):
    return typing.get_type_hints(cls, globalns=vars(m))


def _parse_value(tp, node: _Node, ctx: _Ctx, path: str, meta: dict):
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if node.value is None:
            return None
        return _parse_value(args[0], node, ctx, path, meta)
    if origin is Literal:
        choices = get_args(tp)
        if node.value not in choices:
            close = difflib.get_close_matches(str(node.value), [str(c) for c in choices], n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            ctx.error(node, f"{path}: '{node.value}' is not one of {', '.join(map(str, choices))}",
                      f"{hint}use one of: {', '.join(map(str, choices))}")
            return _MISSING
        return node.value
    if origin is tuple:
        (item,) = [a for a in get_args(tp) if a is not Ellipsis]
        if not isinstance(node.value, list):
            ctx.error(node, f"{path}: expected a list, got {type(node.value).__name__}",
                      f"write {path.split('.')[-1]}: [...]")
            return _MISSING
        items = [_parse_value(item, n, ctx, f"{path}[{i}]", meta) for i, n in enumerate(node.value)]
        return _MISSING if any(x is _MISSING for x in items) else tuple(items)
    if dataclasses.is_dataclass(tp):
        return _parse_dataclass(tp, node, ctx, path)
    if tp is float:
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            ctx.error(node, f"{path}: expected {_type_name(float)}, got {node.value!r}",
                      "write a plain number, e.g. 1.0e-6")
            return _MISSING
        return float(node.value)
    if tp in (int, bool, str):
        ok = isinstance(node.value, tp) and not (tp is int and isinstance(node.value, bool))
        if not ok:
            ctx.error(node, f"{path}: expected {_type_name(tp)}, got {node.value!r}",
                      f"write {_type_name(tp)} without quotes" if tp is not str else "quote the value")
            return _MISSING
        if tp is int and "minimum" in meta and node.value < meta["minimum"]:
            ctx.error(node, f"{path}: must be >= {meta['minimum']}, got {node.value}",
                      f"use a value of at least {meta['minimum']}")
            return _MISSING
        return node.value
    raise TypeError(f"unsupported spec field type {tp!r} at {path}")  # programming error


def _check_identifier(name, node_or_pos, ctx: _Ctx, what: str) -> bool:
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name) or not name.isascii():
        ctx.error(node_or_pos, f"{what} {name!r} is not a Python identifier (it names generated code)",
                  "use letters, digits and underscores, not starting with a digit, e.g. my_model")
        return False
    return True


def _check_keys(cls, node: _Node, ctx: _Ctx, path: str, allowed: list[str]) -> None:
    for key in node.value:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.6)
            fix = f"did you mean '{close[0]}'?" if close else f"allowed keys: {', '.join(allowed)}"
            ctx.error(node.key_pos[key], f"unknown key '{key}' in {path or 'the spec'}", fix)


def _parse_dataclass(cls, node: _Node, ctx: _Ctx, path: str, *, family=None):
    if not isinstance(node.value, dict):
        ctx.error(node, f"{path or 'the spec'}: expected a mapping, got {node.value!r}",
                  "write key: value pairs, one per line")
        return _MISSING
    fields = dataclasses.fields(cls)
    hints = _hints(cls)
    _check_keys(cls, node, ctx, path, [f.name for f in fields])
    kwargs: dict[str, Any] = {}
    failed = False
    for f in fields:
        sub = f"{path}.{f.name}" if path else f.name
        if f.name not in node.value:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                ctx.error(node, f"missing required key '{sub}'",
                          f"add '{f.name}: ...' ({f.metadata.get('doc', '')})".rstrip())
                failed = True
            continue
        vnode = node.value[f.name]
        if cls is m.ModelSpec and f.name == "dims":
            dims_cls = m.DIMS_BY_FAMILY.get(family)
            value = _parse_dataclass(dims_cls, vnode, ctx, "dims") if dims_cls else _MISSING
        elif cls is m.ModelSpec and f.name == "variants":
            value = _parse_variants(vnode, ctx)
        else:
            value = _parse_value(hints[f.name], vnode, ctx, sub, dict(f.metadata))
            if value is not _MISSING and hints[f.name] is m.Identifier and f.name in ("name", "save_stream_tag"):
                if not _check_identifier(value, vnode, ctx, sub):
                    value = _MISSING
        if value is _MISSING:
            failed = True
        else:
            kwargs[f.name] = value
    return _MISSING if failed else cls(**kwargs)


def _parse_variants(node: _Node, ctx: _Ctx):
    if not isinstance(node.value, dict) or not node.value:
        ctx.error(node, "variants: expected a non-empty mapping of variant name -> settings",
                  "e.g. variants: {decode: {phase: decode}}")
        return _MISSING
    out, failed = {}, False
    for name, vnode in node.value.items():
        if not _check_identifier(name, node.key_pos[name], ctx, "variant name"):
            failed = True
            continue
        v = _parse_dataclass(m.Variant, vnode, ctx, f"variants.{name}")
        if v is _MISSING:
            failed = True
        else:
            out[name] = v
    return _MISSING if failed else out


def parse_spec_text(text: str, file: str = "<spec>") -> m.ModelSpec:
    """Parse and validate a spec; raises :class:`SpecError` with every problem found."""
    from .compat import check_compat

    ctx = _Ctx(file)
    root = _compose(text, ctx)
    spec = _MISSING
    if root is not None:
        family = root.value.get("family").value if isinstance(root.value, dict) and "family" in root.value else None
        spec = _parse_dataclass(m.ModelSpec, root, ctx, "", family=family)
        if spec is not _MISSING:
            for where, message, fix in check_compat(spec):
                ctx.error(_locate(root, where), message, fix)
    if ctx.diags:
        raise SpecError(ctx.diags)
    return spec


def _locate(root: _Node, path: str) -> tuple[int, int]:
    """Position of a dotted path (``features``, ``variants.splitfuse.phase``) in the file."""
    node, pos = root, (root.line, root.col)
    for part in path.split(".") if path else []:
        if not isinstance(node.value, dict) or part not in node.value:
            break
        pos = node.key_pos[part]
        node = node.value[part]
    return pos


def load_spec(path: str | Path) -> m.ModelSpec:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise SpecError([Diagnostic(str(path), 1, 1, f"cannot read spec: {e.strerror}",
                                    "check the path")]) from None
    return parse_spec_text(text, str(path))


def load_specs(paths) -> list[m.ModelSpec]:
    """Load several specs, reporting the errors of all files together."""
    specs, diags = [], []
    for p in paths:
        try:
            specs.append(load_spec(p))
        except SpecError as e:
            diags.extend(e.diagnostics)
    if diags:
        raise SpecError(diags)
    names = {}
    for p, s in zip(paths, specs):
        if s.name in names:
            diags.append(Diagnostic(str(p), 1, 1, f"model name '{s.name}' is also used by {names[s.name]}",
                                    "give each spec a unique name"))
        names[s.name] = str(p)
    if diags:
        raise SpecError(diags)
    return specs


def dump_spec(spec) -> dict:
    """Plain data (YAML-ready) that parses back to an equal spec."""

    def conv(x):
        if dataclasses.is_dataclass(x):
            return {f.name: conv(getattr(x, f.name)) for f in dataclasses.fields(x)}
        if isinstance(x, tuple):
            return [conv(i) for i in x]
        if isinstance(x, dict):
            return {k: conv(v) for k, v in x.items()}
        return x

    return conv(spec)


def dump_spec_yaml(spec) -> str:
    return yaml.safe_dump(dump_spec(spec), sort_keys=False, default_flow_style=False)
