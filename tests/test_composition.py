"""The composition matrix (graphgen/composition/, docs/composition.md): a test per cell.

- a **refused** cell: its launch, as ``graphgen serve`` flags parsed by the real parser, is refused by serve's own
  check (`graphgen.serve.cli.check_args`, what run/serve print before anything loads) with the table's sentence;
  a spec rule's cell is also in the spec rules' answer (`check_compat`, what validate and the loader say); a
  request-level cell's request is refused by the engine's check. And the table is the *only* place refusing it:
  with the cell's rows taken out of the table, the same check no longer says that sentence (lifting a cell is a
  change of the table, not of each runtime).
- a **runs** cell: the test it names exists (collected by this pytest run when its file was collected; its
  function and parameter in the file otherwise), and nothing refuses the launch it makes.
- the seed's combinations are all marked (runs or refused, never untested), and the doc is the table's.

Cheap: argument checks and spec loads, no engine (the runs cells' own tests run the engines).
"""

from __future__ import annotations

import ast
import dataclasses
import re
from functools import lru_cache
from pathlib import Path

import pytest

from graphgen import composition as comp
from support.collected import COLLECTED
from support.paths import REPO

SPECS = {"plain": "specs/tiny_deepseek_v3.yaml", "mtp": "specs/tiny_deepseek_v3_mtp.yaml",
         "lora": "specs/tiny_deepseek_v3_lora.yaml"}
REFUSED = [c for c in comp.CELLS if c.is_refused]
RUNS = [c for c in comp.CELLS if c.runs]
OFF = [c for c in comp.CELLS if c.is_off]


def _id(c: comp.Cell) -> str:
    return "+".join(c.features) + ("" if c.targets == comp.BOTH else f"@{c.targets[0]}") + \
        (f"-{comp.CELLS.index(c)}" if not c.runs else "")


@lru_cache(maxsize=None)
def _w8a8_spec(tmp: str) -> str:
    text = (REPO / SPECS["plain"]).read_text(encoding="utf-8")
    out = Path(tmp) / "tiny_deepseek_v3_w8a8.yaml"
    out.write_text(text + "\nquantization: {method: w8a8_dynamic}\n", encoding="utf-8")
    return str(out)


def serve_argv(x: comp.Launch, weights: Path) -> list[str]:
    """``graphgen serve`` flags making launch ``x`` on a tiny DeepSeek-V3 spec (its MTP / LoRA / W8A8 form)."""
    assert not (x.mtp and x.lora), "no tiny spec has both MTP layers and a lora: section"
    spec = str(REPO / SPECS["mtp" if x.mtp else "lora" if x.lora else "plain"])
    if x.w8a8:
        assert not (x.mtp or x.lora)
        spec = _w8a8_spec(str(weights))
    argv = ["serve", "--spec", spec, "--weights", str(weights), "--port", "0",
            "--write", x.write or "off", "--pool", x.pool or "host",
            "--async-scheduling" if x.async_scheduling else "--no-async-scheduling",
            "--chunked-prefill" if x.chunked else "--no-chunked-prefill"]
    for k in ("tp", "ep", "dp", "cp", "nnodes"):
        argv += [f"--{k}", str(getattr(x, k))]
    argv += ["--sp"] if x.sp else ["--no-sp"]
    argv += ["--target", "npu", "--standin"] if x.target == "npu" else []
    argv += ["--speculative", "mtp"] if x.speculative else []
    argv += ["--role", x.role] if x.role != "both" else []
    argv += ["--tool-call-parser", "deepseek_v31"] if x.tools else []
    return argv


def serve_check(x: comp.Launch, weights: Path) -> str | None:
    """What ``graphgen serve`` says of launch ``x`` before it loads anything (None: it would start)."""
    from graphgen.cli.main import build_parser
    from graphgen.serve.cli import check_args

    args = build_parser().parse_args(serve_argv(x, weights))
    problem, _ = check_args(args)
    return problem


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    """A folder serve's check takes for --weights (nothing loads from it before the refusals)."""
    return tmp_path_factory.mktemp("composition_weights")


def test_the_launch_flags_say_what_the_example_launch_is(weights):
    """The harness itself: the flags serve_argv writes give back the launch (else a cell would test another one)."""
    from graphgen.cli.main import build_parser
    from graphgen.engine_args import launch_of
    from graphgen.modelspec.loader import load_spec

    for c in comp.CELLS:
        for t in c.targets:
            x = c.launch(t)
            if x.structured:
                continue
            args = build_parser().parse_args(serve_argv(x, weights))
            got = launch_of(load_spec(args.spec), args)
            # the tiny specs list prefix_cache (a pool hit is up to the prompts); no write mode set: off
            assert dataclasses.replace(got, prefix_cache=x.prefix_cache) == dataclasses.replace(
                x, write=x.write or "off", pool=x.pool or "host"), c


@pytest.mark.parametrize("cell", REFUSED, ids=_id)
def test_a_refused_cell_is_refused_with_its_sentence_and_only_by_the_table(cell, weights, monkeypatch):
    for target in cell.targets:
        x = cell.launch(target)
        assert cell.applies(x), f"{cell}: does not refuse its own example launch {x}"
        if cell.check == "request":
            _request_refused(cell, x)
            continue
        first = comp.refusals(x)[0]
        said = serve_check(x, weights)
        assert said == first.sentence(x), (cell.features, target, said)
        if cell.check == "spec":  # validate and the loader: the rule with its path and fix
            from graphgen.modelspec.compat import check_compat
            from graphgen.modelspec.loader import load_spec

            spec = load_spec(REPO / SPECS["mtp" if x.mtp else "lora" if x.lora else "plain"])
            spec = spec.with_overrides(tp=x.tp, ep=x.ep, dp=x.dp, cp=x.cp, sp=x.sp)
            assert cell.rule(x) in list(check_compat(spec)), cell.features
        # lifted: the cell's rows out of the table, nothing else in the code says its sentence
        mine = cell.sentence(x)
        monkeypatch.setattr(comp.table, "CELLS",
                            tuple(c for c in comp.CELLS if not (c.is_refused and c.sentence(x) == mine)))
        assert serve_check(x, weights) != mine, f"{cell.features}: refused outside the table"
        monkeypatch.undo()


@pytest.mark.parametrize("cell", OFF, ids=_id)
def test_a_turned_off_cell_starts_and_says_what_it_runs_without(cell, weights):
    from graphgen.cli.main import build_parser
    from graphgen.engine_args import launch_notes
    from graphgen.modelspec.loader import load_spec

    for target in cell.targets:
        x = cell.launch(target)
        if comp.refusals(x):  # refused on this target (cp and sp on the NPU): the refusal is what it says
            assert serve_check(x, weights) == comp.refusals(x)[0].sentence(x)
            continue
        assert serve_check(x, weights) is None, (cell.features, target)
        args = build_parser().parse_args(serve_argv(x, weights))
        assert launch_notes(load_spec(args.spec), args) == [cell.sentence(x)]  # what serve prints, once
        args = build_parser().parse_args(serve_argv(dataclasses.replace(x, async_scheduling=False), weights))
        assert launch_notes(load_spec(args.spec), args) == []  # the control: without the feature, no note


def _request_refused(cell: comp.Cell, x: comp.Launch) -> None:
    from graphgen.runtime.engine.grammar import StructuredOutput
    from graphgen.runtime.engine.sampling import SamplingParams
    from graphgen.runtime.engine.spec_decode import speculative_refusal

    assert cell.features == ("mtp", "structured"), "a new request-level cell: say how its request is made"
    params = SamplingParams(structured=StructuredOutput(grammar='{"grammars": []}', tokenizer_dir="tok"))
    assert speculative_refusal(params) == ("response_format", cell.refused)
    assert speculative_refusal(SamplingParams()) is None  # the control: without it, nothing refused


def _test_exists_in_file(node: str) -> str | None:
    """None when ``file::name[param]`` names a test function of the file (and the parameter's id appears in
    it); else what is missing."""
    file, _, rest = node.partition("::")
    name, _, param = rest.partition("[")
    path = REPO / file
    if not path.is_file():
        return f"no file {file}"
    src = path.read_text(encoding="utf-8")
    tree = ast.parse(src)
    fns = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    if name not in fns or not name.startswith("test_"):
        return f"no test function {name} in {file}"
    fn = next(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name)
    params = [n for n in fn.args.args if n.arg not in ("self",)]
    for part in param.rstrip("]").split("-") if param else ():
        auto = re.fullmatch(r"([a-z_]+)\d+", part)  # pytest's own id of an unnamed value: argname + index
        if part not in src and not (auto and any(a.arg == auto.group(1) for a in params)):
            return f"no parameter {part!r} in {file}"
    return None


@pytest.mark.parametrize("cell", RUNS, ids=_id)
def test_a_runs_cell_names_a_test_that_exists_and_its_launch_is_refused_by_nothing(cell, request, weights):
    collected = request.config.stash.get(COLLECTED, frozenset())
    file = cell.runs.partition("::")[0]
    if any(n.startswith(file + "::") for n in collected):  # pytest collected that file in this run: its word
        assert cell.runs in collected, f"{cell.runs}: not collected by pytest"
    else:
        assert _test_exists_in_file(cell.runs) is None, _test_exists_in_file(cell.runs)
    for target in cell.targets:
        x = cell.launch(target)
        assert comp.refusals(x) == [], (cell.features, target, [c.refused for c in comp.refusals(x)])
        assert comp.launch_notes(x) == [], (cell.features, target)  # it runs with every feature it names
        if not x.structured:
            assert serve_check(x, weights) is None, (cell.features, target)


def test_the_existence_check_can_fail():
    assert _test_exists_in_file("tests/test_composition.py::test_no_such_test") is not None
    assert _test_exists_in_file("tests/no_such_file.py::test_x") is not None
    assert _test_exists_in_file("tests/npu/test_w8a8.py::test_w8a8_npu_standin_gives_the_cpu_targets_tokens"
                                "[no_such_family]") is not None
    assert _test_exists_in_file("tests/serve/test_serve_structured.py::test_json_schema_validates[sampling0]") is None
    assert _test_exists_in_file("tests/serve/test_serve_structured.py::test_json_schema_validates[nosuch0]") is not None
    assert _test_exists_in_file(RUNS[0].runs) is None


def test_every_seed_combination_is_marked_and_the_table_checks_its_rows():
    for s in comp.SEED:
        assert comp.verdict(s.features, "cpu").word != "untested", s
    bad = comp.Cell(("cp", "no_such_feature"), comp.CPU, refused="x", check="launch")
    with pytest.raises(AssertionError, match="unknown feature"):
        comp.launch._check_cell(bad)
    with pytest.raises(AssertionError, match="either runs"):
        comp.launch._check_cell(comp.Cell(("cp",), comp.CPU, runs="tests/x.py::test_y", refused="no"))
    with pytest.raises(AssertionError, match="not Launch fields"):
        comp.launch._check_cell(comp.Cell(("cp",), comp.CPU, refused="cp ({no_such_field})", check="launch"))


def test_the_doc_is_the_tables():
    assert (REPO / "docs" / "composition.md").read_text(encoding="utf-8") == comp.markdown(), \
        "docs/composition.md is stale: run graphgen generate"
