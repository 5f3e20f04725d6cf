"""Positioned YAML: a spec's text as a tree of values that remember their ``file:line:col``.

- scalars are read with the YAML 1.2 core schema (what editors and the JSON Schema tooling use):
  ``off``/``yes`` are strings, not booleans, and ``1e6`` is a number; YAML tags other than the
  core ones (``!!python/...``, ``!!timestamp``, custom ``!tags``) are errors;
- duplicate keys are errors (plain YAML keeps the last silently);
- every problem is collected in a :class:`Ctx` as a :class:`Diagnostic` (the typed parser in
  ``loader.py`` adds its own to the same list).

No torch here: this runs on every ``graphgen`` command.
"""

from __future__ import annotations

import math
import re
from typing import Any, Optional, Union

import yaml

from .errors import Diagnostic, SpecError

MISSING = object()  # a value that failed to parse (already reported)
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
    def __init__(self, stream: str) -> None:
        yaml.reader.Reader.__init__(self, stream)
        yaml.scanner.Scanner.__init__(self)
        yaml.parser.Parser.__init__(self)
        yaml.composer.Composer.__init__(self)
        _Resolver.__init__(self)


def _scalar(node: yaml.ScalarNode) -> tuple[Any, Optional[str]]:
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

class Node:
    """A YAML value with its position (1-based line/col)."""

    __slots__ = ("value", "line", "col", "key_pos")

    def __init__(self, value: Any, line: int, col: int, key_pos: Optional[dict[str, tuple[int, int]]] = None):
        self.value = value
        self.line = line
        self.col = col
        self.key_pos = key_pos or {}  # for mappings: key -> (line, col) of the key

    @property
    def pos(self) -> tuple[int, int]:
        return self.line, self.col


class Ctx:
    def __init__(self, file: str):
        self.file = file
        self.diags: list[Diagnostic] = []
        self.family: Optional[str] = None  # the spec's family once read (the typed parser chooses dims by it)

    def error(self, where: Union[tuple[int, int], Node], message: str, fix: str = "") -> None:
        line, col = where if isinstance(where, tuple) else (where.line, where.col)
        self.diags.append(Diagnostic(self.file, line, col, message, fix))


def _pos(mark: yaml.Mark) -> tuple[int, int]:
    return mark.line + 1, mark.column + 1


def compose(text: str, ctx: Ctx) -> Optional[Node]:
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


def _convert(node: yaml.Node, ctx: Ctx, memo: dict[int, Node]) -> Node:
    # Aliases reuse nodes: memoising by identity keeps conversion linear (no "billion laughs") and
    # makes recursive anchors terminate (the container is registered before its children).
    if id(node) in memo:
        return memo[id(node)]
    line, col = _pos(node.start_mark)
    if isinstance(node, yaml.MappingNode):
        out = Node({}, line, col, {})
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
                value = Node(None, *kpos)  # an empty value: point at its key, not the next line
            else:
                value = _convert(vnode, ctx, memo)
            out.value[key] = value
            out.key_pos[key] = kpos
        return out
    if isinstance(node, yaml.SequenceNode):
        out = Node([], line, col)
        memo[id(node)] = out
        out.value.extend(_convert(v, ctx, memo) for v in node.value)
        return out
    assert isinstance(node, yaml.ScalarNode)  # a mapping, a sequence or a scalar: what the composer makes
    scalar, problem = _scalar(node)
    if problem:
        ctx.error((line, col), f"{problem}", "write a plain value (string, number, true/false or null)")
        scalar = MISSING
    out = Node(scalar, line, col)
    memo[id(node)] = out
    return out


def _plain(node: Node, memo: Optional[dict[int, Any]] = None) -> Any:
    # Shared (aliased) nodes become shared objects, as in PyYAML: no exponential expansion.
    memo = {} if memo is None else memo
    if id(node) in memo:
        return memo[id(node)]
    if isinstance(node.value, dict):
        mapping: dict[str, Any] = {}
        memo[id(node)] = mapping
        mapping.update((k, _plain(v, memo)) for k, v in node.value.items())
        return mapping
    if isinstance(node.value, list):
        items: list[Any] = []
        memo[id(node)] = items
        items.extend(_plain(v, memo) for v in node.value)
        return items
    return None if node.value is MISSING else node.value


def load_yaml_data(text: str, file: str = "<spec>") -> Any:
    """The spec text as plain data, read exactly as the loader reads it (YAML 1.2 core scalars).

    For tools that need the raw document (e.g. validating it against ``specs/schema.json``).
    Raises :class:`SpecError` on YAML errors.
    """
    ctx = Ctx(file)
    root = compose(text, ctx)
    if ctx.diags:
        raise SpecError(ctx.diags)
    assert root is not None  # no root is a diagnostic
    return _plain(root)
