"""Strict spec loading: positioned YAML (``yamlpos.py``) -> :class:`ModelSpec`.

Contract:
- every problem of a file is collected and reported at once (:class:`SpecError`), each with
  ``file:line:col``, what is wrong and how to fix it; the position is the offending key or value,
  and for a missing key the key of the mapping that lacks it;
- unknown keys get a did-you-mean, duplicate keys are errors, types are exact (no string "2" for
  an int), names that reach generated code are identifiers;
- parsing is driven by the types of the spec dataclasses: ``dims`` (a union of the families' dims
  classes) is parsed as the class of the spec's ``family``, ``variants`` (``dict[str, Variant]``)
  as a mapping with identifier keys;
- the compatibility matrix (``compat.py``) runs on the parsed spec, as far as it parsed;
- dumping is ``dump.py`` (``parse(dump(spec)) == spec``).

No torch and no jsonschema here: this runs on every ``graphgen`` command.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Iterable, Literal, Optional, get_args, get_origin

from . import model as m
from ..families import FAMILIES
from .dump import dump_spec, dump_spec_yaml  # noqa: F401 (callers that load and dump import both here)
from .errors import Diagnostic, SpecError
from .yamlpos import MISSING as _MISSING, Ctx as _Ctx, Node as _Node, compose as _compose, load_yaml_data  # noqa: F401

# ---------------------------------------------------------------- typed parsing

Pos = tuple[int, int]  # (line, col), 1-based
# (the other family, the keys that are its dims, this family): dims keys that belong to another family
Foreign = Optional[tuple[str, set[str], str]]


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if tp is bool:
        return "a boolean (true/false)"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if origin is tuple:
        return "a list"
    if origin is Literal:
        return " | ".join(map(str, get_args(tp)))
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return str(tp)


def _example(tp: Any) -> str:
    """A placeholder value for 'add key: ...' fixes."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _example([a for a in get_args(tp) if a is not type(None)][0])
    if origin is Literal:
        return "|".join(map(str, get_args(tp)))
    if origin is tuple:
        return "[...]"
    if dataclasses.is_dataclass(tp):
        return "{...}"
    return {int: "<integer>", float: "<number>", bool: "true|false", str: "<text>"}.get(tp, "...")


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _describe(value: object) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, str):
        return f"the string {value!r}"
    return repr(value)


def _check_identifier(name: object, where: Pos | _Node, ctx: _Ctx, what: str) -> bool:
    if not m.is_identifier(name):
        ctx.error(where, f"{what} {name!r} is not a Python identifier (it names generated code)",
                  "use ASCII letters, digits and underscores, not starting with a digit or '__' and "
                  "not a Python keyword, e.g. my_model")
        return False
    return True


def _check_bounds(value: Any, node: _Node, ctx: _Ctx, path: str, meta: dict[str, Any]) -> bool:
    if isinstance(value, float) and not math.isfinite(value):
        ctx.error(node, f"{path}: must be a finite number, got {value}", "write a plain number")
        return False
    if "minimum" in meta and value < meta["minimum"]:
        ctx.error(node, f"{path}: must be >= {meta['minimum']}, got {value}",
                  f"use a value of at least {meta['minimum']}")
        return False
    if "exclusive_minimum" in meta and value <= meta["exclusive_minimum"]:
        ctx.error(node, f"{path}: must be > {meta['exclusive_minimum']}, got {value}",
                  f"use a value greater than {meta['exclusive_minimum']}")
        return False
    return True


def _parse_value(tp: Any, node: _Node, ctx: _Ctx, path: str, meta: dict[str, Any], key_pos: Pos) -> Any:
    if node.value is _MISSING:  # already reported (bad YAML tag)
        return _MISSING
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) > 1:  # one class per family (``dims``): the spec's family chooses
            return _parse_dims(ctx.family, node, ctx, key_pos)
        if node.value is None:
            if meta.get("nullable", True):
                return None
            leaf = path.split(".")[-1]
            ctx.error(node, f"{path}: an empty value does not enable this (null means absent)",
                      f"write '{leaf}: {{}}' to enable it with defaults, or delete the line to leave it off")
            return _MISSING
        return _parse_value(args[0], node, ctx, path, meta, key_pos)
    if origin is Literal:
        choices = get_args(tp)
        if not isinstance(node.value, str) or node.value not in choices:
            close = difflib.get_close_matches(str(node.value), [str(c) for c in choices], n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            ctx.error(node, f"{path}: {_describe(node.value)} is not one of {', '.join(map(str, choices))}",
                      f"{hint}use one of: {', '.join(map(str, choices))}")
            return _MISSING
        return node.value
    if origin is dict:
        return _parse_mapping(get_args(tp)[1], node, ctx, path, meta, key_pos)
    if origin is tuple:
        (item,) = [a for a in get_args(tp) if a is not Ellipsis]
        if not isinstance(node.value, list):
            ctx.error(node, f"{path}: expected a list, got {_describe(node.value)}",
                      f"write {path.split('.')[-1]}: [item, ...]")
            return _MISSING
        items = [_parse_value(item, n, ctx, f"{path}[{i}]", meta, n.pos) for i, n in enumerate(node.value)]
        return _MISSING if any(x is _MISSING for x in items) else tuple(items)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _parse_dataclass(tp, node, ctx, path, key_pos)
    if tp is float:
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            ctx.error(node, f"{path}: expected {_type_name(float)}, got {_describe(node.value)}",
                      "write a plain number without quotes, e.g. 1.0e-6")
            return _MISSING
        value = float(node.value)
        return value if _check_bounds(value, node, ctx, path, meta) else _MISSING
    if tp in (int, bool, str):
        ok = isinstance(node.value, tp) and not (tp is int and isinstance(node.value, bool))
        if not ok:
            if tp is str:
                fix = "quote the value"
            elif tp is int and isinstance(node.value, float) and node.value.is_integer():
                fix = f"write {int(node.value)} (no decimal point)"
            elif tp is bool:
                fix = "write true or false"
            else:
                fix = f"write {_type_name(tp)} without quotes"
            ctx.error(node, f"{path}: expected {_type_name(tp)}, got {_describe(node.value)}", fix)
            return _MISSING
        if tp is int and not _check_bounds(node.value, node, ctx, path, meta):
            return _MISSING
        if meta.get("identifier") and not _check_identifier(node.value, node, ctx, path):
            return _MISSING
        return node.value
    raise TypeError(f"unsupported spec field type {tp!r} at {path}")  # programming error


def _unknown_keys(cls: type, node: _Node, ctx: _Ctx, path: str, *, foreign: Foreign = None) -> set[str]:
    """Report keys ``cls`` lacks; returns the field names an unknown key was taken for (typos)."""
    allowed = [f.name for f in dataclasses.fields(cls)]
    renamed = {f.metadata["renamed_from"]: f.name for f in dataclasses.fields(cls) if "renamed_from" in f.metadata}
    meant: set[str] = set()
    for key in node.value:
        if key in allowed:
            continue
        where = f"'{path}'" if path else "the spec"
        if key in renamed:
            new = renamed[key]
            if new in node.value:
                fix = f"remove '{key}:' and keep '{new}:'"
            else:
                fix = f"rename '{key}:' to '{new}:' (same settings)"
            ctx.error(node.key_pos[key], f"'{key}' was renamed to '{new}'", fix)
            continue
        if foreign and key in foreign[1]:
            ctx.error(node.key_pos[key], f"unknown key '{key}' in {where}: it is a {foreign[0]} dim, "
                      f"not a {foreign[2]} one", f"remove it, or set family: {foreign[0]}")
            continue
        close = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.6)
        if close:
            meant.add(close[0])
            fix = f"did you mean '{close[0]}'?"
        else:
            fix = f"allowed keys: {', '.join(allowed)}"
        ctx.error(node.key_pos[key], f"unknown key '{key}' in {where}", fix)
    return meant


def _parse_fields(cls: type, node: _Node, ctx: _Ctx, path: str, key_pos: Pos, *,
                  foreign: Foreign = None) -> tuple[Optional[dict[str, Any]], bool]:
    """(kwargs of the fields that parsed, failed?) -- or (None, True) if ``node`` is no mapping."""
    if not isinstance(node.value, dict):
        ctx.error(node, f"{path or 'the spec'}: expected a mapping (key: value lines), got "
                  f"{_describe(node.value)}", "write key: value pairs, one per line, indented under the key")
        return None, True
    fields = dataclasses.fields(cls)
    hints = _hints(cls)
    meant = _unknown_keys(cls, node, ctx, path, foreign=foreign)
    kwargs: dict[str, Any] = {}
    failed = False
    for f in fields:
        sub = f"{path}.{f.name}" if path else f.name
        name = f.name
        if name not in node.value and f.metadata.get("renamed_from") in node.value:
            name = f.metadata["renamed_from"]  # reported above; parsed so later checks see its settings
        if name not in node.value:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                failed = True
                if f.name not in meant:  # a misspelt key already says 'did you mean'
                    where = f"under '{path}'" if path else "at the top level"
                    ctx.error(key_pos, f"missing required key '{sub}'",
                              f"add '{f.name}: {_example(hints[f.name])}' {where} ({f.metadata.get('doc', '')})")
            continue
        vnode = node.value[name]
        vkey = node.key_pos[name]
        value = _parse_value(hints[f.name], vnode, ctx, sub, dict(f.metadata), vkey)
        if value is _MISSING:
            failed = True
        else:
            kwargs[f.name] = value
    return kwargs, failed


def _parse_dataclass(cls: type, node: _Node, ctx: _Ctx, path: str, key_pos: Pos, *, foreign: Foreign = None) -> Any:
    kwargs, failed = _parse_fields(cls, node, ctx, path, key_pos, foreign=foreign)
    return _MISSING if failed or kwargs is None else cls(**kwargs)


def _parse_dims(family: Optional[str], node: _Node, ctx: _Ctx, key_pos: Pos) -> Any:
    if not isinstance(family, str) or family not in FAMILIES:  # the family itself is wrong (reported
        return _MISSING                                         # there): dims cannot be judged
    cls = FAMILIES[family].dims_cls
    if not isinstance(node.value, dict):
        return _parse_dataclass(cls, node, ctx, "dims", key_pos)
    own = {f.name for f in dataclasses.fields(cls)}
    keys = set(node.value)
    for other, ofam in FAMILIES.items():
        if other == family:
            continue
        ocls = ofam.dims_cls
        theirs = {f.name for f in dataclasses.fields(ocls)}
        only_theirs = sorted((keys - own) & theirs)
        if only_theirs and keys <= theirs:
            # Every key is the other family's: one clear error instead of one per key.
            missing = [f.name for f in dataclasses.fields(cls)
                       if f.default is dataclasses.MISSING and f.name not in keys]
            ctx.error(key_pos, f"dims do not match family {family}: {', '.join(only_theirs[:4])}"
                      f"{', ...' if len(only_theirs) > 4 else ''} are {other} dims",
                      f"set family: {other}, or give {family} dims ({', '.join(missing)})")
            return _MISSING
        if only_theirs:
            return _parse_dataclass(cls, node, ctx, "dims", key_pos, foreign=(other, set(only_theirs), family))
    return _parse_dataclass(cls, node, ctx, "dims", key_pos)


def _parse_mapping(item_tp: Any, node: _Node, ctx: _Ctx, path: str, meta: dict[str, Any], key_pos: Pos) -> Any:
    """A non-empty ``name -> item`` mapping whose names are identifiers (they name generated code)."""
    what = meta.get("key_name", "name")
    if not isinstance(node.value, dict) or not node.value:
        ctx.error(node if node.value is not None else key_pos,
                  f"{path}: expected a non-empty mapping of {what} -> settings",
                  f"e.g. {meta['example']}" if "example" in meta else f"write {path}: {{name: {{...}}}}")
        return _MISSING
    out: dict[str, Any] = {}
    failed = False
    for name, vnode in node.value.items():
        kpos = node.key_pos[name]
        if not _check_identifier(name, kpos, ctx, what):
            failed = True
            continue
        v = _parse_value(item_tp, vnode, ctx, f"{path}.{name}", {}, kpos)
        if v is _MISSING:
            failed = True
        else:
            out[name] = v
    return _MISSING if failed else out


def _parse(text: str, file: str) -> tuple[Any, Optional[_Node], _Ctx]:
    """(spec or _MISSING, root node or None, ctx) with every diagnostic collected."""
    from .compat import check_compat

    ctx = _Ctx(file)
    root = _compose(text, ctx)
    spec: Any = _MISSING
    if root is not None:
        if isinstance(root.value, dict) and "family" in root.value:
            ctx.family = root.value["family"].value  # chooses the dims class
        kwargs, failed = _parse_fields(m.ModelSpec, root, ctx, "", root.pos)
        if kwargs is not None:
            if not failed:
                spec = m.ModelSpec(**kwargs)
            # Defaults stand in for absent keys, so compat rules see what the spec will mean; keys
            # that failed to parse stay absent and the rules that read them are skipped.
            partial = {f.name: (f.default_factory() if f.default_factory is not dataclasses.MISSING
                                else f.default)
                       for f in dataclasses.fields(m.ModelSpec)
                       if f.name not in root.value and f.metadata.get("renamed_from") not in root.value
                       and (f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING)}
            partial.update(kwargs)
            for where, message, fix in check_compat(types.SimpleNamespace(**partial)):
                ctx.error(locate(root, where), message, fix)
    return spec, root, ctx


def parse_spec_text(text: str, file: str = "<spec>") -> m.ModelSpec:
    """Parse and validate a spec; raises :class:`SpecError` with every problem found."""
    spec, _, ctx = _parse(text, file)
    if ctx.diags:
        raise SpecError(ctx.diags)
    assert isinstance(spec, m.ModelSpec)  # a spec that did not parse has diagnostics
    return spec


_PART = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def locate(root: _Node, path: str) -> tuple[int, int]:
    """Position of a path (``features[2]``, ``variants.splitfuse.history``) in the file: the key
    (or list item) itself, else the nearest enclosing key that exists."""
    node, pos = root, root.pos
    for name, index in _PART.findall(path):
        if name:
            if not isinstance(node.value, dict) or name not in node.value:
                break
            pos = node.key_pos[name]
            node = node.value[name]
        else:
            i = int(index)
            if not isinstance(node.value, list) or i >= len(node.value):
                break
            node = node.value[i]
            pos = node.pos
    return pos


def load_spec(path: str | Path) -> m.ModelSpec:
    spec, _ = load_tree(Path(path))
    return spec


def load_tree(path: Path) -> tuple[m.ModelSpec, _Node]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise SpecError([Diagnostic(str(path), 1, 1, f"cannot read spec: not UTF-8 text ({e.reason})",
                                    "save the spec as UTF-8")]) from None
    except OSError as e:
        raise SpecError([Diagnostic(str(path), 1, 1, f"cannot read spec: {e.strerror}",
                                    "check the path")]) from None
    spec, root, ctx = _parse(text, str(path))
    if ctx.diags:
        raise SpecError(ctx.diags)
    assert isinstance(spec, m.ModelSpec) and root is not None  # a spec that did not parse has diagnostics
    return spec, root


def load_specs(paths: Iterable[str | Path]) -> list[m.ModelSpec]:
    """Load several specs, reporting the errors of all files together."""
    loaded: list[tuple[Path, m.ModelSpec, _Node]] = []
    diags: list[Diagnostic] = []
    for p in map(Path, paths):
        try:
            loaded.append((p, *load_tree(p)))
        except SpecError as e:
            diags.extend(e.diagnostics)
    names: dict[str, str] = {}
    for p, spec, root in loaded:
        if spec.name in names:
            diags.append(Diagnostic(str(p), *locate(root, "name"),
                                    f"model name '{spec.name}' is also used by {names[spec.name]}",
                                    "give each spec a unique name"))
        else:
            names[spec.name] = str(p)
    if diags:
        raise SpecError(diags)
    return [spec for _, spec, _ in loaded]
