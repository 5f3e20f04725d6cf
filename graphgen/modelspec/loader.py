"""Strict spec loading: YAML (with line numbers) -> :class:`ModelSpec`.

Contract:
- every problem of a file is collected and reported at once (:class:`SpecError`), each with
  ``file:line:col``, what is wrong and how to fix it; the position is the offending key or value,
  and for a missing key the key of the mapping that lacks it;
- unknown keys get a did-you-mean, duplicate keys are errors (plain YAML keeps the last silently),
  types are exact (no string "2" for an int), names that reach generated code are identifiers;
- scalars are read with the YAML 1.2 core schema (what editors and the JSON Schema tooling use):
  ``off``/``yes`` are strings, not booleans, and ``1e6`` is a number; YAML tags other than the
  core ones (``!!python/...``, ``!!timestamp``, custom ``!tags``) are errors;
- the compatibility matrix (``compat.py``) runs on the parsed spec, as far as it parsed;
- ``dump_spec`` writes a spec back to plain data and ``dump_spec_yaml`` to YAML text, and
  ``parse(dump(spec)) == spec``.

No torch and no jsonschema here: this runs on every ``graphgen`` command.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from . import model as m
from .errors import Diagnostic, SpecError

_MISSING = object()
_TAG = "tag:yaml.org,2002:"


# ---------------------------------------------------------------- YAML 1.2 core scalar resolution

class _Resolver(yaml.resolver.BaseResolver):
    """Implicit tags of the YAML 1.2 core schema (PyYAML implements 1.1: ``off`` -> False)."""


_CORE = {
    "null": (re.compile(r"^(?:~|null|Null|NULL|)$"), list("~nN") + [""]),
    "bool": (re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")),
    "int": (re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789")),
    "float": (re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
                         r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"), list("-+.0123456789")),
}
for _kind, (_regexp, _first) in _CORE.items():
    _Resolver.add_implicit_resolver(_TAG + _kind, _regexp, _first)


class _Composer(yaml.reader.Reader, yaml.scanner.Scanner, yaml.parser.Parser, yaml.composer.Composer,
                _Resolver):
    def __init__(self, stream):
        yaml.reader.Reader.__init__(self, stream)
        yaml.scanner.Scanner.__init__(self)
        yaml.parser.Parser.__init__(self)
        yaml.composer.Composer.__init__(self)
        _Resolver.__init__(self)


def _scalar(node: yaml.ScalarNode):
    """(value, None) or (None, error text) for a scalar node."""
    tag, text = node.tag, node.value
    kind = tag[len(_TAG):] if tag.startswith(_TAG) else None
    if kind == "str":
        return text, None
    if kind in _CORE and not _CORE[kind][0].match(text):
        return None, f"{text!r} is not a valid !!{kind}"
    if kind == "null":
        return None, None
    if kind == "bool":
        return text.lower() == "true", None
    if kind == "int":
        if text.startswith(("0o", "0x")):
            return int(text[2:], 8 if text[1] == "o" else 16), None
        return int(text, 10), None
    if kind == "float":
        low = text.lower()
        if low.endswith(".inf"):
            return (-math.inf if low.startswith("-") else math.inf), None
        if low == ".nan":
            return math.nan, None
        return float(text), None
    return None, f"unsupported YAML tag {tag}"


# ---------------------------------------------------------------- positioned tree

class _Node:
    """A YAML value with its position (1-based line/col)."""

    __slots__ = ("value", "line", "col", "key_pos")

    def __init__(self, value, line, col, key_pos=None):
        self.value = value
        self.line = line
        self.col = col
        self.key_pos = key_pos or {}  # for mappings: key -> (line, col) of the key

    @property
    def pos(self) -> tuple[int, int]:
        return self.line, self.col


class _Ctx:
    def __init__(self, file: str):
        self.file = file
        self.diags: list[Diagnostic] = []

    def error(self, where, message: str, fix: str = "") -> None:
        line, col = where if isinstance(where, tuple) else (where.line, where.col)
        self.diags.append(Diagnostic(self.file, line, col, message, fix))


def _pos(mark) -> tuple[int, int]:
    return mark.line + 1, mark.column + 1


def _compose(text: str, ctx: _Ctx):
    loader = _Composer(text)
    try:
        root = loader.get_single_node()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        ctx.error(_pos(mark) if mark else (1, 1), f"invalid YAML: {e.problem or e.context}",
                  "fix the YAML syntax at this position")
        return None
    except yaml.YAMLError as e:  # e.g. a NUL byte: reader errors carry no mark
        ctx.error((1, 1), f"invalid YAML: {e}", "save the spec as plain UTF-8 text")
        return None
    finally:
        loader.dispose()
    if root is None:
        ctx.error((1, 1), "the spec file is empty", "start from specs/tiny_qwen3.yaml")
        return None
    return _convert(root, ctx, {})


def _convert(node, ctx: _Ctx, memo: dict) -> _Node:
    # Aliases reuse nodes: memoising by identity keeps conversion linear (no "billion laughs") and
    # makes recursive anchors terminate (the container is registered before its children).
    if id(node) in memo:
        return memo[id(node)]
    line, col = _pos(node.start_mark)
    if isinstance(node, yaml.MappingNode):
        out = _Node({}, line, col, {})
        memo[id(node)] = out
        for knode, vnode in node.value:
            kpos = _pos(knode.start_mark)
            if not isinstance(knode, yaml.ScalarNode):
                ctx.error(kpos, "a key must be a plain name, not a list or mapping", "write name: value")
                continue
            key = knode.value
            if key == "<<" and knode.style is None:
                ctx.error(kpos, "YAML merge keys ('<<') are not supported", "write the keys out in full")
                continue
            if key in out.value:
                ctx.error(kpos, f"duplicate key '{key}' (first defined on line {out.key_pos[key][0]})",
                          "remove one of the two entries")
                continue
            if isinstance(vnode, yaml.ScalarNode) and vnode.value == "" and vnode.style is None \
                    and vnode.tag == _TAG + "null":
                value = _Node(None, *kpos)  # an empty value: point at its key, not the next line
            else:
                value = _convert(vnode, ctx, memo)
            out.value[key] = value
            out.key_pos[key] = kpos
        return out
    if isinstance(node, yaml.SequenceNode):
        out = _Node([], line, col)
        memo[id(node)] = out
        out.value.extend(_convert(v, ctx, memo) for v in node.value)
        return out
    value, problem = _scalar(node)
    if problem:
        ctx.error((line, col), f"{problem}", "write a plain value (string, number, true/false or null)")
        value = _MISSING
    out = _Node(value, line, col)
    memo[id(node)] = out
    return out


def _plain(node: _Node, memo=None):
    # Shared (aliased) nodes become shared objects, as in PyYAML: no exponential expansion.
    memo = {} if memo is None else memo
    if id(node) in memo:
        return memo[id(node)]
    if isinstance(node.value, dict):
        out = memo[id(node)] = {}
        out.update((k, _plain(v, memo)) for k, v in node.value.items())
        return out
    if isinstance(node.value, list):
        out = memo[id(node)] = []
        out.extend(_plain(v, memo) for v in node.value)
        return out
    return None if node.value is _MISSING else node.value


def load_yaml_data(text: str, file: str = "<spec>"):
    """The spec text as plain data, read exactly as the loader reads it (YAML 1.2 core scalars).

    For tools that need the raw document (e.g. validating it against ``specs/schema.json``).
    Raises :class:`SpecError` on YAML errors.
    """
    ctx = _Ctx(file)
    root = _compose(text, ctx)
    if ctx.diags:
        raise SpecError(ctx.diags)
    return _plain(root)


# ---------------------------------------------------------------- typed parsing

def _type_name(tp) -> str:
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


def _example(tp) -> str:
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


def _hints(cls):
    return typing.get_type_hints(cls, globalns=vars(m))


def _describe(value) -> str:
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


def _check_identifier(name, where, ctx: _Ctx, what: str) -> bool:
    if not m.is_identifier(name):
        ctx.error(where, f"{what} {name!r} is not a Python identifier (it names generated code)",
                  "use ASCII letters, digits and underscores, not starting with a digit or '__' and "
                  "not a Python keyword, e.g. my_model")
        return False
    return True


def _check_bounds(value, node: _Node, ctx: _Ctx, path: str, meta: dict) -> bool:
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


def _parse_value(tp, node: _Node, ctx: _Ctx, path: str, meta: dict, key_pos):
    if node.value is _MISSING:  # already reported (bad YAML tag)
        return _MISSING
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
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
    if origin is tuple:
        (item,) = [a for a in get_args(tp) if a is not Ellipsis]
        if not isinstance(node.value, list):
            ctx.error(node, f"{path}: expected a list, got {_describe(node.value)}",
                      f"write {path.split('.')[-1]}: [item, ...]")
            return _MISSING
        items = [_parse_value(item, n, ctx, f"{path}[{i}]", meta, n.pos) for i, n in enumerate(node.value)]
        return _MISSING if any(x is _MISSING for x in items) else tuple(items)
    if dataclasses.is_dataclass(tp):
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


def _unknown_keys(cls, node: _Node, ctx: _Ctx, path: str, *, foreign=None) -> set[str]:
    """Report keys ``cls`` lacks; returns the field names an unknown key was taken for (typos)."""
    allowed = [f.name for f in dataclasses.fields(cls)]
    meant = set()
    for key in node.value:
        if key in allowed:
            continue
        where = f"'{path}'" if path else "the spec"
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


def _parse_fields(cls, node: _Node, ctx: _Ctx, path: str, key_pos, *, family=None, foreign=None):
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
        if f.name not in node.value:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                failed = True
                if f.name not in meant:  # a misspelt key already says 'did you mean'
                    where = f"under '{path}'" if path else "at the top level"
                    ctx.error(key_pos, f"missing required key '{sub}'",
                              f"add '{f.name}: {_example(hints[f.name])}' {where} ({f.metadata.get('doc', '')})")
            continue
        vnode = node.value[f.name]
        vkey = node.key_pos[f.name]
        if cls is m.ModelSpec and f.name == "dims":
            value = _parse_dims(family, vnode, ctx, vkey)
        elif cls is m.ModelSpec and f.name == "variants":
            value = _parse_variants(vnode, ctx, vkey)
        else:
            value = _parse_value(hints[f.name], vnode, ctx, sub, dict(f.metadata), vkey)
        if value is _MISSING:
            failed = True
        else:
            kwargs[f.name] = value
    return kwargs, failed


def _parse_dataclass(cls, node: _Node, ctx: _Ctx, path: str, key_pos, **kw):
    kwargs, failed = _parse_fields(cls, node, ctx, path, key_pos, **kw)
    return _MISSING if failed else cls(**kwargs)


def _parse_dims(family, node: _Node, ctx: _Ctx, key_pos):
    cls = m.DIMS_BY_FAMILY.get(family) if isinstance(family, str) else None
    if cls is None:  # the family itself is wrong (reported there): dims cannot be judged
        return _MISSING
    if not isinstance(node.value, dict):
        return _parse_dataclass(cls, node, ctx, "dims", key_pos)
    own = {f.name for f in dataclasses.fields(cls)}
    keys = set(node.value)
    for other, ocls in m.DIMS_BY_FAMILY.items():
        if other == family:
            continue
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


def _parse_variants(node: _Node, ctx: _Ctx, key_pos):
    if not isinstance(node.value, dict) or not node.value:
        ctx.error(node if node.value is not None else key_pos,
                  "variants: expected a non-empty mapping of variant name -> settings",
                  "e.g. variants: {decode: {phase: decode}}")
        return _MISSING
    out, failed = {}, False
    for name, vnode in node.value.items():
        kpos = node.key_pos[name]
        if not _check_identifier(name, kpos, ctx, "variant name"):
            failed = True
            continue
        v = _parse_dataclass(m.Variant, vnode, ctx, f"variants.{name}", kpos)
        if v is _MISSING:
            failed = True
        else:
            out[name] = v
    return _MISSING if failed else out


def _parse(text: str, file: str):
    """(spec or _MISSING, root node or None, ctx) with every diagnostic collected."""
    from .compat import check_compat

    ctx = _Ctx(file)
    root = _compose(text, ctx)
    spec = _MISSING
    if root is not None:
        family = None
        if isinstance(root.value, dict) and "family" in root.value:
            family = root.value["family"].value
        kwargs, failed = _parse_fields(m.ModelSpec, root, ctx, "", root.pos, family=family)
        if kwargs is not None:
            if not failed:
                spec = m.ModelSpec(**kwargs)
            # Defaults stand in for absent keys, so compat rules see what the spec will mean; keys
            # that failed to parse stay absent and the rules that read them are skipped.
            partial = {f.name: (f.default_factory() if f.default_factory is not dataclasses.MISSING
                                else f.default)
                       for f in dataclasses.fields(m.ModelSpec)
                       if f.name not in root.value and (f.default is not dataclasses.MISSING
                                                        or f.default_factory is not dataclasses.MISSING)}
            partial.update(kwargs)
            for where, message, fix in check_compat(types.SimpleNamespace(**partial)):
                ctx.error(_locate(root, where), message, fix)
    return spec, root, ctx


def parse_spec_text(text: str, file: str = "<spec>") -> m.ModelSpec:
    """Parse and validate a spec; raises :class:`SpecError` with every problem found."""
    spec, _, ctx = _parse(text, file)
    if ctx.diags:
        raise SpecError(ctx.diags)
    return spec


_PART = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def _locate(root: _Node, path: str) -> tuple[int, int]:
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
    spec, _ = _load(Path(path))
    return spec


def _load(path: Path):
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
    return spec, root


def load_specs(paths) -> list[m.ModelSpec]:
    """Load several specs, reporting the errors of all files together."""
    paths = [Path(p) for p in paths]
    loaded, diags = [], []
    for p in paths:
        try:
            loaded.append((p, *_load(p)))
        except SpecError as e:
            diags.extend(e.diagnostics)
    names: dict[str, str] = {}
    for p, spec, root in loaded:
        if spec.name in names:
            diags.append(Diagnostic(str(p), *_locate(root, "name"),
                                    f"model name '{spec.name}' is also used by {names[spec.name]}",
                                    "give each spec a unique name"))
        else:
            names[spec.name] = str(p)
    if diags:
        raise SpecError(diags)
    return [spec for _, spec, _ in loaded]


# ---------------------------------------------------------------- dumping

# Top-level keys in reading order (identity first, then shape, then behaviour).
_TOP_ORDER = ("name", "family", "description", "dims", "kv_cache", "mempool", "features", "variants", "targets")


def dump_spec(spec) -> dict:
    """Plain data (YAML-ready) that parses back to an equal spec.

    Optional fields left at their ``None`` default are omitted (absent means the default).
    """

    def conv(x):
        if dataclasses.is_dataclass(x):
            out = {}
            for f in dataclasses.fields(x):
                value = getattr(x, f.name)
                if value is None and f.default is None:
                    continue
                out[f.name] = conv(value)
            return out
        if isinstance(x, tuple):
            return [conv(i) for i in x]
        if isinstance(x, dict):
            return {k: conv(v) for k, v in x.items()}
        return x

    data = conv(spec)
    return {k: data[k] for k in (*_TOP_ORDER, *data) if k in data} if isinstance(spec, m.ModelSpec) else data


def _reads_as_string(text: str) -> bool:
    """True if ``text`` written plain after ``key: `` reads back as itself, both here (YAML 1.2)
    and with PyYAML's YAML 1.1 safe_load (where ``off`` is a boolean)."""
    doc = f"k: {text}\n"
    try:
        ours = load_yaml_data(doc)
        theirs = yaml.safe_load(doc)
    except (SpecError, yaml.YAMLError):
        return False
    return ours == {"k": text} and theirs == {"k": text}


def _scalar_text(x) -> str:
    if x is None:
        return "null"
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if math.isnan(x):
            return ".nan"
        if math.isinf(x):
            return ".inf" if x > 0 else "-.inf"
        text = repr(x)
        if "e" in text and "." not in text.split("e")[0]:
            text = text.replace("e", ".0e")  # 1e-06 -> 1.0e-06: a float in YAML 1.1 readers too
        return text
    if isinstance(x, str):
        if x and x == x.strip() and "\n" not in x and x.isprintable() and _reads_as_string(x):
            return x
        return json.dumps(x)  # a JSON string is a valid YAML double-quoted scalar
    raise TypeError(f"cannot dump {type(x).__name__}")


def _emit(data, indent: int, lines: list[str]) -> None:
    pad = "  " * indent
    for key, value in data.items():
        if isinstance(value, dict) and value:
            lines.append(f"{pad}{key}:")
            _emit(value, indent + 1, lines)
        elif isinstance(value, dict):
            lines.append(f"{pad}{key}: {{}}")
        elif isinstance(value, list):
            lines.append(f"{pad}{key}: [{', '.join(_scalar_text(v) for v in value)}]")
        else:
            lines.append(f"{pad}{key}: {_scalar_text(value)}")


def dump_spec_yaml(spec, *, header: str = "", schema: str | None = None) -> str:
    """Readable YAML for a spec (block mappings, flow lists), optionally with a
    ``yaml-language-server`` schema line and ``header`` as comment lines."""
    lines = []
    if schema:
        lines.append(f"# yaml-language-server: $schema={schema}")
    lines += [f"# {line}".rstrip() for line in header.splitlines()]
    _emit(dump_spec(spec), 0, lines)
    return "\n".join(lines) + "\n"
