"""GE converter coverage: does every target of a post-AOT FX graph have a torchair converter that
does more than raise?

In max-autotune torchair walks the post-AOT FX graph with an interpreter and converts each
``call_function`` node to GE ops (``npu_fx_compiler.py:197-227`` ``_wrap`` -> ``parse_node``): a
builtin callable other than the binary operators is executed in Python (``:208``); everything else
goes to ``_parse_node_internal``, which handles a few targets itself (scopes, record/wait, ...,
``fx2ge_converter.py:1714-1745``) and calls the target's registered converter for the rest
(``get_or_auto_gen_converter``, ``:813-826``).  There is no fallback: a converter that raises
(``aten.sort.stable``: ``ge_converter/aten/sort.py:36-46``) fails the GE compile.

The table (``ge_converters.json`` beside this file) is extracted from the torch-npu 2.14.0 wheel by
``scripts/extract_ge_converters.py`` (ast only, nothing imported).  What a pass here proves: each op
GE would receive has a converter that does not only raise.  What it cannot prove: that the
converter accepts these arguments, dtypes and shapes, that the GE op compiles, or anything GE does
afterwards (docs/npu.md, "GE converter coverage").

No allow-list: an ``npu.*`` op without a converter in the table is a problem like any other.  torchair
would try to build one from the installed CANN's Ascend IR (``fx2ge_converter.py:813-831``), deriving the
IR name from the op name (``npu_moe_token_unpermute`` -> ``NpuMoeTokenUnpermute``, where CANN's op is
``MoeTokenUnpermute``: audit 3 N4), or fall back to a g++-built host callback; neither can be checked
offline, so the lowering uses only ops the wheel converts.

Only max-autotune graphs go through these converters; reduce-overhead lowers through torchair's
``_acl_concrete_graph/fx2acl_converter.py`` (``npu_fx_compiler.py:754-759``) and is not checked.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Optional

TABLE = Path(__file__).resolve().parent / "ge_converters.json"
GE_MODE = "max-autotune"

@lru_cache(maxsize=None)
def load_table(path: str = str(TABLE)) -> dict:
    return json.loads(Path(path).read_text())


def target_name(target) -> tuple[str, str]:
    """("op", str(OpOverload)) or ("callable", "module.qualname"): never a repr with an address."""
    import torch

    if isinstance(target, torch._ops.HigherOrderOperator):  # auto_functionalized_v2 etc.: torchair matches by name
        return "op", target.name()
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return "op", str(target)
    mod = getattr(target, "__module__", None) or type(target).__module__
    qual = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or type(target).__qualname__
    return "callable", f"{mod}.{qual}"


def graph_targets(graphs: Iterable) -> tuple[list[str], list[str]]:
    """Sorted unique (ops, callables) over the ``call_function`` nodes of FX graphs (GraphModules)."""
    ops, calls = set(), set()
    for gm in graphs:
        for n in gm.graph.nodes:
            if n.op == "call_function":
                kind, name = target_name(n.target)
                (ops if kind == "op" else calls).add(name)
    return sorted(ops), sorted(calls)


def captured_targets(captured) -> tuple[list[str], list[str]]:
    """Targets of a stand-in ``CapturedGraph``: the raw post-AOT graph (what torchair's compiler
    receives) and the graph after the modelled re-inplacing (its in-place twins), both."""
    return graph_targets([captured.raw, captured.gm])


def _is_builtin_callable(name: str) -> bool:
    """torchair's rule (``npu_fx_compiler.py:29-31,208``) applied to a callable given by name."""
    import importlib

    from torch._dynamo.trace_rules import is_builtin_callable

    mod, _, qual = name.rpartition(".")
    try:
        obj = importlib.import_module(mod)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return False
    return is_builtin_callable(obj)


def check_targets(ops: Iterable[str], callables: Iterable[str], *, where: str, mode: str = GE_MODE,
                  table: Optional[dict] = None) -> list[str]:
    """Problems (empty = every target is convertible) for one graph.  ``where`` names the graph in
    each message: ``"<spec> variant V (mode M, bucket {...})"``."""
    if mode != GE_MODE:
        return []  # reduce-overhead: not lowered through the GE converters (module docstring)
    t = table or load_table()
    conv, special = t["converters"], {e["target"]: e["source"] for e in t["special_targets"]}
    binops = set(t["builtin_rule"]["binary_operators"])
    fix = ("express it with ops that have a real converter (graphgen/npu/check/ge_converters.json), "
           "or compute it on the host and pass it as a step input")
    problems = []
    for op in ops:
        if op in special:
            continue
        e = conv.get(op)
        if e is None:
            hint = (" (torchair would try to auto-generate one from the Ascend IR, fx2ge_converter.py:813-826;"
                    " that cannot be checked offline)" if not op.startswith(("aten.", "prims.", "prim.")) else "")
            problems.append(f"{where}: {op} has no GE converter in torch-npu {t['wheel']['torch_npu_version']}"
                            f"{hint}: {fix}")
        elif e["kind"] == "raises":
            problems.append(f"{where}: {op}: torchair's GE converter only raises ({'; '.join(e['sources'])}), "
                            f"so GE cannot compile this graph: {fix}")
    for c in callables:
        e = conv.get(c)
        if e is not None:
            if e["kind"] == "raises":
                problems.append(f"{where}: {c}: torchair's GE converter only raises ({'; '.join(e['sources'])})")
            continue
        if c in binops:
            problems.append(f"{where}: {c} is a binary operator torchair converts ({t['builtin_rule']['source']}) "
                            f"but has no converter for")
        elif not _is_builtin_callable(c):
            problems.append(f"{where}: {c} is neither an OpOverload nor a builtin callable: torchair cannot "
                            f"convert it ({t['builtin_rule']['source']}); keep Python functions out of the graph")
    return problems


def bucket_label(bucket: dict) -> str:
    return "{" + ", ".join(f"{k}={v}" for k, v in bucket.items()) + "}"


def where(spec: str, variant: str, mode: str, bucket: dict) -> str:
    return f"{spec}: variant {variant} (mode {mode}, bucket {bucket_label(bucket)})"


def check_ops_report(report: dict, table: Optional[dict] = None) -> list[str]:
    """Problems over an ``--ops-json`` report ({"spec", "graphs": [{variant, mode, bucket, ops, callables}]})."""
    out = []
    for g in report["graphs"]:
        out += check_targets(g["ops"], g["callables"], where=where(report["spec"], g["variant"], g["mode"],
                                                                   g["bucket"]), mode=g["mode"], table=table)
    return out


# --------------------------------------------------------------------------- torchair's AOT decompositions
class UnmodelledDecomposition(NotImplementedError):
    pass


def torchair_decompositions(table: Optional[dict] = None) -> dict:
    """The decomposition table torchair hands to ``aot_module_simplified``, for the stand-in's AOT.

    torchair 2.14.0 decomposes only ``npu_define.allgather`` and ``_c10d_functional.all_to_all_single``
    (``air/_utils/__init__.py:465-478``), with its own functions that we cannot import.  Each entry
    whose op exists in this torch maps to a function that raises: graphgen emits neither op today,
    and if it ever does, the stand-in must fail loudly rather than check ops GE would never see.
    Ops absent from this torch (``npu_define`` is torchair's own namespace) cannot occur in a graph."""
    import torch

    out = {}
    for e in (table or load_table())["decompositions"]["aot_table"]:
        ns, name, overload = e["target"].split(".")
        try:
            op = getattr(getattr(getattr(torch.ops, ns), name), overload)
        except (AttributeError, RuntimeError):
            continue

        def unmodelled(*args, _e=e, **kwargs):
            raise UnmodelledDecomposition(
                f"torchair decomposes {_e['target']} before GE conversion ({_e['source']}: {_e['decomposition']}); "
                f"the CPU stand-in does not model that decomposition: add a model to "
                f"graphgen/npu/check/geops.py before emitting this op")
        out[op] = unmodelled
    return out


def ops_report(spec: str, results) -> dict:
    """The ``graphgen compile --standin --steps N --ops-json FILE`` document from ``run_standin_loop``
    results: one entry per (variant, mode, bucket), sorted, names only (no memory addresses)."""
    import torch

    graphs = []
    for r in results:
        for g in r.graphs:
            ops, calls = captured_targets(g["captured"])
            graphs.append({"variant": r.variant, "mode": r.mode, "bucket": dict(g["bucket"]), "ops": ops,
                           "callables": calls})
    graphs.sort(key=lambda g: (g["variant"], g["mode"], sorted(g["bucket"].items())))
    return {"spec": spec, "torch": torch.__version__, "graphs": graphs}


def dump_report(report: dict) -> str:
    return json.dumps(report, indent=1, sort_keys=True) + "\n"
