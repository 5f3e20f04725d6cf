"""The server's and the router's code stays in small pieces: no function over 80 lines in
graphgen/serve/ or graphgen/route/ (``create_app`` was 231 lines of closures, ``create_router`` 210;
issue 30 took them apart). Module sizes are tests/test_structure.py's."""

from __future__ import annotations

import ast

import pytest

from serve_util import ROOT

LIMIT = 80


def _long_functions(folder, root=ROOT):
    out = []
    for path in sorted((root / "graphgen" / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > LIMIT:
                    out.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({n} lines)")
    return out


@pytest.mark.parametrize("folder", ["serve", "route"])
def test_no_function_over_80_lines(folder):
    assert _long_functions(folder) == []


def test_the_check_sees_a_long_function(tmp_path):
    (tmp_path / "graphgen" / "x").mkdir(parents=True)
    (tmp_path / "graphgen" / "x" / "m.py").write_text("def f():\n" + "    pass\n" * 81 + "def g():\n    pass\n")
    assert _long_functions("x", tmp_path) == ["graphgen/x/m.py:1 f (82 lines)"]
