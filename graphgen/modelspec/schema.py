"""JSON Schema of the spec format, derived from the dataclasses in ``model.py``.

Field docs become descriptions, ``Literal`` becomes ``enum``, defaults and bounds come from the
field definitions, every object is closed (``additionalProperties: false``) and ``dims`` is chosen
by ``family`` (``if``/``then``). ``specs/schema.json`` is ``schema_text()`` checked in; editors use
it through the ``# yaml-language-server: $schema=schema.json`` line of each spec.

The schema is the editor-side contract; the loader is stricter where JSON Schema cannot say it
(compatibility matrix, shape rules, exact int vs float) and is what graphgen itself runs.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import keyword
import types
import typing
from typing import TYPE_CHECKING, Any, Literal, get_args, get_origin

from ..families import FAMILIES
from . import model as m
from .compat import ACCEPTED_FEATURES

if TYPE_CHECKING:
    from pathlib import Path

DIALECT = "https://json-schema.org/draft/2020-12/schema"
Schema = dict[str, Any]  # a JSON Schema object


def _plain(x: Any) -> Any:
    """A default value as JSON data (dataclasses -> objects, tuples -> arrays)."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)
                if not (getattr(x, f.name) is None and f.default is None)}
    if isinstance(x, tuple):
        return [_plain(i) for i in x]
    return x


def _identifier() -> Schema:
    return {"type": "string", "pattern": m.IDENTIFIER_PATTERN, "not": {"enum": sorted(keyword.kwlist)}}


class _Builder:
    def __init__(self) -> None:
        self.defs: dict[str, Schema] = {}

    def ref(self, cls: type) -> Schema:
        name = cls.__name__
        if name not in self.defs:
            self.defs[name] = {}  # placeholder: a dataclass may (indirectly) refer to itself
            self.defs[name] = self.dataclass(cls)
        return {"$ref": f"#/$defs/{name}"}

    def dataclass(self, cls: type) -> Schema:
        hints = typing.get_type_hints(cls)
        props: Schema = {}
        required: list[str] = []
        for f in dataclasses.fields(cls):
            props[f.name] = self.field(cls, f, hints[f.name])
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                required.append(f.name)
        out: Schema = {"type": "object", "description": inspect.cleandoc(cls.__doc__ or ""),
               "properties": props, "additionalProperties": False}
        if required:
            out["required"] = required
        if cls is m.Targets:
            out["minProperties"] = 1  # at least one target (null is not allowed for either)
        return out

    def field(self, cls: type, f: dataclasses.Field[Any], tp: Any) -> Schema:
        meta = dict(f.metadata)
        if cls is m.ModelSpec and f.name == "features":
            schema: Schema = {"type": "array", "items": {"type": "string", "enum": list(ACCEPTED_FEATURES)}}
        else:
            schema = self.type(tp, meta)
        if schema.get("type") == "array":
            if meta.get("min_items"):
                schema["minItems"] = meta["min_items"]
            if meta.get("unique"):
                schema["uniqueItems"] = True
        if "$ref" in schema:
            schema = {"allOf": [schema]}  # keep siblings (description, default) next to a plain $ref
        schema["description"] = meta.get("doc", "")
        if f.default is not dataclasses.MISSING:
            schema["default"] = _plain(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            schema["default"] = _plain(f.default_factory())
        return schema

    def type(self, tp: Any, meta: dict[str, Any]) -> Schema:
        origin = get_origin(tp)
        if origin in (typing.Union, types.UnionType) and meta.get("by_family"):
            return {"type": "object"}  # the family's dims class, chosen at the root by if/then
        if origin is dict:
            return {"type": "object", "minProperties": 1, "propertyNames": _identifier(),
                    "additionalProperties": self.type(get_args(tp)[1], {})}
        if origin in (typing.Union, types.UnionType):
            (inner,) = [a for a in get_args(tp) if a is not type(None)]
            schema = self.type(inner, meta)
            if meta.get("nullable", True):
                return {"anyOf": [schema, {"type": "null"}]}
            return schema
        if origin is Literal:
            return {"type": "string", "enum": list(get_args(tp))}
        if origin is tuple:
            (item,) = [a for a in get_args(tp) if a is not Ellipsis]
            return {"type": "array", "items": self.type(item, {})}
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            return self.ref(tp)
        if meta.get("identifier"):
            return _identifier()
        base = {bool: "boolean", int: "integer", float: "number", str: "string"}[tp]
        schema = {"type": base}
        if tp in (int, float):
            if "minimum" in meta:
                schema["minimum"] = meta["minimum"]
            if "exclusive_minimum" in meta:
                schema["exclusiveMinimum"] = meta["exclusive_minimum"]
        return schema


def spec_json_schema() -> Schema:
    """The JSON Schema (draft 2020-12) of a spec file; deterministic."""
    b = _Builder()
    root = b.dataclass(m.ModelSpec)
    for family, fam in FAMILIES.items():
        cls = fam.dims_cls
        root.setdefault("allOf", []).append({
            "if": {"properties": {"family": {"const": family}}, "required": ["family"]},
            "then": {"properties": {"dims": b.ref(cls)}},
        })
    return {"$schema": DIALECT, "title": "graphgen model spec", **root, "$defs": dict(sorted(b.defs.items()))}


def schema_text() -> str:
    """``spec_json_schema()`` as the text of ``specs/schema.json`` (sorted keys, indent 2)."""
    return json.dumps(spec_json_schema(), indent=2, sort_keys=True) + "\n"


# ---------------------------------------------------------------- docs/spec.md tables

DOC_BEGIN = "<!-- BEGIN GENERATED by graphgen.modelspec.schema.markdown_tables(); do not edit by hand -->"
DOC_END = "<!-- END GENERATED -->"

# Order in the reference: the document's own nesting, top to bottom.
_DOC_CLASSES = (m.ModelSpec, *(f.dims_cls for f in FAMILIES.values()), m.RopeScaling, m.KVCacheLayout,
                m.PoolWrite, m.Variant, m.Targets, m.CpuTarget, m.NpuTarget, m.Mtp, m.Quantization, m.Fp8Checkpoint)


def _md_type(tp: Any, meta: dict[str, Any]) -> str:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType) and meta.get("by_family"):
        classes = [a for a in get_args(tp) if a is not type(None)]
        return " or ".join(f"[{c.__name__}](#{c.__name__.lower()})" for c in classes) + ", by `family`"
    if origin is dict:
        return f"mapping: identifier → {_md_type(get_args(tp)[1], {})}"
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in get_args(tp) if a is not type(None)]
        return _md_type(inner, meta) + (" or null" if meta.get("nullable", True) else "")
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in get_args(tp))
    if origin is tuple:
        (item,) = [a for a in get_args(tp) if a is not Ellipsis]
        return f"list of {_md_type(item, {})}"
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return f"[{tp.__name__}](#{tp.__name__.lower()})"
    if meta.get("identifier"):
        return "identifier"
    text = {bool: "boolean", int: "integer", float: "number", str: "string"}[tp]
    if "minimum" in meta:
        text += f" ≥ {meta['minimum']}"
    if "exclusive_minimum" in meta:
        text += f" > {meta['exclusive_minimum']}"
    return text


def _md_default(f: dataclasses.Field[Any]) -> str:
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        return "**required**"
    value = _plain(f.default if f.default_factory is dataclasses.MISSING else f.default_factory())
    return "absent" if value is None else f"`{json.dumps(value)}`"


def markdown_tables() -> str:
    """The field tables and the compatibility matrix of ``docs/spec.md`` (between DOC_BEGIN/END)."""
    from .compat import MATRIX

    out = [DOC_BEGIN, ""]
    for cls in _DOC_CLASSES:
        hints = typing.get_type_hints(cls)
        out += [f"### {cls.__name__}", "", inspect.cleandoc(cls.__doc__ or ""), ""]
        fields = dataclasses.fields(cls)
        if not fields:
            out += ["No keys: write `{}`.", ""]
            continue
        out += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for f in fields:
            if cls is m.ModelSpec and f.name == "features":
                tp = "list of features (see the matrix)"
            else:
                tp = _md_type(hints[f.name], dict(f.metadata))
            doc_text = f.metadata.get("doc", "").replace("|", "\\|")
            out.append(f"| `{f.name}` | {tp} | {_md_default(f)} | {doc_text} |")
        out.append("")
    out += ["### Compatibility matrix", "",
            "| subject | status | families | combines with `pool.write` | required by `pool.write` | note |",
            "|---|---|---|---|---|---|"]
    for r in MATRIX:
        subject = f"`pool.write: {r.subject[6:]}`" if not r.is_feature else f"`{r.subject}`"
        out.append(f"| {subject} | {r.status} | {', '.join(r.families)} | {', '.join(r.writes)} | "
                   f"{', '.join(r.required_by) or '—'} | {r.note} |")
    out += ["", DOC_END]
    return "\n".join(out) + "\n"


def spec_doc_text(text: str) -> str:
    """``docs/spec.md``'s text with its generated part (between DOC_BEGIN and DOC_END) refreshed."""
    start, end = text.index(DOC_BEGIN), text.index(DOC_END) + len(DOC_END) + 1
    return text[:start] + markdown_tables() + text[end:]


def derived_files(repo: str | Path) -> dict[Path, str]:
    """Files derived from the code (path under ``repo`` -> expected text): the JSON Schema, docs/spec.md with
    its generated tables and docs/composition.md (`graphgen.composition`). ``graphgen generate`` writes them,
    ``graphgen check`` compares."""
    from pathlib import Path

    from ..composition import markdown as composition_markdown

    doc = Path(repo) / "docs" / "spec.md"
    out = {Path(repo) / "specs" / "schema.json": schema_text()}
    if doc.exists():
        out[doc] = spec_doc_text(doc.read_text(encoding="utf-8"))
    out[Path(repo) / "docs" / "composition.md"] = composition_markdown()  # the composition matrix, whole
    return out


def _write_files() -> None:
    """Refresh specs/schema.json and the generated part of docs/spec.md in this checkout."""
    from ..install import source_checkout

    repo = source_checkout()
    if repo is None:
        raise SystemExit("--write-doc refreshes a source checkout's specs/schema.json and docs/spec.md; "
                         "this graphgen is an installed wheel (graphgen schema prints the schema)")
    for path, text in derived_files(repo).items():
        path.write_text(text)


if __name__ == "__main__":  # python -m graphgen.modelspec.schema --write-doc
    import sys

    if sys.argv[1:] != ["--write-doc"]:
        sys.exit("usage: python -m graphgen.modelspec.schema --write-doc")
    _write_files()
