"""Per-pass tests in the FileCheck style: a 2-layer model in, the exact save and record/wait lines out.

The input is ``tiny_qwen3`` (2 layers) built and taken up to the pass under test; the output is the
canonical text (``graphgen dump``). ``CHECK`` lines must appear in order; ``CHECK-NEXT`` lines right
after the previous match (so a record sits right after its producer, a wait right before its
consumer). Separately, the set of save/record/wait/pool_put lines must be exactly the checked ones:
nothing extra may appear. The expected lines were written from the design (docs/design.md), one
event per stream boundary.
"""


import pytest

from graphgen.ir.text import print_graph
from graphgen.modelspec.loader import load_spec
from graphgen.passes.manager import run_pipeline
from support.paths import REPO

WATCHED = ("record", "wait", "kv_save", "kv_load", "pool_put")


def filecheck(text: str, script: str) -> None:
    """A minimal FileCheck over line prefixes (``CHECK: prefix`` / ``CHECK-NEXT: prefix``)."""
    lines = text.splitlines()
    at = 0
    checked = []
    for raw in script.strip().splitlines():
        kind, _, want = raw.strip().partition(": ")
        if kind == "CHECK-NEXT":
            assert at < len(lines) and lines[at].startswith(want), \
                f"CHECK-NEXT: {want!r}\n  got: {lines[at] if at < len(lines) else '<end>'!r}"
            at += 1
        elif kind == "CHECK":
            hit = next((i for i in range(at, len(lines)) if lines[i].startswith(want)), None)
            assert hit is not None, f"CHECK: {want!r} not found after line {at}"
            at = hit + 1
        else:
            raise ValueError(f"bad check line {raw!r}")
        checked.append(lines[at - 1])
    watched = [ln for ln in lines if ln.startswith("node ") and ln.split()[3] in WATCHED]
    assert [ln for ln in watched] == [ln for ln in checked if ln in watched], "unchecked save/event lines"


def _dump(write: str, gran: str, until: str, variant: str = "mempool_prefill") -> str:
    spec = load_spec(REPO / "specs" / "tiny_qwen3.yaml").with_overrides(write=write, granularity=gran)
    assert spec.dims.num_hidden_layers == 2
    return print_graph(run_pipeline(spec, variant, until=until))


SAVE = {
    ("sync", "forward"): """
        CHECK: streams main host
        CHECK: node L01.kv_write main kv_write
        CHECK-NEXT: node save.kv_save main kv_save reads=kv_cache.L00,kv_cache.L01,save_block_ids writes=pool_staging.L00,pool_staging.L01
        CHECK: node host.pool_put host pool_put reads=pool_staging.L00,pool_staging.L01
    """,
    ("sync", "layer"): """
        CHECK: streams main host
        CHECK: node L00.kv_write main kv_write
        CHECK-NEXT: node L00.kv_save main kv_save layer=0 reads=kv_cache.L00,save_block_ids writes=pool_staging.L00
        CHECK: node L01.kv_write main kv_write
        CHECK-NEXT: node L01.kv_save main kv_save layer=1 reads=kv_cache.L01,save_block_ids writes=pool_staging.L01
        CHECK: node host.pool_put host pool_put reads=pool_staging.L00,pool_staging.L01
    """,
    ("async", "forward"): """
        CHECK: streams main kv_save host
        CHECK: node L01.kv_write main kv_write
        CHECK-NEXT: node save.kv_save kv_save kv_save reads=kv_cache.L00,kv_cache.L01,save_block_ids writes=pool_staging.L00,pool_staging.L01
        CHECK: node host.pool_put host pool_put reads=pool_staging.L00,pool_staging.L01
    """,
    ("async", "layer"): """
        CHECK: streams main kv_save host
        CHECK: node L00.kv_write main kv_write
        CHECK-NEXT: node L00.kv_save kv_save kv_save layer=0 reads=kv_cache.L00,save_block_ids writes=pool_staging.L00
        CHECK: node L01.kv_write main kv_write
        CHECK-NEXT: node L01.kv_save kv_save kv_save layer=1 reads=kv_cache.L01,save_block_ids writes=pool_staging.L01
        CHECK: node host.pool_put host pool_put reads=pool_staging.L00,pool_staging.L01
    """,
}

EVENTS = {
    # sync: the save is on main, program order covers it; only the host commit needs an event.
    ("sync", "forward"): """
        CHECK: event ev.save.kv_save main->host
        CHECK: node save.kv_save main kv_save
        CHECK-NEXT: node save.kv_save.record main record event=ev.save.kv_save
        CHECK: node host.pool_put.wait host wait event=ev.save.kv_save
        CHECK-NEXT: node host.pool_put host pool_put
    """,
    ("sync", "layer"): """
        CHECK: event ev.L01.kv_save main->host
        CHECK: node L00.kv_save main kv_save
        CHECK: node L01.kv_save main kv_save
        CHECK-NEXT: node L01.kv_save.record main record event=ev.L01.kv_save
        CHECK: node host.pool_put.wait host wait event=ev.L01.kv_save
        CHECK-NEXT: node host.pool_put host pool_put
    """,
    # async forward: one main->save event after the last KV write, one save->host event.
    ("async", "forward"): """
        CHECK: event ev.L01.kv_write main->kv_save
        CHECK-NEXT: event ev.save.kv_save kv_save->host
        CHECK: node L01.kv_write main kv_write
        CHECK-NEXT: node L01.kv_write.record main record event=ev.L01.kv_write
        CHECK: node save.kv_save.wait kv_save wait event=ev.L01.kv_write
        CHECK-NEXT: node save.kv_save kv_save kv_save
        CHECK-NEXT: node save.kv_save.record kv_save record event=ev.save.kv_save
        CHECK: node host.pool_put.wait host wait event=ev.save.kv_save
        CHECK-NEXT: node host.pool_put host pool_put
    """,
    # async layer: one main->save event per layer boundary, then save->host.
    ("async", "layer"): """
        CHECK: event ev.L00.kv_write main->kv_save
        CHECK-NEXT: event ev.L01.kv_write main->kv_save
        CHECK-NEXT: event ev.L01.kv_save kv_save->host
        CHECK: node L00.kv_write main kv_write
        CHECK-NEXT: node L00.kv_write.record main record event=ev.L00.kv_write
        CHECK-NEXT: node L00.kv_save.wait kv_save wait event=ev.L00.kv_write
        CHECK-NEXT: node L00.kv_save kv_save kv_save
        CHECK: node L01.kv_write main kv_write
        CHECK-NEXT: node L01.kv_write.record main record event=ev.L01.kv_write
        CHECK-NEXT: node L01.kv_save.wait kv_save wait event=ev.L01.kv_write
        CHECK-NEXT: node L01.kv_save kv_save kv_save
        CHECK-NEXT: node L01.kv_save.record kv_save record event=ev.L01.kv_save
        CHECK: node host.pool_put.wait host wait event=ev.L01.kv_save
        CHECK-NEXT: node host.pool_put host pool_put
    """,
}


@pytest.mark.parametrize("write,gran", sorted(SAVE))
def test_insert_kv_save(write, gran):
    filecheck(_dump(write, gran, "insert_kv_save"), SAVE[(write, gran)])


@pytest.mark.parametrize("write,gran", sorted(EVENTS))
def test_insert_events(write, gran):
    filecheck(_dump(write, gran, "insert_events"), EVENTS[(write, gran)])


def test_filecheck_itself_fails_on_a_missing_or_extra_line():
    text = _dump("async", "layer", "insert_events")
    with pytest.raises(AssertionError):  # the second layer's wait dropped from the expectation
        filecheck(text, EVENTS[("async", "layer")].replace(
            "CHECK-NEXT: node L01.kv_save.wait kv_save wait event=ev.L01.kv_write\n", ""))
    with pytest.raises(AssertionError):  # a record where none is
        filecheck(text.replace("node L00.attn main", "node L00.attn.record main record event=x\nnode L00.attn main"),
                  EVENTS[("async", "layer")])


def test_decode_saves_nothing_and_gets_no_events():
    spec = load_spec(REPO / "specs" / "tiny_qwen3.yaml")
    text = print_graph(run_pipeline(spec, "decode"))
    filecheck(text, "CHECK: streams main\nCHECK: node lm_head main lm_head")


# The load (history variant ``splitfuse``): every load at the start of the graph on kv_load, in layer
# order; then one load -> main event per load, waited right before the first main-stream access of
# that layer's cache (its KV write). The save of a loaded layer waits only for the KV write: that
# wait already orders it after the load (the transitive rule), so no load -> save event exists.
LOAD = {
    "layer": """
        CHECK: streams main kv_load
        CHECK: buffer pool_load.L00 pool_load
        CHECK-NEXT: buffer pool_load.L01 pool_load
        CHECK: node L00.kv_load kv_load kv_load layer=0 reads=pool_load.L00,load_block_ids writes=kv_cache.L00
        CHECK-NEXT: node L01.kv_load kv_load kv_load layer=1 reads=pool_load.L01,load_block_ids writes=kv_cache.L01
        CHECK-NEXT: node embed main embedding
    """,
    "forward": """
        CHECK: streams main kv_load
        CHECK: node load.kv_load kv_load kv_load reads=pool_load.L00,pool_load.L01,load_block_ids writes=kv_cache.L00,kv_cache.L01
        CHECK-NEXT: node embed main embedding
    """,
}

LOAD_EVENTS = {
    ("off", "layer"): """
        CHECK: event ev.L00.kv_load kv_load->main
        CHECK-NEXT: event ev.L01.kv_load kv_load->main
        CHECK: node L00.kv_load kv_load kv_load
        CHECK-NEXT: node L00.kv_load.record kv_load record event=ev.L00.kv_load
        CHECK-NEXT: node L01.kv_load kv_load kv_load
        CHECK-NEXT: node L01.kv_load.record kv_load record event=ev.L01.kv_load
        CHECK: node L00.kv_write.wait main wait event=ev.L00.kv_load
        CHECK-NEXT: node L00.kv_write main kv_write
        CHECK: node L01.kv_write.wait main wait event=ev.L01.kv_load
        CHECK-NEXT: node L01.kv_write main kv_write
    """,
    ("off", "forward"): """
        CHECK: event ev.load.kv_load kv_load->main
        CHECK: node load.kv_load kv_load kv_load
        CHECK-NEXT: node load.kv_load.record kv_load record event=ev.load.kv_load
        CHECK: node L00.kv_write.wait main wait event=ev.load.kv_load
        CHECK-NEXT: node L00.kv_write main kv_write
    """,
    ("async", "layer"): """
        CHECK: streams main kv_load kv_save host
        CHECK: node L00.kv_load kv_load kv_load
        CHECK-NEXT: node L00.kv_load.record kv_load record event=ev.L00.kv_load
        CHECK-NEXT: node L01.kv_load kv_load kv_load
        CHECK-NEXT: node L01.kv_load.record kv_load record event=ev.L01.kv_load
        CHECK: node L00.kv_write.wait main wait event=ev.L00.kv_load
        CHECK-NEXT: node L00.kv_write main kv_write
        CHECK-NEXT: node L00.kv_write.record main record event=ev.L00.kv_write
        CHECK-NEXT: node L00.kv_save.wait kv_save wait event=ev.L00.kv_write
        CHECK-NEXT: node L00.kv_save kv_save kv_save
        CHECK: node L01.kv_write.wait main wait event=ev.L01.kv_load
        CHECK-NEXT: node L01.kv_write main kv_write
        CHECK-NEXT: node L01.kv_write.record main record event=ev.L01.kv_write
        CHECK-NEXT: node L01.kv_save.wait kv_save wait event=ev.L01.kv_write
        CHECK-NEXT: node L01.kv_save kv_save kv_save
        CHECK-NEXT: node L01.kv_save.record kv_save record event=ev.L01.kv_save
        CHECK: node host.pool_put.wait host wait event=ev.L01.kv_save
        CHECK-NEXT: node host.pool_put host pool_put
    """,
    ("async", "forward"): """
        CHECK: node load.kv_load kv_load kv_load
        CHECK-NEXT: node load.kv_load.record kv_load record event=ev.load.kv_load
        CHECK: node L00.kv_write.wait main wait event=ev.load.kv_load
        CHECK-NEXT: node L00.kv_write main kv_write
        CHECK: node L01.kv_write main kv_write
        CHECK-NEXT: node L01.kv_write.record main record event=ev.L01.kv_write
        CHECK: node save.kv_save.wait kv_save wait event=ev.L01.kv_write
        CHECK-NEXT: node save.kv_save kv_save kv_save
        CHECK-NEXT: node save.kv_save.record kv_save record event=ev.save.kv_save
        CHECK: node host.pool_put.wait host wait event=ev.save.kv_save
        CHECK-NEXT: node host.pool_put host pool_put
    """,
}


@pytest.mark.parametrize("gran", sorted(LOAD))
def test_insert_kv_load(gran):
    filecheck(_dump("off", gran, "insert_kv_load", "splitfuse"), LOAD[gran])


@pytest.mark.parametrize("write,gran", sorted(LOAD_EVENTS))
def test_insert_events_with_load(write, gran):
    filecheck(_dump(write, gran, "insert_events", "splitfuse"), LOAD_EVENTS[(write, gran)])


def test_without_history_no_load():
    text = _dump("async", "layer", "insert_events")
    assert "kv_load" not in text and "pool_load" not in text


def test_each_load_event_is_needed():
    """Dropping any load record/wait pair from the output makes the verifier report a race on that
    layer's cache (so the events the pass inserts are all necessary)."""
    from graphgen.ir.text import parse_graph
    from graphgen.passes.verify import check

    text = _dump("async", "layer", "insert_events", "splitfuse")
    assert check(parse_graph(text)) == []
    for t in ("L00", "L01"):
        cut = "\n".join(ln for ln in text.splitlines()
                        if not ln.startswith((f"node {t}.kv_load.record ", f"node {t}.kv_write.wait ",
                                              f"event ev.{t}.kv_load "))) + "\n"
        problems = check(parse_graph(cut))
        assert any(p.startswith(f"race on kv_cache.{t}: {t}.kv_load (kv_load, write) and {t}.kv_write") for p in problems), problems
