"""The rank model's structure (issue 42), checked from the sources of ``graphgen/`` with ``ast`` (nothing
imported): one runtime for every CPU rank, no model runner per parallel form, one rank build entry, and a
layout type in ``runtime/parallel/`` that is the only place process groups are made. Each rule runs on a
small source that breaks it too (the negative controls), so a checker that sees nothing fails."""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "graphgen"

# the runtime the generated CPU modules run on, and the one every CPU rank uses (any layout)
RUNTIMES = {"CpuRuntime": "graphgen/runtime/core/cpu_runtime.py",
            "CollectiveRuntime": "graphgen/runtime/parallel/collectives.py"}
# one model runner per target; a parallel form is a rank feature (runtime/parallel/features.py), not a class
RUNNERS = {"RunnerSaves": "graphgen/runtime/engine/runner.py", "CpuModelRunner": "graphgen/runtime/engine/runner.py",
           "NpuModelRunner": "graphgen/npu/run/runner.py"}
RUNNER_BASES = {"RunnerSaves", "CpuModelRunner", "NpuModelRunner"}
RUNTIME_BASES = {"CpuRuntime", "CollectiveRuntime"}
BUILD_ENTRY = ("graphgen/runtime/parallel/rank.py", "build_rank")
LAYOUT = "graphgen/runtime/parallel/layout.py"
# where a process group may be made: every named group by the layout; the host-side gloo group beside a
# non-gloo world (the rank process)
NEW_GROUP_HOMES = {LAYOUT, "graphgen/runtime/parallel/rank_process.py"}


@functools.lru_cache(maxsize=1)
def _read() -> tuple:
    return tuple((str(p.relative_to(REPO)), p.read_text(encoding="utf-8")) for p in sorted(SRC.rglob("*.py")))


def _sources() -> dict[str, str]:
    return dict(_read())


def _bases(cls: ast.ClassDef) -> set[str]:
    return {b.id if isinstance(b, ast.Name) else b.attr for b in cls.bases if isinstance(b, (ast.Name, ast.Attribute))}


@functools.lru_cache(maxsize=None)
def _file(rel: str, text: str) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """One file's breaches and its rank build entries (cached: the negative controls re-check the tree)."""
    out, entries = [], []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            if _bases(node) & RUNTIME_BASES and RUNTIMES.get(node.name) != rel:
                out.append(f"{rel}: class {node.name} subclasses a CPU runtime (a runtime per parallel form?): "
                           f"resolve its groups in the layout's table (CollectiveRuntime)")
            if _bases(node) & RUNNER_BASES and RUNNERS.get(node.name) != rel:
                out.append(f"{rel}: class {node.name} subclasses a model runner: make it a rank feature "
                           f"(runtime/parallel/features.py) applied by RankRunner")
            if node.name == "RankLayout" and rel != LAYOUT:
                out.append(f"{rel}: a second RankLayout (its home is {LAYOUT})")
        if isinstance(node, ast.FunctionDef) and node.name.startswith("build_") and "rank" in node.name:
            entries.append((rel, node.name))
        if isinstance(node, ast.Attribute) and node.attr == "new_group" and rel not in NEW_GROUP_HOMES:
            out.append(f"{rel}:{node.lineno}: new_group outside the layout (RankLayout.process_groups makes them)")
    return tuple(out), tuple(entries)


def rank_model_problems(sources: dict[str, str]) -> list[str]:
    """What breaks the rank model in ``sources`` (path -> text), one line each."""
    out: list[str] = []
    entries: list = []
    for rel, text in sources.items():
        problems, found = _file(rel, text)
        out += problems
        entries += found
    if entries != [BUILD_ENTRY]:
        out.append(f"rank build entries {entries}: expected exactly {[BUILD_ENTRY]}")
    if not any(rel == LAYOUT and "class RankLayout" in text for rel, text in sources.items()):
        out.append(f"no RankLayout in {LAYOUT}")
    return out


def test_the_rank_model_holds_in_graphgen():
    assert rank_model_problems(_sources()) == []


@pytest.mark.parametrize("extra, expect", [
    ("from ..core.cpu_runtime import CpuRuntime\nclass DPRankRuntime(CpuRuntime): pass\n", "subclasses a CPU runtime"),
    ("class ContextRankRunner(CpuModelRunner): pass\n", "subclasses a model runner"),
    ("class NpuDPRunner(runner.NpuModelRunner): pass\n", "subclasses a model runner"),
    ("def build_dp_rank(spec): pass\n", "rank build entries"),
    ("import torch.distributed as dist\ng = dist.new_group([0, 1])\n", "new_group outside the layout"),
])
def test_each_rule_fails_on_a_source_that_breaks_it(extra, expect):
    sources = _sources()
    sources["graphgen/runtime/parallel/tp_rank.py"] = extra
    problems = rank_model_problems(sources)
    assert any(expect in p for p in problems), problems
    moved = {k: v for k, v in _sources().items() if k != LAYOUT}  # the layout type gone from its home
    assert any("no RankLayout" in p for p in rank_model_problems(moved))
