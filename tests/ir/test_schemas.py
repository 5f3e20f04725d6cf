"""Op schemas: Graph.add admits only nodes that match; the verifier reports every node that does not
(graphs edited by other means: a node list changed in place)."""

import pytest

from ir_util import REPO
from graphgen.ir.graph import Graph, IRError, Node
from graphgen.ir.text import ParseError, parse_graph, print_graph
from graphgen.modelspec.loader import load_spec
from graphgen.passes.manager import run_pipeline
from graphgen.passes.verify import check


def _graph():
    return run_pipeline(load_spec(REPO / "specs" / "tiny_qwen3.yaml"), "mempool_prefill_layer")


def _replace(g, node_id, **changes):
    i = next(i for i, n in enumerate(g.nodes) if n.id == node_id)
    n = g.nodes[i]
    fields = dict(id=n.id, op=n.op, stream=n.stream, reads=n.reads, writes=n.writes, attrs=dict(n.attrs), layer=n.layer)
    fields.update(changes)
    g.nodes[i] = Node(**fields)


def test_verifier_reports_every_schema_violation():
    g = _graph()
    assert check(g) == []
    attn = g.node("L00.attn")
    _replace(g, "L00.attn", reads=attn.reads[:-1])  # wrong arity
    kvw = g.node("L01.kv_write")
    _replace(g, "L01.kv_write", attrs={k: v for k, v in kvw.attrs.items() if k != "block_size"})  # missing attribute
    mlp = g.node("L00.mlp")
    _replace(g, "L00.mlp", reads=("kv_cache.L00", mlp.reads[1]))  # wrong operand kind: a buffer where a value goes
    _replace(g, "L01.mlp_norm", attrs={**g.node("L01.mlp_norm").attrs, "color": "red"})  # unknown attribute
    _replace(g, "lm_head", op="lm_tail")  # unknown op
    problems = check(g)
    text = "\n".join(problems)
    assert "node L00.attn: op paged_attention takes 5 inputs (q, cache, block_tables, seq_lens, query_lens), got 4" in text
    assert "node L01.kv_write: op kv_write lacks attribute(s) block_size" in text
    assert "node L00.mlp: input x of swiglu_mlp_residual must be a value, kv_cache.L00 is a kv_cache" in text
    assert "node L01.mlp_norm: op rms_norm has unknown attribute(s) color" in text
    assert "node lm_head: unknown op 'lm_tail'" in text


@pytest.mark.parametrize("node,problem", [
    (Node("x", "rms_norm", "main", reads=("h.embed", "cos"), writes=("y",), attrs={"w_norm": "w", "eps": 1e-6}),
     "takes 1 inputs"),
    (Node("x", "rms_norm", "main", reads=("h.embed",), writes=("y",), attrs={"w_norm": "w"}),
     "lacks attribute(s) eps"),
    (Node("x", "kv_save", "main", reads=("h.embed", "save_block_ids"), writes=("pool_staging.L00",)),
     "input caches of kv_save must be a kv_cache, h.embed is a value"),
    (Node("x", "kv_write", "main", reads=("slot_mapping",), writes=("kv_cache.L00",)),
     "takes at least 2 inputs"),
])
def test_graph_add_admits_only_matching_nodes(node, problem):
    g = Graph(name="t.g")
    for name, kind in (("h.embed", "value"), ("y", "value"), ("cos", "value"), ("save_block_ids", "input"),
                       ("slot_mapping", "input"), ("kv_cache.L00", "kv_cache"), ("pool_staging.L00", "pool_staging")):
        g.declare(name, kind)
    with pytest.raises(IRError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        g.add(node)
    assert g.nodes == []


def test_splice_admits_only_matching_nodes():
    g = Graph(name="t.g")
    for name in ("h", "y", "z"):
        g.declare(name, "value")
    norm = {"w_norm": "w", "eps": 1e-6}
    g.add(Node("ok", "rms_norm", "main", reads=("h",), writes=("y",), attrs=norm))
    good = Node("good", "rms_norm", "main", reads=("y",), writes=("z",), attrs=norm)
    with pytest.raises(IRError, match="takes 1 inputs"):
        g.splice(after={"ok": [good, Node("bad", "rms_norm", "main", reads=("h", "y"), writes=("z",), attrs=norm)]})
    assert [n.id for n in g.nodes] == ["ok"]
    g.splice(after={"ok": [good]})  # nothing of the rejected splice was left behind
    assert [n.id for n in g.nodes] == ["ok", "good"]


def test_parsing_a_golden_file_with_a_schema_violation_names_the_line():
    text = print_graph(_graph())
    lines = text.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith("node L00.mlp_norm "))
    lines[i] = lines[i].replace(" eps=1e-06", "")
    with pytest.raises(ParseError, match=rf"g.graph:{i + 1}: node L00.mlp_norm: op rms_norm lacks attribute\(s\) eps"):
        parse_graph("\n".join(lines) + "\n", "g.graph")
