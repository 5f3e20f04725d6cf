"""The pass pipeline: builder + passes, each pass's executable contract run in checked mode."""

import dataclasses

import pytest

from ir_util import REPO
from graphgen.families.build import build_graph
from graphgen.passes.base import ContractError, PassError
from graphgen.passes.insert_events import InsertEvents
from graphgen.passes.insert_kv_save import InsertKvSave
from graphgen.passes.manager import PASS_NAMES, PIPELINE, run_pipeline
from graphgen.modelspec.loader import load_spec

SPECS = ["tiny_qwen3", "tiny_deepseek_v3"]


@pytest.mark.parametrize("name", SPECS)
def test_contracts_hold_for_every_variant_write_and_granularity(name):
    """Checked mode runs every requires/ensures; any violation raises PassError."""
    base = load_spec(REPO / "specs" / f"{name}.yaml")
    for write in ("sync", "async", "off"):
        for gran in ("layer", "forward"):
            spec = base.with_overrides(write=write, granularity=gran)
            for variant in spec.variants:
                seen = []
                run_pipeline(spec, variant, check=True, on_pass=lambda n, g: seen.append(n))
                assert seen == list(PASS_NAMES) == ["build", "insert_lora", "shard", "sequence_parallel", "context_parallel",
                                                    "insert_kv_load", "insert_kv_save", "insert_events", "verify"]


def _ctx(spec, variant):
    from graphgen.passes.base import PassContext
    return PassContext(spec=spec, variant_name=variant)


def test_insert_kv_save_requires_the_built_forward():
    spec = load_spec(REPO / "specs" / "tiny_qwen3.yaml")
    g = build_graph(spec, "mempool_prefill_layer")
    assert InsertKvSave().requires(g, _ctx(spec, "mempool_prefill_layer")) == []
    g.nodes = [n for n in g.nodes if n.id != "L01.kv_write"]  # a builder that forgot one layer's KV write
    problems = InsertKvSave().requires(g, _ctx(spec, "mempool_prefill_layer"))
    assert "layer L01 has no L01.kv_write writing kv_cache.L01" in problems


def test_insert_kv_save_ensures_catches_a_misplaced_save(monkeypatch):
    spec = load_spec(REPO / "specs" / "tiny_qwen3.yaml")
    real_run = InsertKvSave.run

    def late_save(self, graph, ctx):  # the save issued one node later than promised
        real_run(self, graph, ctx)
        i = next(i for i, n in enumerate(graph.nodes) if n.id == "L00.kv_save")
        graph.nodes[i], graph.nodes[i + 1] = graph.nodes[i + 1], graph.nodes[i]

    monkeypatch.setattr(InsertKvSave, "run", late_save)
    with pytest.raises(PassError) as info:
        run_pipeline(spec, "mempool_prefill_layer")
    assert isinstance(info.value.cause, ContractError) and info.value.cause.which == "ensures"
    assert "L00.kv_save is not issued right after L00.kv_write" in str(info.value)
    run_pipeline(spec, "mempool_prefill_layer", check=False)  # unchecked: nobody looks


def test_insert_events_ensures_catches_a_missing_wait(monkeypatch):
    spec = load_spec(REPO / "specs" / "tiny_qwen3.yaml")
    real_run = InsertEvents.run

    def drop_a_wait(self, graph, ctx):
        real_run(self, graph, ctx)
        graph.nodes = [n for n in graph.nodes if n.id != "L01.kv_save.wait"]

    monkeypatch.setattr(InsertEvents, "run", drop_a_wait)
    with pytest.raises(PassError, match="pass 'insert_events' failed .*\n.*ensures violated") as info:
        run_pipeline(spec, "mempool_prefill_layer")
    assert "race on kv_cache.L01" in str(info.value)


def test_insert_events_requires_no_events_yet():
    spec = load_spec(REPO / "specs" / "tiny_qwen3.yaml")
    g = run_pipeline(spec, "mempool_prefill_layer")
    problems = InsertEvents().requires(g, _ctx(spec, "mempool_prefill_layer"))
    assert any("exists before events are inserted" in p for p in problems)
    assert any(p.startswith("events declared before") for p in problems)


def test_failing_pass_is_named_with_the_passes_before_it(monkeypatch):
    spec = load_spec(REPO / "specs" / "tiny_qwen3.yaml")

    def boom(self, graph, ctx):
        raise ValueError("synthetic failure")

    monkeypatch.setattr(type(PIPELINE[6]), "run", boom)  # insert_events (after insert_lora ... insert_kv_save)
    with pytest.raises(PassError) as info:
        run_pipeline(spec, "mempool_prefill")
    msg = str(info.value)
    assert ("pass 'insert_events' failed (passes run before it: build, insert_lora, shard, sequence_parallel, context_parallel, "
            "insert_kv_load, insert_kv_save)") in msg
    assert "synthetic failure" in msg


def test_builder_is_not_a_pass_and_keeps_its_old_name_for_dump():
    spec = load_spec(REPO / "specs" / "tiny_qwen3.yaml")
    assert all(p.name != "build" for p in PIPELINE)
    for name in ("build", "build_layers"):
        g = run_pipeline(spec, "mempool_prefill", until=name)
        assert {n.stream for n in g.nodes} == {"main"} and "saves" not in g.meta


def test_build_graph_matches_the_pipelines_first_stage():
    spec = load_spec(REPO / "specs" / "tiny_deepseek_v3.yaml")
    a = build_graph(spec, "decode", "x.yaml")
    b = run_pipeline(spec, "decode", spec_file="x.yaml", until="build")
    assert [dataclasses.astuple(n) for n in a.nodes] == [dataclasses.astuple(n) for n in b.nodes]
    assert a.meta == b.meta


def test_dump_after_unknown_pass_is_rejected():
    spec = load_spec(REPO / "specs" / "tiny_qwen3.yaml")
    with pytest.raises(ValueError, match="unknown pass"):
        run_pipeline(spec, "decode", until="nope")
