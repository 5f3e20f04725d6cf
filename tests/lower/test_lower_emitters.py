"""Emitters: one node in, the exact line(s) out; operands by role, numbers from node attributes."""

import pytest

from graphgen.ir.graph import Graph, Node
from graphgen.lower import cpu, npu
from graphgen.lower.render import LoweringError, Names

KV = {"components": ("k", "v"), "widths": (32, 32), "block_size": 16, "kv_dtype": "bfloat16"}


def _graph():
    g = Graph(name="t.g", streams=["main", "kv_save", "host"])
    for name in ("slot_mapping", "block_tables", "seq_lens", "query_lens", "save_block_ids", "input_ids"):
        g.declare(name, "input")
    for name in ("q.L00", "k.L00", "v.L00", "o.L00", "x", "c_kv", "k_pe", "q_nope", "q_pe", "cos", "sin"):
        g.declare(name, "value")
    for i in range(3):
        g.declare(f"kv_cache.L0{i}", "kv_cache")
        g.declare(f"pool_staging.L0{i}", "pool_staging")
    return g


def _cpu(g, n):
    g.add(n)
    return cpu.emit(n, cpu.CpuCtx(Names(g)))


def _npu(g, n, mode="max-autotune"):
    g.add(n)
    comps = {m.output("cache"): m.attrs["components"] for m in g.nodes if m.op == "kv_write"}
    return npu.emit(n, npu.NpuCtx(Names(g), mode, g.events, comps))


def _kv_write(layer=0):
    return Node(f"L0{layer}.kv_write", "kv_write", "main", reads=("k.L00", "v.L00", "slot_mapping"),
                writes=(f"kv_cache.L0{layer}",), attrs=KV)


def _attn(mode="prefill"):
    return Node("L00.attn", "paged_attention", "main",
                reads=("q.L00", "kv_cache.L01", "block_tables", "seq_lens", "query_lens"), writes=("o.L00",),
                attrs={"mode": mode, "scale": 0.125, "num_heads": 8, "num_kv_heads": 2, "head_dim": 16, **KV})


def _mla_prolog(w_q_a):
    return Node("L00.mla_prolog", "mla_prolog", "main", reads=("x", "cos", "sin"),
                writes=("q_nope", "q_pe", "c_kv", "k_pe"),
                attrs={"w_q_a": w_q_a, "w_q_a_norm": w_q_a and "qn", "w_q_b": "qb", "w_kv_a": "kva",
                       "w_kv_a_norm": "kvn", "num_heads": 4, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                       "kv_lora_rank": 32, "eps": 1e-06, "interleave": True})


def test_cpu_kv_write_binds_parts_cache_and_slots_by_role():
    assert _cpu(_graph(), _kv_write(2)) == ["rt.kv_write(kv[2], (k_L00, v_L00), b.slot_mapping)"]


def test_cpu_attention_reads_the_cache_role_not_a_position():
    # the cache is layer 1's although the node id says L00: the emitter follows the operand
    assert _cpu(_graph(), _attn()) == [
        "o_L00 = rt.paged_attention(q_L00, kv[1], b.block_tables, b.seq_lens, b.query_lens, scale=0.125)"]


def test_cpu_kv_save_one_layer_and_bulk():
    g = _graph()
    one = Node("L01.kv_save", "kv_save", "kv_save", reads=("kv_cache.L01", "save_block_ids"),
               writes=("pool_staging.L01",))
    assert _cpu(g, one) == ["rt.kv_save(kv[1], b.save_block_ids, staging[1])"]
    bulk = Node("save.kv_save", "kv_save", "main", reads=("kv_cache.L00", "kv_cache.L01", "kv_cache.L02",
                "save_block_ids"), writes=("pool_staging.L00", "pool_staging.L01", "pool_staging.L02"))
    assert _cpu(g, bulk) == ["rt.kv_save_layers(kv, range(3), b.save_block_ids, staging)"]


def test_cpu_mla_prolog_without_q_lora_passes_none_weights():
    line, = _cpu(_graph(), _mla_prolog(None))
    assert line.startswith("q_nope, q_pe, c_kv, k_pe = rt.mla_prolog(x, None, None, W['qb'], W['kva'], W['kvn'], cos, sin,")
    line, = _cpu(_graph(), _mla_prolog("qa"))
    assert "rt.mla_prolog(x, W['qa'], W['qn'], W['qb']," in line


def test_npu_kv_write_one_scatter_per_component():
    assert _npu(_graph(), _kv_write(0)) == [
        "torch_npu.npu_scatter_nd_update_(kv[0][0], b.kv_index, k_L00.reshape(k_L00.shape[0], -1))",
        "torch_npu.npu_scatter_nd_update_(kv[0][1], b.kv_index, v_L00.reshape(v_L00.shape[0], -1))"]


def test_npu_attention_takes_heads_and_block_size_from_the_node():
    line, = _npu(_graph(), _attn("decode"))
    # decode: the static graph's v2 BSH attention (npu_helpers._gqa_decode_attention), heads and
    # block size from the node, head_dim from the node's dims
    assert line == ("o_L00 = _gqa_decode_attention(q_L00, kv[1], b.block_tables, b.actual_seq_lengths_kv, "
                    "num_heads=8, num_kv_heads=2, head_dim=16, scale=0.125, block_size=16)")
    with pytest.raises(LoweringError, match="unknown attention mode 'chunked'"):
        _npu(_graph(), _attn("chunked"))


def test_npu_kv_save_copies_as_many_components_as_the_write_fills():
    g = _graph()
    _npu(g, _kv_write(1))
    save = Node("L01.kv_save", "kv_save", "kv_save", reads=("kv_cache.L01", "save_block_ids"),
                writes=("pool_staging.L01",))
    assert _npu(g, save) == [
        "torch_npu.npu_scatter_nd_update_(staging[1][0], b.save_rows, kv[1][0].index_select(0, b.save_block_ids))",
        "torch_npu.npu_scatter_nd_update_(staging[1][1], b.save_rows, kv[1][1].index_select(0, b.save_block_ids))"]


def test_npu_events_per_compile_mode_and_host_event_as_comment():
    g = _graph()
    g.events = {"ev.L00.kv_write": ("main", "kv_save"), "ev.L01.kv_save": ("kv_save", "host")}
    rec = Node("L00.kv_write.record", "record", "main", attrs={"event": "ev.L00.kv_write"})
    assert _npu(g, rec) == ["ev_L00_kv_write = torchair.ops.record()"]
    wait = Node("L00.kv_save.wait", "wait", "kv_save", attrs={"event": "ev.L00.kv_write"})
    assert _npu(g, wait, "reduce-overhead") == ["torchair.ops.npu_tagged_event_wait(ev_L00_kv_write)"]
    host = Node("L01.kv_save.record", "record", "kv_save", attrs={"event": "ev.L01.kv_save"})
    assert _npu(g, host)[0].startswith("# ev.L01.kv_save (kv_save -> host):")  # a comment: the runner commits


def test_unknown_op_and_unknown_mode_are_clear_errors():
    n = Node("p", "pool_put", "host", reads=("pool_staging.L00",))
    g = _graph()
    g.add(n)
    with pytest.raises(LoweringError, match="no NPU lowering for op 'pool_put' \\(node p\\)"):
        npu.emit(n, npu.NpuCtx(Names(g), "max-autotune", {}, {}))
    with pytest.raises(LoweringError, match="compile mode 'fast'"):
        npu.NpuOptions(mode="fast")


def test_every_device_op_has_an_emitter_and_the_host_commit_none():
    """pool_put (the host stream's commit) stays in the IR for the race verifier but is lowered on
    neither target: the engine commits after HOST_EVENT (CPU) or through the commit path (NPU, graphgen.npu.run.staging)."""
    from graphgen.ir.ops import OPS
    assert set(cpu.EMIT) | {"pool_put"} == set(OPS) and "pool_put" not in cpu.EMIT
    assert set(npu.EMIT) | {"pool_put"} == set(OPS) and "pool_put" not in npu.EMIT
