"""Check generated NPU Python against the torchair / torch_npu API facts in ``manifest.json``.

The manifest is extracted from the torch-npu wheel's sources by
``scripts/extract_npu_manifest.py`` (nothing is imported from the wheel).  This module only
reads Python source with ``ast``; it never imports torch, torchair or torch_npu.

Checked call forms (aliases from ``import torchair as ta`` / ``from torchair import ops`` are
followed):

* ``torchair.<...>(...)``        -> ``python_api`` entries (``torchair.scope.npu_stream_switch`` ...)
* ``torch_npu.<name>(...)``       -> ``op_schemas["npu::<name>"]`` (torch_npu binds every torch.ops.npu op)
* ``torch.ops.npu.<name>[.<ovl>](...)`` / ``torch.ops.air.<name>[.<ovl>](...)`` -> ``op_schemas``
"""
from __future__ import annotations

import ast
import json
from functools import lru_cache
from pathlib import Path

MANIFEST_PATH = Path(__file__).resolve().parents[1] / "manifest.json"  # graphgen/npu/manifest.json


@lru_cache(maxsize=None)
def _load(path: str) -> dict:
    return json.loads(Path(path).read_text())


def load_manifest(path: str | Path | None = None) -> dict:
    """The committed manifest (cached; treat as read-only)."""
    return _load(str(path or MANIFEST_PATH))


# --------------------------------------------------------------------------- name resolution
def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


_ROOTS = ("torchair", "torch_npu", "torch")


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> fully qualified module/object path, for the roots we check."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in _ROOTS:
                    if a.asname:
                        out[a.asname] = a.name
                    else:
                        out[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in _ROOTS:
                for a in node.names:
                    out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _qualify(dotted: str, aliases: dict[str, str]) -> str:
    head, _, rest = dotted.partition(".")
    if head in aliases:
        return aliases[head] + ("." + rest if rest else "")
    return dotted


# --------------------------------------------------------------------------- signature check
def _check_params(params: list[dict], n_pos: int, kw_names: list[str], has_star: bool,
                  has_starstar: bool) -> list[str]:
    problems = []
    positional = [p for p in params if p["kind"] in ("positional_only", "positional_or_keyword")]
    var_pos = any(p["kind"] == "var_positional" for p in params)
    var_kw = any(p["kind"] == "var_keyword" for p in params)
    if n_pos > len(positional) and not var_pos:
        problems.append(f"too many positional arguments ({n_pos} > {len(positional)})")
    by_name = {p["name"]: p for p in params}
    bound = {p["name"] for p in positional[:n_pos]}
    for k in kw_names:
        p = by_name.get(k)
        if p is None or p["kind"] in ("positional_only", "var_positional", "var_keyword"):
            if not var_kw:
                problems.append(f"unknown keyword argument {k!r}")
            continue
        if k in bound:
            problems.append(f"argument {k!r} given positionally and by keyword")
        bound.add(k)
    if not (has_star or has_starstar):  # with *args/**kw we cannot tell what is bound
        for p in params:
            if p["kind"] in ("positional_only", "positional_or_keyword", "keyword_only") \
                    and not p["has_default"] and p["name"] not in bound:
                problems.append(f"missing required argument {p['name']!r}")
    return problems


def _lookup_op(manifest: dict, ns: str, rest: list[str]) -> tuple[str, list[dict]] | None:
    """rest = [name] or [name, overload]; returns (key, candidate entries)."""
    schemas = manifest["op_schemas"]
    name = rest[0]
    if len(rest) >= 2 and rest[1] != "default":
        key = f"{ns}::{name}.{rest[1]}"
        return (key, [schemas[key]]) if key in schemas else None
    key = f"{ns}::{name}"
    if key in schemas:
        return key, [schemas[key]]
    # an overload packet called directly dispatches to any of its overloads
    cands = [v for k, v in schemas.items() if k.startswith(key + ".")]
    return (key, cands) if cands else None


def check_module_source(source: str, manifest: dict | None = None, filename: str = "<generated>") -> list[str]:
    """Problems (``file:line: message``) for every torchair / torch_npu / torch.ops.{npu,air} call."""
    manifest = manifest or load_manifest()
    tree = ast.parse(source, filename=filename)
    aliases = _aliases(tree)
    api = manifest["python_api"]
    problems: list[str] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        dotted = _dotted(node.func)
        if dotted is None:
            continue
        q = _qualify(dotted, aliases)
        parts = q.split(".")
        n_pos = sum(1 for a in node.args if not isinstance(a, ast.Starred))
        has_star = any(isinstance(a, ast.Starred) for a in node.args)
        kws = [k.arg for k in node.keywords if k.arg is not None]
        has_starstar = any(k.arg is None for k in node.keywords)
        where = f"{filename}:{node.lineno}"
        if parts[0] == "torchair":
            entry = api.get(q)
            if entry is None or entry["kind"] == "module":
                problems.append(f"{where}: {q} is not in the torchair API manifest")
                continue
            for p in _check_params(entry["params"], n_pos, kws, has_star, has_starstar):
                problems.append(f"{where}: {q}: {p}")
        elif parts[0] == "torch_npu" and len(parts) == 2:
            found = _lookup_op(manifest, "npu", parts[1:])
            if found is None:
                problems.append(f"{where}: {q} is not a torch_npu op in the manifest (npu::{parts[1]})")
                continue
            problems += _check_candidates(where, q, found[1], n_pos, kws, has_star, has_starstar)
        elif parts[:2] == ["torch", "ops"] and len(parts) >= 4 and parts[2] in ("npu", "air"):
            found = _lookup_op(manifest, parts[2], parts[3:])
            if found is None:
                problems.append(f"{where}: {q} is not in the op schema manifest ({parts[2]}::{'.'.join(parts[3:])})")
                continue
            problems += _check_candidates(where, q, found[1], n_pos, kws, has_star, has_starstar)
        elif parts[0] == "torch_npu" and len(parts) > 2:
            # torch_npu.npu.* (streams, events, device helpers) is outside the manifest's scope:
            # the NPU templates must not rely on it, so flag it rather than pass it silently.
            problems.append(f"{where}: {q} is not covered by the manifest (only torch_npu.<op> calls are)")
    return sorted(problems, key=lambda s: (int(s.split(":")[1]) if s.split(":")[1].isdigit() else 0, s))


def _check_candidates(where, q, entries, n_pos, kws, has_star, has_starstar) -> list[str]:
    results = [_check_params(e["params"], n_pos, kws, has_star, has_starstar) for e in entries]
    if any(not r for r in results):
        return []  # compatible with at least one overload
    best = min(results, key=len)
    return [f"{where}: {q}: {p}" for p in best]
