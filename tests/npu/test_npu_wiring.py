"""WIRING CHECK ON CPU of the NPU lowering -- NOT an NPU result.

The generated NPU module runs on CPU through graphgen's stand-in (graphgen.npu.standin.fakes), whose
torch_npu kernels compute their *documented* semantics in plain torch (paged TND attention with
block_table / cumulative actual_seq_lengths / sparse_mode 0 and 3 / GQA / MLA rope parts, the RoPE
kernels, rms_norm, swiglu, scatter_nd_update).  The same step -- same token ids, positions, block
tables, slot mappings and sequence lengths, the same weights -- runs through the CPU target
(graphgen.runtime, exact vs Hugging Face), and we assert:

* the logits agree (float32, atol 1e-4);
* both KV caches hold the same values after the step (NPU [NB, BS, Hkv*D] viewed as CPU [NB, BS, Hkv, D]),
  including every slot the step did not write (the caches start as the same random noise, so a write
  to a wrong slot or a read of a wrong block shows up);
* saving variants: NPU staging equals the saved cache blocks and the CPU target's staging.

What this checks: the lowering's wiring (which tensor goes to which kernel argument, kv_index from
the slot mapping, block tables, cumulative vs per-sequence lengths, cache layouts, the sparse mode
per phase, the absorbed-MLA algebra) against our reading of the torch-npu 2.14.0 docs.  What it does
NOT check: the real kernels, hardware limits (float16/bfloat16 only, head_dim 64/128, block_size a
multiple of 16, ...), GE/aclgraph execution, streams, speed.  DeepSeek-V3's MoE kernels are left out
(their documented index conventions are ambiguous, see docs/npu.md): DeepSeek is compared on an
all-dense variant of tiny_deepseek_v3 (first_k_dense_replace = num_hidden_layers), i.e. MLA only.

Negative controls at the end show the comparison fails for a miswired block table / slot mapping.
"""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest

import torch

from graphgen.npu.standin import fakes as standin  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NUM_BLOCKS = 12
# The NPU module runs in bfloat16 end to end (weights, activations, KV), as on hardware; the CPU target
# runs the SAME weights (bf16 values, upcast) in float32 from the same (bf16-representable) caches, so
# it is the exact-arithmetic reference of the bf16 run.  Each bf16 op rounds to 8 mantissa bits (relative
# error <= 2^-9); ~10 ops per layer over 2 layers compound to ~1-2% of the logits' scale.  Logits are
# compared relative to their largest magnitude: LOGITS_RTOL; written KV (bf16-rounded activations) with
# KV_RTOL of the cache scale; unwritten KV slots must be bit-equal.  The negative controls below show
# miswiring moves the logits by far more than this.
LOGITS_RTOL = 0.03
KV_RTOL = 0.03
ATOL = 1e-4  # kept for the "logits carry signal" check
needs_standin = pytest.mark.skipif(standin.torch_npu_available(), reason="real torch_npu installed; stand-in not used")


@pytest.fixture(autouse=True)
def _tiny_specs_are_outside_the_kernel_limits():
    """The tiny specs these tests trace are float32 with block size 4 and head_dim 16: outside the
    kernels' documented limits by construction (tests/npu/test_limits.py proves the stand-in rejects
    them).  This file checks wiring, so it runs with the limits off."""
    with standin.enforce_limits(False):
        yield

# A step = sequences given as (block_table, history_len, new_tokens) + the blocks to save.  Tables are
# deliberately out of order and history ends mid-block, so an off-by-one block or offset shows.
STEPS = {
    # block size 128: lengths cross block boundaries so the block table's order matters
    "mempool_prefill": ([([5, 2, 9], 0, 140), ([7], 0, 3)], [2, 5, 7]),
    "splitfuse": ([([5, 2, 9], 130, 20), ([7, 3], 3, 2)], [9, 3]),
    "decode": ([([5, 2, 9], 260, 1), ([7, 3], 129, 1), ([1, 8], 4, 1)], []),
}
STEPS["mempool_prefill_layer"] = STEPS["mempool_prefill"]
STEPS["splitfuse_layer"] = STEPS["splitfuse"]


# ------------------------------------------------------------------------------------------ models
@functools.lru_cache(maxsize=None)
def _model(model: str):
    """(spec, rendered files) -- rendered in memory so the check follows the templates."""
    from graphgen.generate import spec_outputs
    from graphgen.modelspec.loader import load_spec

    base = "tiny_deepseek_v3_npu" if model.startswith("tiny_deepseek_v3_npu_dense") else model
    spec = load_spec(ROOT / "specs" / f"{base}.yaml")
    if model.startswith("tiny_deepseek_v3_npu_dense"):
        # MoE left out of the numeric comparison: every layer dense, MLA unchanged.  Renamed so its
        # reduce-overhead tagged-event tags differ from the real tiny_deepseek_v3 modules'.
        spec = dataclasses.replace(spec, name=model, dims=dataclasses.replace(
            spec.dims, first_k_dense_replace=spec.dims.num_hidden_layers, **MLA_HEAD_DIMS.get(model, {})))
    return spec, spec_outputs(spec, f"specs/{base}.yaml")


def _cpu_module(model, variant):
    from graphgen.runtime.core.cpu_runtime import load_module

    spec, files = _model(model)
    rel = f"{spec.name}/cpu/{variant}.py"
    return load_module(files[rel], f"<graphgen:{rel}>", f"graphgen_wiring.{spec.name}.cpu.{variant}")


def _npu_module(model, variant, mode, src_edit=None):
    from graphgen.npu.run.compile import load_module

    standin.install()
    spec, files = _model(model)
    rel = f"{spec.name}/npu/{mode}/{variant}.py"
    src = files[rel] if src_edit is None else src_edit(files[rel])
    with standin.fresh_tags():  # reduce-overhead modules create process-unique tagged events at import
        return load_module(ROOT / "generated" / rel, src)


# ------------------------------------------------------------------------------------------ inputs
def _host(spec, seqs, save_ids, seed):
    """Host quantities of one step (the engine's, design.md), shared by both targets."""
    g = torch.Generator().manual_seed(seed)
    bs = spec.kv_cache.block_size
    ids, pos, slots, qlens, slens = [], [], [], [], []
    width = max(len(t) for t, _, _ in seqs)
    for table, hist, q in seqs:
        assert hist + q <= len(table) * bs
        ids += torch.randint(0, spec.dims.vocab_size, (q,), generator=g).tolist()
        pos += list(range(hist, hist + q))
        slots += [table[p // bs] * bs + p % bs for p in range(hist, hist + q)]
        qlens.append(q)
        slens.append(hist + q)
    return dict(input_ids=ids, positions=pos, slot_mapping=slots,
                block_tables=[t + [0] * (width - len(t)) for t, _, _ in seqs], seq_lens=slens, query_lens=qlens,
                logits_indices=(torch.tensor(qlens).cumsum(0) - 1).tolist(), save_block_ids=save_ids,
                load_block_ids=_load_ids(seqs, bs))


def _load_ids(seqs, bs):
    """The full history blocks of each sequence, as the scheduler loads them from the pool."""
    return [b for table, hist, _ in seqs for b in table[:hist // bs]]


def _cpu_inputs(h):
    from graphgen.runtime.engine.runner import StepInputs

    return StepInputs(**{k: torch.tensor(v, dtype=torch.long) for k, v in h.items()})


def _npu_inputs(h, mod):
    from graphgen.npu.run.inputs import npu_step_inputs

    return npu_step_inputs(**{k: v for k, v in h.items() if k not in ("save_block_ids", "load_block_ids")},
                           block_size=mod.META["block_size"],
                           save_block_ids=h["save_block_ids"] if mod.META["saves"] else None,
                           load_block_ids=h["load_block_ids"] if mod.META["history"] else None,
                           decode=mod.META["phase"] == "decode")


def _run_cpu(mod, W, b, cache, loads=()):
    from graphgen.runtime.core.cpu_runtime import CpuRuntime
    from graphgen.runtime.core.streams import EventSet
    from graphgen.runtime.core.weights import load_time_weights
    from graphgen.runtime.engine.runner import StepRuntime

    staging = cache.make_staging(len(b.save_block_ids)) if mod.HOST_EVENT else None
    rt = CpuRuntime(event_timeout=30.0)
    step_rt = StepRuntime(rt)  # the runner's per-step view: it keeps what the module launched
    try:
        with torch.inference_mode():
            W = load_time_weights(W, [mod])  # the CPU module's layouts, as its runner builds them
            logits = mod.run(step_rt, W, b, cache, staging, loads, EventSet(mod.EVENTS).bind(1))
        for job in step_rt.launched.values():  # the save stream runs on a worker thread
            err = job.exception(30.0)
            if err is not None:
                raise err
    finally:
        rt.close()
    return logits, staging


def _to_npu_layout(cache, mod):
    """CPU cache [NB, BS, *rest] -> NPU per-layer tuples [NB, *KV_SHAPES[i]] (copies)."""
    dtype = getattr(torch, mod.KV_DTYPE)
    return [tuple(c.reshape(c.shape[0], *s).to(dtype) for c, s in zip(layer, mod.KV_SHAPES)) for layer in cache]


@dataclasses.dataclass
class Result:
    logits_cpu: object
    logits_npu: object
    cache_cpu: object     # PagedKVCache after the step
    kv_npu: list          # NPU layout after the step
    staging_cpu: object
    staging_npu: list
    save_ids: object
    written: tuple        # (block, offset) of the step's slots
    kv_before: list       # NPU cache before the step


def _wiring_step(model, variant, mode, *, compiled=False, seed=0, npu_edit=None, src_edit=None) -> Result:
    """Run one step of ``variant`` on both targets from identical state.  ``npu_edit(h)`` may miswire
    the NPU side's host quantities, ``src_edit(source)`` the NPU module itself (negative controls)."""
    from graphgen.npu.run.compile import compile_module
    from graphgen.npu.run.inputs import random_weights
    from graphgen.npu.run.weights import load_time_weights
    from graphgen.runtime.core import ops
    from graphgen.runtime.core.kvcache import PagedKVCache, kv_cache_shapes

    spec, _ = _model(model)
    cpu_mod, npu_mod = _cpu_module(model, variant), _npu_module(model, variant, mode, src_edit)
    seqs, save_ids = STEPS[variant]
    W = random_weights(spec, seed=seed, rope=npu_mod.ROPE, max_positions=512)  # bf16 (tests/npu/conftest.py)
    W_cpu = {k: w.float() for k, w in W.items()}  # the same values in float32 for the reference
    # same random noise in both caches: unwritten slots must stay equal, wrong reads/writes differ
    shapes = kv_cache_shapes(spec.family, dataclasses.asdict(spec.dims), NUM_BLOCKS, spec.kv_cache.block_size)
    cache = PagedKVCache(spec.dims.num_hidden_layers, {k: s[1:] for k, s in shapes.items()}, NUM_BLOCKS)
    g = torch.Generator().manual_seed(seed + 1)
    for layer in cache:
        for c in layer:
            c.copy_(torch.randn(c.shape, generator=g).bfloat16().float())  # representable in both caches
    if any(hist for _, hist, _ in seqs):
        # history: prefill the prefixes into the cache through the CPU target, then both start from it
        pre = _host(spec, [(t, 0, hist) for t, hist, _ in seqs if hist], [], seed + 2)
        _run_cpu(_cpu_module(model, "mempool_prefill"), W_cpu, _cpu_inputs(pre), cache)
        for layer in cache:  # the prefix as a bf16 cache holds it, in both caches
            for c in layer:
                c.copy_(c.bfloat16().float())
    loads_cpu, loads_npu = (), ()
    load_ids = torch.tensor(_load_ids(seqs, spec.kv_cache.block_size), dtype=torch.long)
    if cpu_mod.META["history"]:
        # the full history blocks come from the pool through the step's kv_load: hand both targets
        # the prefilled blocks as load staging and overwrite them in the caches with noise first
        loads_cpu = [tuple(c.index_select(0, load_ids).clone() for c in layer) for layer in cache]
        for layer in cache:
            for c in layer:
                c[load_ids] = torch.randn(c[load_ids].shape, generator=g).bfloat16().float()
        loads_npu = _to_npu_layout(loads_cpu, npu_mod)
    kv_npu = _to_npu_layout(cache, npu_mod)
    kv_before = [tuple(c.clone() for c in layer) for layer in kv_npu]

    h = _host(spec, seqs, save_ids, seed + 3)
    logits_cpu, staging_cpu = _run_cpu(cpu_mod, W_cpu, _cpu_inputs(h), cache, loads_cpu)

    hn = npu_edit(dict(h)) if npu_edit else h
    b = _npu_inputs(hn, npu_mod)
    staging_npu = ([tuple(torch.zeros(NUM_BLOCKS, *s, dtype=getattr(torch, npu_mod.KV_DTYPE)) for s in npu_mod.KV_SHAPES)
                    for _ in range(spec.dims.num_hidden_layers)] if npu_mod.META["saves"] else [])
    target = npu_mod
    if compiled:  # through the stand-in backend: AOT as torchair calls it + our model of its re-inplace
        torch._dynamo.reset()
        target, backend = compile_module(npu_mod, npu_mod.COMPILE_MODE, use_standin=True)
    with torch.no_grad():
        npu_mod.load(b, kv_npu, loads_npu)  # eager, before the graph (the NPU module's load())
        logits_npu = target.forward(load_time_weights(W, [npu_mod]), b, kv_npu, staging_npu)
    if compiled:
        assert len(backend.graphs) == 1  # fullgraph, one graph: the numbers above are the compiled graph's
    slots = torch.tensor(h["slot_mapping"])
    bs = spec.kv_cache.block_size
    return Result(logits_cpu, logits_npu, cache, kv_npu, staging_cpu, staging_npu,
                  torch.tensor(save_ids, dtype=torch.long), (slots // bs, slots % bs), kv_before)


def _assert_wiring_matches(r: Result):
    assert r.logits_npu.shape == r.logits_cpu.shape
    diff = (r.logits_npu.float() - r.logits_cpu).abs().max().item()
    tol = LOGITS_RTOL * r.logits_cpu.abs().max().item()
    assert diff <= tol, f"logits differ by {diff:.3g} (> {tol:.3g})"
    for li, (cpu_layer, npu_layer) in enumerate(zip(r.cache_cpu, r.kv_npu)):
        for ci, (c, n) in enumerate(zip(cpu_layer, npu_layer)):
            n_as_cpu = n.view(c.shape).float()  # [NB, BS, Hkv*D] -> [NB, BS, Hkv, D] (DeepSeek: same shape)
            bad = (n_as_cpu - c).abs().reshape(c.shape[0], c.shape[1], -1).amax(-1) > KV_RTOL * c.abs().max()
            assert not bad.any(), f"layer {li} component {ci}: KV differs at (block, offset) {bad.nonzero().tolist()}"
    if r.staging_cpu is not None:
        s = r.save_ids.numel()
        for li, (cpu_layer, npu_layer, kv_layer) in enumerate(zip(r.staging_cpu, r.staging_npu, r.kv_npu)):
            for c, n, k in zip(cpu_layer, npu_layer, kv_layer):
                # staging holds exactly the saved blocks of the cache AFTER this step's writes
                assert torch.equal(n[:s], k.index_select(0, r.save_ids)), f"layer {li}: NPU staging != saved blocks"
                assert torch.allclose(n[:s].view(c.shape).float(), c, atol=KV_RTOL * c.abs().max().item(), rtol=0), \
                    f"layer {li}: staging differs"


def _assert_not_vacuous(r: Result):
    # the step really wrote new K/V over the noise the caches started with, and the logits carry signal
    blk, off = r.written
    for layer, before in zip(r.kv_npu, r.kv_before):
        assert all(not torch.isclose(c[blk, off], b[blk, off]).all(-1).any() for c, b in zip(layer, before))
    assert r.logits_cpu.abs().max() > 100 * ATOL


# ------------------------------------------------------------------------------------------ tests
MODELS = ("tiny_qwen3_npu", "tiny_deepseek_v3_npu_dense")
# MLA's value head below, equal to and above the query/key head (qk_nope + qk_rope = 128 + 64 here), with
# and without query compression (issue 28 item 5: v_head_dim > qk_nope + qk_rope crashed the CPU target)
MLA_HEAD_DIMS = {"tiny_deepseek_v3_npu_dense_v_below": {"v_head_dim": 64},
                 "tiny_deepseek_v3_npu_dense_v_equal": {"v_head_dim": 192, "q_lora_rank": None},
                 "tiny_deepseek_v3_npu_dense_v_above": {"v_head_dim": 256},
                 "tiny_deepseek_v3_npu_dense_v_above_no_q_lora": {"v_head_dim": 256, "q_lora_rank": None}}

VARIANTS = ("mempool_prefill", "splitfuse", "decode", "mempool_prefill_layer", "splitfuse_layer")
MODES = ("max_autotune",)  # the only mode the hardware-shaped specs declare (docs/npu.md)


@needs_standin
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("model", MODELS)
def test_wiring_check_on_cpu_eager_matches_cpu_target(model, variant):
    """WIRING CHECK (CPU stand-in, not an NPU result): eager NPU forward == CPU target.  Eagerly the
    two compile modes' modules differ only in event calls (no-ops here), so one mode is enough."""
    r = _wiring_step(model, variant, "max_autotune")
    _assert_not_vacuous(r)
    _assert_wiring_matches(r)


@needs_standin
@pytest.mark.parametrize("model,variant", [("tiny_deepseek_v3_npu_dense_v_above", v) for v in
                                           ("mempool_prefill", "splitfuse", "decode")]
                         + [("tiny_deepseek_v3_npu_dense_v_above_no_q_lora", "mempool_prefill"),
                            ("tiny_deepseek_v3_npu_dense_v_below", "decode"),
                            ("tiny_deepseek_v3_npu_dense_v_equal", "splitfuse")])
def test_wiring_check_on_cpu_mla_value_head_below_equal_and_above_the_query_head(model, variant):
    """WIRING CHECK (CPU stand-in, not an NPU result): MLA by phase (un-absorbed prefill/splitfuse,
    absorbed decode) for v_head_dim below, equal to and above qk_nope + qk_rope, == the CPU target
    (whose MLA is compared with transformers for the same combinations in tests/runtime/test_mla_head_dims.py)."""
    r = _wiring_step(model, variant, "max_autotune")
    _assert_not_vacuous(r)
    _assert_wiring_matches(r)


@pytest.mark.slow  # torch.compile through the stand-in, per case
@needs_standin
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("model", MODELS)
def test_wiring_check_on_cpu_compiled_matches_cpu_target(model, variant, mode):
    """WIRING CHECK (CPU stand-in, not an NPU result): the post-AOT graph after our model of torchair's
    re-inplace, executed on CPU, == CPU target (KV writes land in place, saves read after them)."""
    r = _wiring_step(model, variant, mode, compiled=True)
    _assert_wiring_matches(r)


# ------------------------------------------------------------------------------------------ negative controls
def _swap_block_table(h):
    # sequence 0's first two blocks swapped: attention reads the wrong blocks (kv_index is unchanged)
    t = [list(row) for row in h["block_tables"]]
    t[0][0], t[0][1] = t[0][1], t[0][0]
    h["block_tables"] = t
    return h


def _shift_slots(h):
    # every slot one further: the K/V lands one offset late (and attention reads the old value)
    h["slot_mapping"] = [s + 1 for s in h["slot_mapping"]]
    return h


@needs_standin
@pytest.mark.parametrize("model", MODELS)
def test_wiring_check_on_cpu_fails_with_wrong_block_table(model):
    r = _wiring_step(model, "splitfuse", "max_autotune", npu_edit=_swap_block_table)
    with pytest.raises(AssertionError, match="logits differ"):
        _assert_wiring_matches(r)
    # far outside the tolerance, not borderline
    assert (r.logits_npu.float() - r.logits_cpu).abs().max() > 3 * LOGITS_RTOL * r.logits_cpu.abs().max()


@needs_standin
def test_wiring_check_on_cpu_fails_with_wrong_slot_mapping():
    r = _wiring_step("tiny_qwen3_npu", "decode", "max_autotune", npu_edit=_shift_slots)
    with pytest.raises(AssertionError, match="logits differ|KV differs"):
        _assert_wiring_matches(r)
    r.logits_npu = r.logits_cpu  # even with equal logits the cache comparison alone catches it
    with pytest.raises(AssertionError, match="KV differs"):
        _assert_wiring_matches(r)


@needs_standin
def test_wiring_check_on_cpu_fails_with_wrong_sparse_mode():
    # a prefill lowered like decode (sparse_mode=0, no mask: every query sees the whole sequence)
    def no_causal_mask(src):
        assert src.count("sparse_mode=3") >= 2
        return src.replace("atten_mask=b.atten_mask", "atten_mask=None").replace("sparse_mode=3", "sparse_mode=0")

    r = _wiring_step("tiny_qwen3_npu", "mempool_prefill", "max_autotune", src_edit=no_causal_mask)
    with pytest.raises(AssertionError, match="logits differ"):
        _assert_wiring_matches(r)


@needs_standin
def test_standin_kernels_refuse_inputs_the_docs_forbid():
    """The stand-in raises instead of guessing where the docs forbid an input (so a miswired call
    cannot pass the wiring check by accident): out-of-range scatter indices, a non-int32 block table,
    a sparse_mode=3 call without the causal 2048x2048 mask, an unmodelled layout."""
    standin.install()
    npu = torch.ops.npu
    cache = torch.zeros(2, 4, 8)
    with pytest.raises(IndexError):
        npu.npu_scatter_nd_update_(cache, torch.tensor([[2, 0]]), torch.ones(1, 8))
    with pytest.raises(IndexError):  # negative indices would silently wrap in torch indexing
        npu.npu_scatter_nd_update_(cache, torch.tensor([[-1, 0]]), torch.ones(1, 8))
    q = torch.randn(3, 2, 8)
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1)
    kw = dict(actual_seq_lengths=[3], actual_seq_lengths_kv=[3], num_heads=2, num_key_value_heads=1,
              input_layout="TND", sparse_mode=3, block_size=4, scale=1.0)
    out, _ = npu.npu_fused_infer_attention_score(q, cache, cache, atten_mask=mask,
                                                 block_table=torch.tensor([[1]], dtype=torch.int32), **kw)
    assert out.shape == (3, 2, 8)
    with pytest.raises(ValueError, match="int32"):
        npu.npu_fused_infer_attention_score(q, cache, cache, atten_mask=mask, block_table=torch.tensor([[1]]), **kw)
    with pytest.raises(ValueError, match="causal mask"):
        npu.npu_fused_infer_attention_score(q, cache, cache, atten_mask=~mask,
                                            block_table=torch.tensor([[1]], dtype=torch.int32), **kw)
    with pytest.raises(NotImplementedError):
        npu.npu_fused_infer_attention_score(q, cache, cache, atten_mask=mask,
                                            block_table=torch.tensor([[1]], dtype=torch.int32),
                                            **{**kw, "input_layout": "BSH"})


# ------------------------------------------------------------------------------------------ meta kernels
# graphgen.npu.run.bucketing.run_standin_loop runs its steps on meta tensors: the meta kernels must give what
# the CPU kernels give (shapes, dtypes) and refuse what they refuse, except what needs tensor values.
MASK = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1)


def _kernel_calls():
    """(op name, args, kwargs) inside each kernel's contract; tiny shapes, so run with the limits off."""
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g).bfloat16()

    cache = r(3, 4, 8)
    paged = dict(actual_seq_lengths=[3, 5], actual_seq_lengths_kv=[6, 2], num_heads=2, num_key_value_heads=1,
                 input_layout="TND", sparse_mode=3, block_size=4, scale=0.5, atten_mask=MASK,
                 block_table=torch.tensor([[1, 2], [0, 0]], dtype=torch.int32))
    dense = dict(actual_seq_lengths=[2, 5], actual_seq_lengths_kv=[4, 9], num_heads=2, input_layout="TND",
                 sparse_mode=3, scale=0.5, atten_mask=MASK)
    v2 = dict(num_query_heads=2, num_key_value_heads=1, input_layout="BSH", block_table=paged["block_table"],
              block_size=4, actual_seq_kvlen=[6, 2], softmax_scale=0.5)
    return [("npu_rms_norm", (r(3, 8), r(8), 1e-6), {}),
            ("npu_add_rms_norm", (r(3, 8), r(3, 8), r(8), 1e-6), {}),
            ("npu_swiglu", (r(3, 8),), {"dim": -1}),
            ("npu_apply_rotary_pos_emb", (r(1, 3, 2, 8), r(1, 3, 1, 8), r(1, 3, 1, 8), r(1, 3, 1, 8)),
             {"layout": "BSND", "rotary_mode": "half"}),
            ("npu_interleave_rope", (r(1, 2, 3, 8), r(1, 1, 3, 8), r(1, 1, 3, 8)), {}),
            ("npu_fused_infer_attention_score", (r(5, 2, 8), cache, cache), paged),
            ("npu_fused_infer_attention_score", (r(5, 2, 8), r(9, 2, 8), r(9, 2, 4)), dense),
            ("npu_fused_infer_attention_score_v2", (r(2, 1, 16), cache, cache), v2)]


def _meta(x):
    if isinstance(x, torch.Tensor):
        return x.to("meta")
    if isinstance(x, dict):
        return {k: _meta(v) for k, v in x.items()}
    return x


def _shapes(out):
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [(tuple(t.shape), t.dtype) for t in outs]


@needs_standin
@pytest.mark.parametrize("call", range(len(_kernel_calls())))
def test_meta_kernels_give_the_cpu_kernels_shapes_and_dtypes(call):
    standin.install()
    op, args, kw = _kernel_calls()[call]
    fn = getattr(torch.ops.npu, op)
    cpu = fn(*args, **kw)
    meta = fn(*[_meta(a) for a in args], **_meta(kw))
    assert all(t.device.type == "meta" for t in (meta if isinstance(meta, (tuple, list)) else (meta,)))
    assert _shapes(meta) == _shapes(cpu), op


@needs_standin
@pytest.mark.parametrize("call, edit, match", [
    (5, {"actual_seq_lengths_kv": [6, 9]}, "3 blocks needed, block_table has 2 columns"),
    (5, {"actual_seq_lengths": [3, 6]}, "cumulative lengths <= T"),
    (5, {"actual_seq_lengths_kv": [2, 2]}, "too short for 3 queries"),
    (5, {"block_table": torch.tensor([[1, 2], [0, 0]])}, "int32"),
    (6, {"actual_seq_lengths_kv": [1, 9]}, "a sequence has 2 queries but 1 keys"),
    (6, {"atten_mask": MASK[:1024]}, "2048x2048 causal atten_mask"),
    (7, {"actual_seq_kvlen": None}, "page attention needs actual_seq_kvlen"),
])
def test_meta_kernels_refuse_what_the_cpu_kernels_refuse(call, edit, match):
    """The contract (layouts, lengths, block-table width, sparse mode) is checked on meta tensors too; so is
    a documented limit, with the call's own lengths (the row the meta steps of run_standin_loop rely on)."""
    from graphgen.npu.check.limits import KernelLimitError

    standin.install()
    op, args, kw = _kernel_calls()[call]
    fn = getattr(torch.ops.npu, op)
    for device in ("cpu", "meta"):
        a, k = (args, {**kw, **edit}) if device == "cpu" else ([_meta(x) for x in args], _meta({**kw, **edit}))
        with pytest.raises(ValueError, match=match):
            fn(*a, **k)
    # a limit row on meta: absorbed MLA takes at most 16 query tokens per sequence
    q, ckv, kpe = torch.zeros(17, 32, 512), torch.zeros(2, 128, 512), torch.zeros(2, 128, 64)
    mla = dict(query_rope=torch.zeros(17, 32, 64), key_rope=kpe, actual_seq_lengths=[17], actual_seq_lengths_kv=[17],
               block_table=torch.tensor([[0]], dtype=torch.int32), num_heads=32, num_key_value_heads=1, scale=1.0,
               input_layout="TND", sparse_mode=3, block_size=128, atten_mask=MASK)
    with standin.enforce_limits(True), pytest.raises(KernelLimitError, match=r"fia\.mla\.query_len"):
        torch.ops.npu.npu_fused_infer_attention_score(*[_meta(x.bfloat16()) for x in (q, ckv, ckv)], **_meta(mla))


@needs_standin
def test_what_only_the_cpu_kernels_check_reads_tensor_values():
    """Block ids and the causal mask's content are values: the CPU kernel refuses them, a meta run cannot
    (what run_standin_loop's shapes-only steps do not check; docs/npu.md).  A causal mask once checked is not
    compared again until it is written in place: then it is."""
    standin.install()
    op, args, kw = _kernel_calls()[5]
    fn = getattr(torch.ops.npu, op)
    far = {**kw, "block_table": torch.tensor([[1, 7], [0, 0]], dtype=torch.int32)}
    with pytest.raises(IndexError, match="block id out of range"):
        fn(*args, **far)
    fn(*[_meta(a) for a in args], **_meta(far))  # shapes only: passes
    mask = MASK.clone()
    fn(*args, **{**kw, "atten_mask": mask})
    mask[0, 1] = False  # written after it was found causal
    with pytest.raises(ValueError, match="causal mask"):
        fn(*args, **{**kw, "atten_mask": mask})
