"""Sequence parallel (``parallel.sp``), DP attention + EP (``parallel.dp``) and context parallel
(``parallel.cp``) on the build path: the
goldens verify, deleting any collective or moving one fails verification, a token shard or partial
sum read before its collective is caught, and the full-size DeepSeek-V3.1 DP/EP layout fits 64 GiB
per device in ``graphgen validate`` where pure DP attention at ep=32 does not. Torch-free."""

from __future__ import annotations

import re

import pytest

from graphgen.ir.text import parse_graph, print_graph
from graphgen.modelspec.loader import load_spec
from graphgen.passes.manager import run_pipeline
from graphgen.passes.verify import check
from graphgen.passes.verify_parallel import expected_collectives
from support.cli import cli_inproc as run_cli
from support.paths import REPO

SP = sorted((REPO / "generated/tiny_qwen3_tp2_sp").glob("*.graph"))
DP = sorted((REPO / "generated/tiny_deepseek_v3_dp2ep2").glob("*.graph"))
CP = sorted((REPO / "generated").glob("tiny_*_cp2/*.graph"))
CPSP = sorted((REPO / "generated/tiny_deepseek_v3_cp_sp").glob("*.graph"))   # the seed's CP/SP: cp 2 x tp 2, sp
COLL_LINE = re.compile(r"^node \S+ \S+ (all_reduce|all_gather|reduce_scatter) ")


def _collective_mutants():
    for p in SP + DP + CP + CPSP:
        for i, line in enumerate(p.read_text().splitlines(keepends=True)):
            if COLL_LINE.match(line):
                yield pytest.param(p, i, id=f"{p.parent.name}/{p.name}:{i + 1}")


def test_goldens_verify_and_have_the_layouts_collectives():
    assert len(SP) == 5 and len(DP) == 5 and len(CP) == 10 and len(CPSP) == 5
    for p in SP + DP + CP + CPSP:
        g = parse_graph(p.read_text(), str(p))
        assert check(g) == [], p
        ops = [(n.op, n.attrs.get("group")) for n in g.nodes if COLL_LINE.match(f"node x y {n.op} ")]
        assert ops == expected_collectives(g) and (ops or g.meta["phase"] == "decode" and "cp" in g.meta), p
    sp = parse_graph(SP[0].read_text())
    # two reduce-scatters and two all-gathers per layer, none left as an all_reduce
    assert sum(n.op == "reduce_scatter" for n in sp.nodes) == 1 + 2 * 2
    assert not [n for n in sp.nodes if n.op == "all_reduce"]
    dp = parse_graph(DP[0].read_text())
    groups = {(n.op, n.attrs["group"], n.attrs["size"]) for n in dp.nodes if n.op in ("all_gather", "reduce_scatter")}
    assert groups == {("all_gather", "dp", 2), ("reduce_scatter", "ep", 2)}  # tp 1: attention stays whole


@pytest.mark.parametrize("path,index", list(_collective_mutants()))
def test_deleting_any_collective_line_fails_verification(path, index):
    lines = path.read_text().splitlines(keepends=True)
    deleted = lines.pop(index)
    problems = check(parse_graph("".join(lines), str(path)))
    assert problems, f"deleting {deleted!r} went unnoticed"
    assert any(p.startswith("collectives:") and "expected" in p for p in problems), problems


def test_swapping_two_collectives_breaks_the_order():
    p = SP[0]
    lines = p.read_text().splitlines(keepends=True)
    idx = [i for i, line in enumerate(lines) if COLL_LINE.match(line)]
    a, b = idx[1], idx[2]  # an all_gather and the reduce_scatter after it: same counts, other order
    assert lines[a].split()[3] != lines[b].split()[3]
    lines[a], lines[b] = lines[b], lines[a]
    problems = check(parse_graph("".join(lines), str(p)))
    assert any("first difference at #2" in x for x in problems), problems


def test_a_token_shard_read_before_its_all_gather_is_rejected():
    p = REPO / "generated/tiny_qwen3_tp2_sp/decode.graph"
    text = p.read_text()
    assert "reads=x.L00.mlp_norm.all writes=h.L00.partial" in text
    bypass = text.replace("reads=x.L00.mlp_norm.all writes=h.L00.partial", "reads=x.L00.mlp_norm writes=h.L00.partial")
    problems = check(parse_graph(bypass, str(p)))
    assert any("L00.mlp (swiglu_mlp) reads the token shard x.L00.mlp_norm before its all_gather" in x
               for x in problems), problems
    mixed = text.replace("reads=h.L00.attn.sum,h.embed", "reads=h.L00.attn.sum,x.L00.attn_norm.all")
    assert any("adds the token shard h.L00.attn.sum to the whole x.L00.attn_norm.all" in x
               for x in check(parse_graph(mixed, str(p))))


def test_a_partial_sum_read_before_its_reduce_scatter_is_rejected():
    p = REPO / "generated/tiny_deepseek_v3_dp2ep2/decode.graph"
    text = p.read_text().replace("reads=h.L01.sum,h.L01.attn", "reads=h.L01.partial,h.L01.attn")
    problems = check(parse_graph(text, str(p)))
    assert any("partial result h.L01.partial of L01.moe is read by L01.moe.residual" in x for x in problems), problems


def test_a_collective_on_the_save_stream_or_in_a_wrong_group_is_rejected():
    p = REPO / "generated/tiny_qwen3_tp2_sp/splitfuse.graph"
    text = p.read_text()
    save = text.replace("node L00.mlp.reduce_scatter main", "node L00.mlp.reduce_scatter kv_save")
    assert any("L00.mlp.reduce_scatter is on stream kv_save" in x for x in check(parse_graph(save, str(p))))
    q = REPO / "generated/tiny_deepseek_v3_dp2ep2/decode.graph"
    wrong = q.read_text().replace("dim=0 group=ep reduce=sum size=2", "dim=0 group=dp reduce=sum size=2", 1)
    assert any("collectives:" in x and "expected reduce_scatter ep, got reduce_scatter dp" in x
               for x in check(parse_graph(wrong, str(q))))


def test_sp_off_leaves_the_tp_graph_unchanged():
    sp = load_spec(REPO / "specs/tiny_qwen3_tp2_sp.yaml")
    tp = load_spec(REPO / "specs/tiny_qwen3_tp2.yaml")
    a = run_pipeline(sp.with_overrides(sp=False), "splitfuse")
    b = run_pipeline(tp, "splitfuse")
    assert [(n.id, n.op, n.reads, n.writes) for n in a.nodes] == [(n.id, n.op, n.reads, n.writes) for n in b.nodes]


@pytest.mark.slow  # the full-size DeepSeek-V3.1 layouts through the passes, ~7 s
def test_dp_ep_layout_fits_64_gib_and_pure_dp_attention_does_not(tmp_path):
    """The shipped DP layout (8 groups of tp 4) fits a 64 GiB die as validate counts a launch (docs/npu.md,
    "Full-size launch"); 16 groups of tp 2 do not (their weights alone are 52.9 GiB) and pure DP attention
    (tp 1) does not: validate exits 2 naming the DP layout that fits."""
    spec = load_spec(REPO / "specs/deepseek_v3_1_dp_ep.yaml")
    par = spec.parallel
    assert (par.dp, par.tp, par.ep, par.world) == (8, 4, 32, 32)
    assert spec.dims.num_attention_heads // par.tp in (8, 16, 32, 64, 128)  # the FIA head set, unpadded
    assert load_spec(REPO / "specs/deepseek_v3_1.yaml").parallel.tp == 32  # the NPU issue's layout stays
    text = (REPO / "specs/deepseek_v3_1_dp_ep.yaml").read_text()
    pure, narrow = tmp_path / "pure_dp.yaml", tmp_path / "dp16.yaml"
    pure.write_text(text.replace("  tp: 4\n  dp: 8\n", "  tp: 1\n  dp: 32\n").replace("name: deepseek_v3_1_dp_ep", "name: p"))
    narrow.write_text(text.replace("  tp: 4\n  dp: 8\n", "  tp: 2\n  dp: 16\n").replace("name: deepseek_v3_1_dp_ep",
                                                                                          "name: q"))
    r = run_cli("validate", "--device-memory-gib", "64", "specs/deepseek_v3_1_dp_ep.yaml", str(pure), str(narrow),
                timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert ("deepseek_v3_1_dp_ep.yaml: ok" in r.stdout and "per rank (tp=4, ep=32, dp=8): 53.76 GiB of 54.87 GiB = "
            "weights 46.63 GiB + KV 2.14 GiB" in r.stdout), r.stdout
    assert "pure_dp.yaml: error: per rank 79.76 GiB (weights 65.54 GiB + KV 2.14 GiB" in r.stderr, r.stderr
    assert "dp16.yaml: error: per rank 62.68 GiB (weights 52.93 GiB + KV 2.14 GiB" in r.stderr, r.stderr
    assert r.stderr.count("fix: set parallel tp: 4, ep: 32, dp: 8") == 2, r.stderr


def test_context_parallel_gathers_every_prefill_kv_part_and_saves_once():
    for p in CP:
        g = parse_graph(p.read_text(), str(p))
        gathers = [n for n in g.nodes if n.op == "all_gather" and n.attrs["group"] == "cp"]
        writes = [n for n in g.nodes if n.op == "kv_write"]
        if g.meta["phase"] == "decode":  # KV replicated: decode is the single-rank graph
            assert not gathers, p
            continue
        assert len(gathers) == sum(len(w.input("parts")) for w in writes), p  # chunked prefill included
        saves = [n for n in g.nodes if n.op in ("kv_save", "pool_put")]
        assert saves and all(n.attrs.get("writers") == "cp0" for n in saves), p
    p = REPO / "generated/tiny_qwen3_cp2/splitfuse.graph"
    text = p.read_text()
    local = text.replace("reads=k.L00.cp,v.L00.cp,slot_mapping", "reads=k.L00,v.L00.cp,slot_mapping")
    assert any("L00.kv_write writes k.L00, this CP rank's tokens only" in x for x in check(parse_graph(local, str(p))))
    every = text.replace(" writers=cp0", "")
    assert any("save.kv_save (kv_save) has writers=None, expected 'cp0'" in x
               for x in check(parse_graph(every, str(p))))


def test_cp_with_sp_splits_the_cp_share_over_the_tp_group_and_gathers_the_kv_over_cp():
    """The seed's CP/SP (tiny_deepseek_v3_cp_sp): every prefill layer is sequence parallel inside the TP group
    (no all_reduce: reduce-scatters, the norms on the shard, all-gathers over tp) and its KV parts, computed
    from the TP-gathered norm (the CP rank's whole share), all-gathered over cp before the cache write; the
    decode graph is the tp-with-sp one (KV replicated over cp); the saves are CP rank 0's."""
    for p in CPSP:
        g = parse_graph(p.read_text(), str(p))
        assert (g.meta["tp"], g.meta["cp"], g.meta["sp"]) == (2, 2, True), p
        assert not [n for n in g.nodes if n.op == "all_reduce"], p
        order = [(n.op, n.attrs.get("group")) for n in g.nodes if n.op in ("all_gather", "reduce_scatter", "kv_write")]
        layer0 = order[:order.index(("kv_write", None)) + 1]
        if g.meta["phase"] == "decode":
            assert layer0 == [("reduce_scatter", "tp"), ("all_gather", "tp"), ("kv_write", None)], p
            continue
        # embedding reduce-scattered, norm gathered over tp, then the MLA latent and RoPE key over cp
        assert layer0 == [("reduce_scatter", "tp"), ("all_gather", "tp"), ("all_gather", "cp"), ("all_gather", "cp"),
                          ("kv_write", None)], p
        saves = [n for n in g.nodes if n.op in ("kv_save", "pool_put")]
        assert saves and all(n.attrs.get("writers") == "cp0" for n in saves), p
    text = (REPO / "generated/tiny_deepseek_v3_cp_sp/mempool_prefill.graph").read_text()
    # the KV gathered over tp instead of cp: a wrong group for the layout's collective order
    wrong = text.replace("writes=c_kv.L00.cp dim=0 group=cp length=null size=2",
                         "writes=c_kv.L00.cp dim=0 group=tp length=null size=2")
    assert wrong != text
    assert any("collectives:" in x and "expected all_gather cp, got all_gather tp" in x
               for x in check(parse_graph(wrong, "mutant")))


def test_sp_under_dp_keeps_the_moe_reduce_scatter_shard():
    """sp inside DP groups (dp 2 × tp 2, ep 4): the MoE's ep reduce-scatter is the TP shard, so no TP all-gather
    follows it and the residual add takes it; a TP gather put back there (the tp-without-sp MoE) is caught."""
    spec = load_spec(REPO / "specs/tiny_deepseek_v3_dp2ep2.yaml").with_overrides(tp=2, ep=4, sp=True)
    g = run_pipeline(spec, "mempool_prefill")
    assert check(g) == [] and not [n for n in g.nodes if n.op == "all_reduce"]
    moe = [(n.op, n.attrs.get("group")) for n in g.nodes if n.layer == 1 and n.op in ("all_gather", "reduce_scatter")]
    assert moe == [("all_gather", "tp"), ("reduce_scatter", "tp"), ("all_gather", "tp"), ("all_gather", "dp"),
                   ("reduce_scatter", "ep")]
    res = next(n for n in g.nodes if n.id == "L01.moe.residual")
    assert res.reads[0] == "h.L01.tp_tokens"   # the ep reduce-scatter's shard
    no_sp = run_pipeline(spec.with_overrides(sp=False), "mempool_prefill")
    assert "L01.moe.tp_gather" in {n.id for n in no_sp.nodes} and "L01.moe.tp_gather" not in {n.id for n in g.nodes}
    text = print_graph(g)
    line = next(x for x in text.splitlines(keepends=True) if x.startswith("node L01.moe.residual "))
    gather = ("node L01.moe.tp_gather main all_gather layer=1 reads=h.L01.tp_tokens writes=h.L01.sum dim=0 group=tp "
              "length=null size=2\n")
    mutant = text.replace(line, gather + line.replace("reads=h.L01.tp_tokens,", "reads=h.L01.sum,"))
    problems = check(parse_graph(mutant, "mutant"))
    assert any("collectives:" in x and "expected reduce_scatter tp, got all_gather tp" in x for x in problems) and \
        any("adds the token shard h.L01.attn to the whole h.L01.sum" in x for x in problems), problems


@pytest.mark.parametrize("name,overrides", [
    ("tiny_qwen3_tp2_sp", {}), ("tiny_deepseek_v3_tp2ep2", {"sp": True}), ("tiny_deepseek_v3_dp2ep2", {}),
    ("tiny_qwen3_cp2", {}), ("tiny_deepseek_v3_cp2", {}), ("tiny_qwen3", {"tp": 2, "cp": 2}),
    ("tiny_deepseek_v3_cp_sp", {}), ("tiny_qwen3", {"tp": 2, "cp": 2, "sp": True}),
    ("tiny_deepseek_v3_dp2ep2", {"tp": 2, "ep": 4, "sp": True}),
])
def test_contracts_hold_at_the_new_layouts(name, overrides):
    """Checked mode (every pass's requires/ensures) for every variant under sync and async writes; DeepSeek
    with sp (MoE at ep = tp: its partial sum reduce-scattered too) and cp inside a TP group (tp=2, cp=2)."""
    base = load_spec(REPO / "specs" / f"{name}.yaml").with_overrides(**overrides)
    for write in ("sync", "async"):
        spec = base.with_overrides(write=write)
        for variant in spec.variants:
            g = run_pipeline(spec, variant, check=True)
            no_collective = g.meta["phase"] == "decode" and g.meta.get("cp", 1) > 1 and g.meta.get("tp", 1) == 1
            assert check(g) == [] and bool(expected_collectives(g)) != no_collective, (name, variant)
