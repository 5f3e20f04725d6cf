"""The pass pipeline: each pass keeps its contract, verified after every pass."""

import pytest

from ir_util import REPO
from graphgen.passes.base import Pass, PassError
from graphgen.passes.manager import PASS_NAMES, PIPELINE, run_pipeline
from graphgen.passes.verify import check
from graphgen.modelspec.loader import load_spec

SPECS = ["tiny_qwen3", "tiny_deepseek_v3"]


def _after_each(spec, variant):
    seen = {}
    run_pipeline(spec, variant, on_pass=lambda name, g: seen.__setitem__(name, (g.copy(), check(g))))
    return seen


@pytest.mark.parametrize("name", SPECS)
def test_contracts_hold_after_every_pass(name):
    spec = load_spec(REPO / "specs" / f"{name}.yaml")
    for variant in spec.variants:
        seen = _after_each(spec, variant)
        assert list(seen) == list(PASS_NAMES)
        built, problems = seen["build_layers"]
        # build_layers: everything on main, one KV write per layer, nothing to race with.
        assert problems == [] and {n.stream for n in built.nodes} == {"main"}
        assert sum(n.op == "kv_write" for n in built.nodes) == spec.dims.num_hidden_layers
        saved, problems = seen["insert_kv_save"]
        # insert_kv_save adds no events: a saving async graph is racy now, and only racy.
        assert not any(n.op in ("record", "wait") for n in saved.nodes)
        if saved.meta["saves"] and saved.meta["write"] == "async":
            assert problems and all(p.startswith("race on") for p in problems)
        else:
            # sync save runs on main: only the host commit races with it.
            assert all(p.startswith("race on pool_staging") for p in problems)
        final, problems = seen["verify"]
        assert problems == []


def test_failing_pass_is_named_with_the_passes_before_it(monkeypatch):
    spec = load_spec(REPO / "specs" / "tiny_qwen3.yaml")

    def boom(self, graph, ctx):
        raise ValueError("synthetic failure")

    monkeypatch.setattr(type(PIPELINE[2]), "run", boom)
    with pytest.raises(PassError) as info:
        run_pipeline(spec, "mempool_prefill")
    msg = str(info.value)
    assert "pass 'insert_events' failed (passes run before it: build_layers, insert_kv_save)" in msg
    assert "synthetic failure" in msg


def test_every_pass_documents_its_contract():
    for p in PIPELINE:
        doc = __import__(type(p).__module__, fromlist=["x"]).__doc__
        assert "requires:" in doc and "ensures:" in doc, type(p).__module__


def test_dump_after_unknown_pass_is_rejected():
    spec = load_spec(REPO / "specs" / "tiny_qwen3.yaml")
    with pytest.raises(ValueError, match="unknown pass"):
        run_pipeline(spec, "decode", until="nope")
