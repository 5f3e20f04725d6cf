#!/usr/bin/env python
"""Extract the torchair / torch_npu API facts graphgen relies on from the torch-npu wheel.

The wheel is read as a zip archive and its Python sources are parsed with ``ast``; nothing
from it is imported or executed (importing torch_npu needs Huawei's CANN toolkit, which is
not available here).  The result is ``graphgen/npu/manifest.json``: sorted, deterministic,
with the wheel's name and sha256 and, for every entry, the file (and line) it came from.

Sections of the manifest:

* ``python_api``  -- public callables of ``torchair``, ``torchair.scope``, ``torchair.ops``,
  ``torchair.inference`` with parameter names/kinds/defaults (re-exports are followed through
  the ``__init__.py`` files to the defining module);
* ``op_schemas``  -- ``air::`` and ``npu::`` operator schemas: ``lib.define("...")`` strings in the
  wheel's Python sources, plus the ``custom``/``symint`` sections of torch_npu's native
  function yamls (``torch_npu/csrc/aten/npu_native_functions*.yaml``) which are the
  ``torch.ops.npu.*`` kernels (``exposed: true`` ones are also ``torch_npu.<name>``).

Usage::

    python scripts/extract_npu_manifest.py                       # pip download torch-npu==2.14.0
    python scripts/extract_npu_manifest.py --wheel /tmp/w/torch_npu-...whl
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import posixpath
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import yaml

TORCH_NPU_VERSION = "2.14.0"
TORCHAIR_ROOT = "torch_npu/dynamo/torchair"
# Public modules whose exported callables we record (module name -> package path in the wheel).
API_MODULES = {
    "torchair": f"{TORCHAIR_ROOT}/__init__.py",
    "torchair.scope": f"{TORCHAIR_ROOT}/scope/__init__.py",
    "torchair.ops": f"{TORCHAIR_ROOT}/ops/__init__.py",
    "torchair.inference": f"{TORCHAIR_ROOT}/inference/__init__.py",
}
# Internal callables a public one forwards its ``**kwargs`` to, recorded too: ``torchair.inference.cache_compile``
# takes ``**kwargs`` and passes them on to ``_cache_compiler.cache_compile``, whose named parameters (``ge_cache``,
# ``custom_decompositions``) are what a keyword must match -- through ``**kwargs`` a misspelt one is silently kept.
FORWARDED_API = {
    "torchair.inference._cache_compiler.cache_compile": (f"{TORCHAIR_ROOT}/inference/_cache_compiler.py",
                                                         "cache_compile"),
}
NATIVE_YAMLS = (
    "torch_npu/csrc/aten/npu_native_functions.yaml",
    "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml",
)
EXPOSED_API = "torch_npu/utils/exposed_api.py"
KEEP_NAMESPACES = ("air", "npu")
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "graphgen" / "npu" / "manifest.json"


# --------------------------------------------------------------------------- wheel access
class Wheel:
    """Read-only view of the wheel's text files (never extracted, never imported)."""

    def __init__(self, path: Path):
        self.path = path
        self.zf = zipfile.ZipFile(path)
        self.names = set(self.zf.namelist())

    def text(self, name: str) -> str:
        return self.zf.read(name).decode("utf-8")

    def sha256(self) -> str:
        h = hashlib.sha256()
        with open(self.path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()


def download_wheel(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", f"torch-npu=={TORCH_NPU_VERSION}",
           "--only-binary=:all:", "--python-version", "3.11", "--platform", "manylinux_2_28_x86_64",
           "-d", str(dest)]
    subprocess.run(cmd, check=True)
    wheels = sorted(dest.glob(f"torch_npu-{TORCH_NPU_VERSION}-*.whl"))
    if not wheels:
        raise SystemExit(f"no torch_npu {TORCH_NPU_VERSION} wheel in {dest}")
    return wheels[0]


# --------------------------------------------------------------------------- python API via ast
def _params(args: ast.arguments, drop_self: bool) -> list[dict]:
    out: list[dict] = []
    pos = list(args.posonlyargs) + list(args.args)
    defaults = [None] * (len(pos) - len(args.defaults)) + list(args.defaults)
    for i, (a, d) in enumerate(zip(pos, defaults)):
        if drop_self and i == 0 and a.arg in ("self", "cls"):
            continue
        kind = "positional_only" if i < len(args.posonlyargs) else "positional_or_keyword"
        out.append(_param(a.arg, kind, d))
    if args.vararg:
        out.append(_param(args.vararg.arg, "var_positional", None))
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        out.append(_param(a.arg, "keyword_only", d))
    if args.kwarg:
        out.append(_param(args.kwarg.arg, "var_keyword", None))
    return out


def _param(name: str, kind: str, default: ast.AST | None) -> dict:
    return {"name": name, "kind": kind, "has_default": default is not None,
            "default": ast.unparse(default) if default is not None else None}


def _module_path(modname: str, wheel: Wheel) -> str | None:
    """torchair.x.y -> wheel path of that module (torchair lives under torch_npu/dynamo)."""
    parts = modname.split(".")
    if parts[0] != "torchair":
        return None
    base = posixpath.join(TORCHAIR_ROOT, *parts[1:])
    for cand in (base + ".py", base + "/__init__.py"):
        if cand in wheel.names:
            return cand
    return None


def _path_to_modname(path: str) -> str:
    rel = path[len("torch_npu/dynamo/"):]
    rel = rel[:-len("/__init__.py")] if rel.endswith("/__init__.py") else rel[:-3]
    return rel.replace("/", ".")


def _resolve_from(path: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    pkg = _path_to_modname(path)
    if not path.endswith("__init__.py"):
        pkg = pkg.rsplit(".", 1)[0]
    for _ in range(node.level - 1):
        pkg = pkg.rsplit(".", 1)[0]
    return f"{pkg}.{node.module}" if node.module else pkg


class ApiExtractor:
    def __init__(self, wheel: Wheel):
        self.wheel = wheel
        self._trees: dict[str, ast.Module] = {}

    def tree(self, path: str) -> ast.Module:
        if path not in self._trees:
            self._trees[path] = ast.parse(self.wheel.text(path), filename=path)
        return self._trees[path]

    def exported_names(self, path: str) -> list[str]:
        tree = self.tree(path)
        for node in tree.body:  # an explicit __all__ wins
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                return sorted(ast.literal_eval(node.value))
        names = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.ImportFrom):
                for a in node.names:
                    names.add(a.asname or a.name)
        return sorted(n for n in names if not n.startswith("_"))

    def resolve(self, path: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
        """Follow ``name`` in module ``path`` through re-exports to its def/class node."""
        if depth > 10:
            return None
        tree = self.tree(path)
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
                return path, node
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if (a.asname or a.name) == name:
                        target_mod = _resolve_from(path, node)
                        sub = _module_path(f"{target_mod}.{a.name}", self.wheel)
                        if sub is not None:  # `from pkg import submodule`
                            return sub, ast.Module(body=[], type_ignores=[])
                        tpath = _module_path(target_mod, self.wheel)
                        if tpath is None:
                            return None
                        return self.resolve(tpath, a.name, depth + 1)
        return None

    def describe(self, public_name: str, path: str, node: ast.AST) -> dict:
        src = f"{path}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.FunctionDef):
            return {"kind": "function", "params": _params(node.args, drop_self=False), "source": src}
        if isinstance(node, ast.ClassDef):
            init = next((b for b in node.body if isinstance(b, ast.FunctionDef) and b.name == "__init__"), None)
            attrs = {}
            if init is not None:
                for stmt in ast.walk(init):
                    if isinstance(stmt, ast.Assign):
                        for t in stmt.targets:
                            if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                                    and t.value.id == "self" and not t.attr.startswith("_")):
                                attrs[t.attr] = _attr_value(stmt.value)
            d = {"kind": "class", "params": _params(init.args, drop_self=True) if init else [],
                 "source": src, "attributes": dict(sorted(attrs.items()))}
            return d
        return {"kind": "module", "params": [], "source": path}

    def extract(self) -> dict:
        api: dict[str, dict] = {}
        for modname, path in sorted(API_MODULES.items()):
            for name in self.exported_names(path):
                found = self.resolve(path, name)
                if found is None:
                    continue
                fpath, node = found
                entry = self.describe(f"{modname}.{name}", fpath, node)
                if entry["kind"] == "module":
                    continue
                entry["module"] = modname
                api[f"{modname}.{name}"] = entry
        for public, (path, name) in sorted(FORWARDED_API.items()):
            found = self.resolve(path, name)
            if found is not None:
                entry = self.describe(public, *found)
                entry["module"] = public.rsplit(".", 1)[0]
                api[public] = entry
        # the scope/ops/inference submodules are modules of the package, record them as such
        for modname in sorted(API_MODULES):
            api.setdefault(modname, {"kind": "module", "module": modname, "params": [],
                                     "source": API_MODULES[modname]})
        return dict(sorted(api.items()))


def _attr_value(value: ast.AST) -> dict:
    # OptionValue(default, [choices]) is how torchair declares enumerated options (e.g. mode).
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "OptionValue":
        try:
            default = ast.literal_eval(value.args[0]) if value.args else None
            choices = ast.literal_eval(value.args[1]) if len(value.args) > 1 else None
            return {"type": "OptionValue", "default": default, "choices": choices}
        except ValueError:
            pass
    if isinstance(value, ast.Call):
        return {"type": ast.unparse(value.func)}
    return {"type": "value", "expr": ast.unparse(value)}


# --------------------------------------------------------------------------- op schemas
_SCHEMA_RE = re.compile(r"^\s*([A-Za-z0-9_]+)(?:\.([A-Za-z0-9_]+))?\s*\((.*)\)\s*->\s*(.+?)\s*$", re.S)


def _split_top(s: str) -> list[str]:
    out, depth, cur = [], 0, []
    for ch in s:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def parse_schema(schema: str) -> dict:
    """Parse 'name.overload(Type a, *, Type b=1) -> Ret' into name, overload, params, returns."""
    m = _SCHEMA_RE.match(" ".join(schema.split()))
    if not m:
        raise ValueError(f"unparseable schema: {schema!r}")
    name, overload, args, rets = m.groups()
    params, kw_only = [], False
    for tok in _split_top(args):
        if tok == "*":
            kw_only = True
            continue
        default = None
        if "=" in tok:
            tok, default = (x.strip() for x in tok.split("=", 1))
        typ, pname = tok.rsplit(" ", 1)
        params.append({"name": pname, "type": typ.strip(),
                       "kind": "keyword_only" if kw_only else "positional_or_keyword",
                       "has_default": default is not None, "default": default,
                       "mutable": "!" in typ})
    return {"name": name, "overload": overload or "", "params": params, "returns": rets.strip()}


def _library_namespaces(tree: ast.Module) -> dict[str, str]:
    """Module-level `x = [torch.library.]Library("ns", ...)` -> {x: ns}."""
    out = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and ast.unparse(node.value.func).split(".")[-1] == "Library"
                and node.value.args and isinstance(node.value.args[0], ast.Constant)):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = node.value.args[0].value
    return out


def extract_python_defines(wheel: Wheel) -> list[tuple[str, str, str]]:
    """(namespace, schema, source) for every `<lib>.define("...")` in the wheel's Python."""
    trees: dict[str, ast.Module] = {}
    found = []
    py_files = sorted(n for n in wheel.names if n.startswith("torch_npu/") and n.endswith(".py"))

    def tree_of(p):
        if p not in trees:
            try:
                trees[p] = ast.parse(wheel.text(p))
            except (SyntaxError, UnicodeDecodeError):
                trees[p] = ast.Module(body=[], type_ignores=[])
        return trees[p]

    for path in py_files:
        text = wheel.text(path)
        if ".define(" not in text:
            continue
        tree = tree_of(path)
        libs = _library_namespaces(tree)
        for node in ast.walk(tree):  # `from ._lib import lib` -> namespace of that module's lib
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                base = posixpath.dirname(path)
                for _ in range(node.level - 1):
                    base = posixpath.dirname(base)
                target = posixpath.join(base, *(node.module or "").split(".")) + ".py"
                if target in wheel.names:
                    tlibs = _library_namespaces(tree_of(target))
                    for a in node.names:
                        if a.name in tlibs:
                            libs[a.asname or a.name] = tlibs[a.name]
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "define" and isinstance(node.func.value, ast.Name)
                    and node.func.value.id in libs and node.args
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                ns = libs[node.func.value.id]
                if ns in KEEP_NAMESPACES:
                    found.append((ns, " ".join(node.args[0].value.split()), f"{path}:{node.lineno}"))
    return found


def extract_yaml_ops(wheel: Wheel) -> list[tuple[str, str, bool]]:
    """(schema, source, exposed) for npu:: kernels declared in the native function yamls.

    ``custom`` entries are torch.ops.npu.* kernels.  ``symint`` mixes aten overrides with npu
    kernels; we keep only npu-looking names (or names already declared in ``custom``).
    """
    out = []
    for path in NATIVE_YAMLS:
        if path not in wheel.names:
            continue
        doc = yaml.safe_load(wheel.text(path))
        custom = [e for e in (doc.get("custom") or []) if isinstance(e, dict) and "func" in e]
        custom_names = {parse_schema(e["func"])["name"] for e in custom}
        for e in custom:
            out.append((e["func"], f"{path}#custom", bool(e.get("exposed", False))))
        for e in doc.get("symint") or []:
            if not (isinstance(e, dict) and "func" in e):
                continue
            n = parse_schema(e["func"])["name"]
            if n in custom_names or n.startswith(("npu_", "_npu_")):
                out.append((e["func"], f"{path}#symint", bool(e.get("exposed", False))))
    return out


def extract_exposed_list(wheel: Wheel) -> set[str]:
    tree = ast.parse(wheel.text(EXPOSED_API))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "public_npu_functions" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def build_schemas(wheel: Wheel) -> dict:
    schemas: dict[str, dict] = {}
    public = extract_exposed_list(wheel)

    def add(ns: str, schema: str, source: str, exposed: bool):
        p = parse_schema(schema)
        key = f"{ns}::{p['name']}" + (f".{p['overload']}" if p["overload"] else "")
        entry = schemas.get(key)
        if entry is None:
            entry = {"namespace": ns, "name": p["name"], "overload": p["overload"], "schema": schema,
                     "params": p["params"], "returns": p["returns"], "sources": [], "exposed": False,
                     "public": False}
            schemas[key] = entry
        elif entry["schema"] != schema:
            entry.setdefault("alternate_schemas", [])
            if schema not in entry["alternate_schemas"]:
                entry["alternate_schemas"].append(schema)
        if source not in entry["sources"]:
            entry["sources"].append(source)
        # Every torch.ops.npu.<name> is also bound as torch_npu.<name> (torch_npu/_init/core/_exports.py
        # loops over dir(torch.ops.npu)); "public" = listed in torch_npu's __all__ (utils/exposed_api.py),
        # "exposed" = the yaml's own `exposed: true` flag.
        entry["exposed"] = entry["exposed"] or exposed
        entry["public"] = ns == "npu" and p["name"] in public

    for ns, schema, source in extract_python_defines(wheel):
        add(ns, schema, source, False)
    for schema, source, exposed in extract_yaml_ops(wheel):
        add("npu", " ".join(schema.split()), source, exposed)
    for e in schemas.values():
        e["sources"].sort()
        if "alternate_schemas" in e:
            e["alternate_schemas"].sort()
    return dict(sorted(schemas.items()))


# --------------------------------------------------------------------------- main
def build_manifest(wheel_path: Path) -> dict:
    wheel = Wheel(wheel_path)
    return {
        "format": 1,
        "generated_by": "scripts/extract_npu_manifest.py (ast/yaml over the wheel; nothing imported)",
        "wheel": {"name": wheel_path.name, "sha256": wheel.sha256(), "torch_npu_version": TORCH_NPU_VERSION},
        "python_api": ApiExtractor(wheel).extract(),
        "op_schemas": build_schemas(wheel),
    }


def dump_manifest(manifest: dict) -> str:
    """Sorted JSON with one line per API entry / op schema: deterministic and diff-friendly."""
    def one(v):
        return json.dumps(v, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    lines = ["{"]
    keys = sorted(manifest)
    for i, k in enumerate(keys):
        v = manifest[k]
        comma = "," if i < len(keys) - 1 else ""
        if isinstance(v, dict) and k in ("python_api", "op_schemas"):
            lines.append(f" {one(k)}: {{")
            sub = sorted(v)
            for j, sk in enumerate(sub):
                lines.append(f"  {one(sk)}: {one(v[sk])}" + ("," if j < len(sub) - 1 else ""))
            lines.append(" }" + comma)
        else:
            lines.append(f" {one(k)}: {one(v)}{comma}")
    lines.append("}")
    text = "\n".join(lines) + "\n"
    json.loads(text)  # it must stay valid JSON
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheel", type=Path, help="use this torch_npu wheel instead of downloading it")
    ap.add_argument("--download-dir", type=Path, help="where pip download puts the wheel (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    if args.wheel:
        wheel = args.wheel
        manifest = build_manifest(wheel)
    elif args.download_dir:
        manifest = build_manifest(download_wheel(args.download_dir))
    else:
        with tempfile.TemporaryDirectory() as d:
            manifest = build_manifest(download_wheel(Path(d)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    text = dump_manifest(manifest)
    args.out.write_text(text)
    print(f"wrote {args.out}: {len(manifest['python_api'])} python API entries, "
          f"{len(manifest['op_schemas'])} op schemas ({os.path.getsize(args.out)} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
