"""The verifier proves race freedom; every single missing record or wait is caught."""

import re

import pytest

from ir_util import REPO, golden_files, run_cli
from graphgen.ir.graph import Graph, Node
from graphgen.ir.text import parse_graph
from graphgen.passes.manager import run_pipeline
from graphgen.passes.verify import check
from graphgen.modelspec.loader import load_spec

SYNC_LINE = re.compile(r"^node \S+ \S+ (record|wait) ")


def _mutants():
    for path in golden_files():
        lines = path.read_text().splitlines(keepends=True)
        for i, line in enumerate(lines):
            if SYNC_LINE.match(line):
                yield pytest.param(path, i, id=f"{path.relative_to(REPO / 'generated').as_posix()}:{i + 1}")


MUTANTS = list(_mutants())


def test_golden_graphs_verify_clean():
    assert golden_files()
    for path in golden_files():
        assert check(parse_graph(path.read_text(), str(path))) == [], path


def test_every_saving_golden_graph_has_events():
    saving = [p for p in golden_files() if "saves=true" in p.read_text()]
    assert saving
    for p in saving:
        assert any(SYNC_LINE.match(line) for line in p.read_text().splitlines()), p


@pytest.mark.parametrize("path,line_index", MUTANTS)
def test_deleting_any_record_or_wait_line_fails_verification(path, line_index):
    lines = path.read_text().splitlines(keepends=True)
    deleted = lines.pop(line_index)
    problems = check(parse_graph("".join(lines), str(path)))
    assert problems, f"deleting {deleted!r} went unnoticed"
    kind = SYNC_LINE.match(deleted).group(1)
    event = re.search(r"event=(\S+)", deleted).group(1)
    text = "\n".join(problems)
    # The message names the dangling event (the other half of the pair is left alone) ...
    assert event in text
    assert ("has no wait" in text) if kind == "wait" else ("has no record" in text)
    # ... and, for a deleted wait, the race it would have allowed, naming both nodes.
    if kind == "wait":
        assert "race on" in text and "missing event" in text


def test_deleting_a_wait_line_via_cli_exits_1(tmp_path):
    src = REPO / "generated" / "tiny_qwen3" / "mempool_prefill_layer.graph"
    lines = src.read_text().splitlines(keepends=True)
    idx = next(i for i, l in enumerate(lines) if l.startswith("node L00.kv_save.wait "))
    del lines[idx]
    bad = tmp_path / "edited.graph"
    bad.write_text("".join(lines))
    res = run_cli("verify", bad)
    assert res.returncode == 1
    assert "race on kv_cache.L00: L00.kv_write (main, write) and L00.kv_save (kv_save, read) are unordered" in res.stderr
    ok = run_cli("verify", src)
    assert ok.returncode == 0 and "race-free" in ok.stdout


def test_verify_cli_rejects_unparsable_file(tmp_path):
    f = tmp_path / "x.graph"
    f.write_text("graphgen-ir 1\ngraph g\nnode a main\n")
    res = run_cli("verify", f)
    assert res.returncode == 2 and "x.graph:3" in res.stderr


def test_without_the_event_pass_the_async_graph_is_racy():
    """The seed's first defect (a variant that recorded no events) cannot pass verification."""
    spec = load_spec(REPO / "specs" / "tiny_qwen3.yaml")
    graph = run_pipeline(spec, "splitfuse_layer", until="insert_kv_save")
    problems = check(graph)
    races = [p for p in problems if p.startswith("race on")]
    assert len(races) >= spec.dims.num_hidden_layers + 1  # one per layer's KV + the staging->host commit
    assert any("race on kv_cache.L01: L01.kv_write (main, write) and L01.kv_save (kv_save, read)" in p for p in races)


def test_misspelt_wait_event_is_caught():
    """A wait naming an event nobody records (the seed's misspelt key) is an error, not a silent pass."""
    spec = load_spec(REPO / "specs" / "tiny_qwen3.yaml")
    graph = run_pipeline(spec, "splitfuse_layer")
    w = next(n for n in graph.nodes if n.op == "wait")
    graph.events[w.attrs["event"] + "_typo"] = graph.events[w.attrs["event"]]
    w.attrs["event"] += "_typo"
    text = "\n".join(check(graph))
    assert "has no record" in text and "has no wait" in text and "race on" in text


def _two_streams():
    g = Graph(name="t.cyc", streams=["main", "kv_save"])
    g.declare("buf", "kv_cache")
    g.declare("ids", "input")
    return g


def _save(nid, stream, cache="buf", staging="st"):
    """A schema-valid kv_save: reads a KV-cache buffer, writes a pool-staging buffer."""
    return Node(nid, "kv_save", stream, reads=(cache, "ids"), writes=(staging,))


def test_cycle_is_reported_as_deadlock():
    g = _two_streams()
    g.events = {"e1": ("main", "kv_save"), "e2": ("kv_save", "main")}
    g.add(Node("m.wait", "wait", "main", attrs={"event": "e2"}))
    g.add(Node("m.rec", "record", "main", attrs={"event": "e1"}))
    g.add(Node("s.wait", "wait", "kv_save", attrs={"event": "e1"}))
    g.add(Node("s.rec", "record", "kv_save", attrs={"event": "e2"}))
    problems = check(g)
    assert any("cycle (deadlock)" in p and "m.wait" in p and "s.wait" in p for p in problems), problems


def test_write_write_race_and_ordered_version():
    g = _two_streams()
    g.declare("st", "pool_staging")
    g.add(_save("a", "main"))
    g.add(_save("b", "kv_save"))
    assert any("race on st: a (main, write) and b (kv_save, write)" in p for p in check(g))
    g.events = {"ev.a": ("main", "kv_save")}
    g.add(Node("a.record", "record", "main", attrs={"event": "ev.a"}), after="a")
    g.add(Node("b.wait", "wait", "kv_save", attrs={"event": "ev.a"}), before="b")
    assert check(g) == []


def test_reads_from_two_streams_do_not_race():
    g = _two_streams()
    g.declare("st0", "pool_staging")
    g.declare("st1", "pool_staging")
    g.add(_save("a", "main", staging="st0"))
    g.add(_save("b", "kv_save", staging="st1"))
    assert check(g) == []


def test_values_cannot_cross_streams():
    g = _two_streams()
    g.declare("x", "value")
    g.declare("y", "value")
    g.add(Node("a", "embedding", "main", reads=("ids",), writes=("x",), attrs={"w_embed": "e"}))
    g.add(Node("b", "rms_norm", "kv_save", reads=("x",), writes=("y",), attrs={"w_norm": "n", "eps": 1e-6}))
    assert any("value x crosses streams" in p for p in check(g))


def test_events_with_wrong_streams_or_undeclared_are_errors():
    g = _two_streams()
    g.events = {"e": ("main", "kv_save")}
    g.add(Node("r", "record", "kv_save", attrs={"event": "e"}))
    g.add(Node("w", "wait", "main", attrs={"event": "nope"}))
    text = "\n".join(check(g))
    assert "record of e is on stream kv_save" in text and "undeclared event nope" in text


@pytest.mark.parametrize("layers", [1, 3, 130])
def test_pipeline_verifies_for_many_sizes(layers):
    import dataclasses

    for name in ("tiny_qwen3", "tiny_deepseek_v3"):
        spec = load_spec(REPO / "specs" / f"{name}.yaml")
        dims = dataclasses.replace(spec.dims, num_hidden_layers=layers,
                                   **({"first_k_dense_replace": min(1, layers)} if name == "tiny_deepseek_v3" else {}))
        spec = dataclasses.replace(spec, dims=dims)
        for v in spec.variants:
            g = run_pipeline(spec, v)
            saves = g.meta["saves"]
            records = [n for n in g.nodes if n.op == "record" and n.stream != "kv_load"]
            loads = [n for n in g.nodes if n.op == "record" and n.stream == "kv_load"]
            # history: one load -> main event per load (one per layer, or one for the bulk load)
            assert len(loads) == (0 if not g.meta["history"] else
                                  layers if spec.variant_granularity(spec.variants[v]) == "layer" else 1)
            if not saves:
                assert records == []
            elif g.meta["granularity"] == "layer":
                assert len(records) == layers + 1  # one per layer boundary + save -> host
            else:
                assert len(records) == 2  # after the last KV write + save -> host
