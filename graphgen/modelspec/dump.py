"""Dumping a spec: plain data and readable YAML that parse back to an equal spec.

``dump_spec`` writes a spec to plain data and ``dump_spec_yaml`` to YAML text, and
``parse(dump(spec)) == spec`` (checked by ``import_hf`` on every import and by the tests).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import yaml

from . import model as m
from .errors import SpecError
from .yamlpos import load_yaml_data

# Top-level keys in reading order (identity first, then shape, then behaviour).
_TOP_ORDER = ("name", "family", "description", "dims", "quantization", "kv_cache", "pool", "features", "variants",
              "targets")


def dump_spec(spec: object) -> dict[str, Any]:
    """Plain data (YAML-ready) that parses back to an equal spec (``spec``: a `ModelSpec` or one of its
    parts, a dataclass).

    Optional fields left at their ``None`` default are omitted (absent means the default), and so is a
    spec's ``quantization`` when nothing is quantized.
    """

    def conv(x: Any) -> Any:
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
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

    data: dict[str, Any] = conv(spec)
    if isinstance(spec, m.ModelSpec) and spec.quantization == m.Quantization():
        del data["quantization"]
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
    return bool(ours == {"k": text} and theirs == {"k": text})


def _scalar_text(x: object) -> str:
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


def _emit(data: dict[str, Any], indent: int, lines: list[str]) -> None:
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


def dump_spec_yaml(spec: object, *, header: str = "", schema: str | None = None) -> str:
    """Readable YAML for a spec (block mappings, flow lists), optionally with a
    ``yaml-language-server`` schema line and ``header`` as comment lines."""
    lines: list[str] = []
    if schema:
        lines.append(f"# yaml-language-server: $schema={schema}")
    lines += [f"# {line}".rstrip() for line in header.splitlines()]
    _emit(dump_spec(spec), 0, lines)
    return "\n".join(lines) + "\n"
