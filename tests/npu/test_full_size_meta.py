"""The SHIPPED full-size NPU modules (Qwen3-32B, DeepSeek-V3.1), traced eagerly on META tensors through
the CPU stand-in: every layer's kernels see the real bf16 shapes (no weights are allocated), so a
shape or dtype error in a full-size module (e.g. a float32 table meeting bf16 weights in a matmul), or
an absorbed-MLA call with > 16 query tokens (checked by the stand-in's meta kernel), fails here.  The
non-paged TND envelope (D = 192, bf16) is checked on CPU values only (tests/npu/test_npu_generated.py);
the limits table of graphgen.npu.check.limits will add its checks here once merged.  Shapes and dtypes only: meta tensors carry no values, nothing ran on an NPU."""
from __future__ import annotations

from pathlib import Path

import pytest

import torch

from graphgen.npu.standin import fakes as standin  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BS = 128
# (history, new tokens) per sequence: prefill chunks longer than 16 tokens, lengths across blocks; every
# step's token count a multiple of 4 (DP attention's token collectives cut it into tp = 4 equal shards)
SEQS = {"prefill": [(0, 40), (0, 130), (0, 18), (0, 16)], "splitfuse": [(130, 24), (5, 18), (0, 30), (7, 12)],
        "decode": [(260, 1), (3, 1), (9, 1), (129, 1)]}
# the shipped full-size NPU specs: Qwen3-32B tp=2, DeepSeek-V3.1 tp=32, DeepSeek-V3.1 as 8 DP groups x tp=4,
# ep=32, DeepSeek-V3.1 with its MTP layer (one rank)
MODELS = ["qwen3_32b", "deepseek_v3_1", "deepseek_v3_1_dp_ep", "deepseek_v3_1_mtp"]
# ... and layouts rendered here, not shipped: Qwen3-32B at tp=2 with sequence parallel (reduce-scatter +
# norms on 1/tp of the tokens + all-gather)
LAYOUTS = {"qwen3_32b_sp": ("qwen3_32b", {"sp": True})}
# ... and the MTP layer sharded like a decoder layer (import-hf --fit's layout of the published checkpoint:
# tp 32; issue 38 item 2): its draft graph only (the target's modules are deepseek_v3_1's at tp 32)
MTP_LAYOUTS = {"deepseek_v3_1_mtp_tp32": ("deepseek_v3_1_mtp", {"tp": 32})}


def _meta_weights(spec, mod):
    """Rank 0's weights on meta tensors: the family's full layout, sliced as the graph names them."""
    from graphgen.families import FAMILIES
    from graphgen.runtime.parallel.ops import rank_weights
    from graphgen.ir.weights import graph_weight_names
    from graphgen.lower.compile import compile_spec

    fam = FAMILIES[spec.family]
    dtype = getattr(torch, spec.kv_cache.dtype)
    mtp = {"mtp_layers": spec.mtp.num_layers} if spec.mtp is not None else {}
    full = {k: torch.empty(s, dtype=torch.float32 if k.endswith(fam.fp32_suffixes) else dtype, device="meta")
            for k, s in fam.checkpoint_layout(spec.dims, stacked=True, **mtp).items() if 0 not in s}
    names = graph_weight_names(c.graph for c in compile_spec(spec, targets=("cpu",), check=False))
    W = rank_weights(full, names, rank=0, size=spec.parallel.tp)
    W[mod.ROPE_CACHE_KEY] = torch.empty(512, 2 * mod.ROPE["rot_dim"], dtype=dtype, device="meta")
    from graphgen.npu.run.weights import load_time_weights

    return load_time_weights(W, [mod])


@pytest.fixture
def fake_group():
    """The shipped full-size specs run tensor-parallel (qwen3_32b tp=2, deepseek_v3_1 tp=32): the modules'
    functional collectives need a process group.  torch's ``fake`` backend gives one of the spec's size in
    this process (rank 0; collectives return shape-correct results) -- shapes and dtypes, not numerics."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives  # noqa: F401  (registers the collectives' meta kernels)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(size: int):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def init_layout(spec, mod, fake_group):
    """Rank 0 of the spec's layout: a fake process group of the whole world (dp x cp x tp ranks) and the
    module's named groups (DP attention's tp and dp groups) built and bound as on a real rank."""
    from graphgen.npu.run.groups import bind_process_groups, build_process_groups

    par = spec.parallel
    fake_group(par.world)
    bind_process_groups(mod, build_process_groups(0, par.tp, par.dp, par.cp))


def _meta(t):
    return None if t is None else (t.to("meta") if isinstance(t, torch.Tensor) else t)


def _trace(model, variant, fake_group, tmp_path, seqs=None, every_row=False):
    """Trace one full-size module eagerly on meta tensors (stand-in kernels, limits enforced); returns
    (spec, outputs, tokens).  ``seqs``: (history, new tokens) per sequence (default SEQS by phase);
    ``every_row``: logits for every token (a speculative verify step), else the last of each sequence."""
    import dataclasses

    from graphgen.lower.compile import compile_spec
    from graphgen.modelspec.loader import load_spec
    from graphgen.npu.run.compile import load_module
    from graphgen.npu.run.inputs import npu_step_inputs

    standin.install()
    name, parallel = {**LAYOUTS, **MTP_LAYOUTS}.get(model, (model, None))
    spec = load_spec(ROOT / "specs" / f"{name}.yaml")
    path = ROOT / "generated" / model / "npu" / "max_autotune" / f"{variant}.py"
    if parallel:  # render the layout's module in memory
        spec = dataclasses.replace(spec, parallel=dataclasses.replace(spec.parallel, **parallel))
        (compiled,) = compile_spec(spec, variants=[variant], targets=["npu"], modes=["max-autotune"])
        path = tmp_path / f"{variant}.py"
        path.write_text(next(iter(compiled.sources.values())))
    with standin.fresh_tags():
        mod = load_module(path)
    init_layout(spec, mod, fake_group)
    decode = mod.META["phase"] == "decode"
    phase = "decode" if decode else ("splitfuse" if mod.META["history"] else "prefill")
    seqs = seqs or SEQS[phase]
    ids, pos, slots, tables, nb = [], [], [], [], 0
    width = max((h + q + BS - 1) // BS for h, q in seqs)
    for h, q in seqs:
        n = (h + q + BS - 1) // BS
        table = list(range(nb, nb + n))
        nb += n
        pos += list(range(h, h + q))
        slots += [table[p // BS] * BS + p % BS for p in range(h, h + q)]
        tables.append(table + [0] * (width - n))
        ids += [1] * q
    qlens = [q for _, q in seqs]
    tokens = sum(qlens)
    dtype = getattr(torch, mod.KV_DTYPE)
    b = npu_step_inputs(input_ids=ids, positions=pos, slot_mapping=slots, block_tables=tables,
                        seq_lens=[h + q for h, q in seqs], query_lens=qlens,
                        logits_indices=list(range(tokens)) if every_row else (torch.tensor(qlens).cumsum(0) - 1).tolist(),
                        block_size=BS, save_block_ids=list(range(nb)) if mod.META["saves"] else None, decode=decode,
                        prev_hidden=torch.empty(tokens, spec.dims.hidden_size, dtype=dtype)
                        if mod.META["phase"] == "mtp" else None)
    b = dataclasses.replace(b, **{f.name: _meta(getattr(b, f.name)) for f in dataclasses.fields(b)})
    layers = spec.kv_layers
    kv = [tuple(torch.empty(nb, *s, dtype=dtype, device="meta") for s in mod.KV_SHAPES) for _ in range(layers)]
    staging = ([tuple(torch.empty(nb, *s, dtype=dtype, device="meta") for s in mod.KV_SHAPES) for _ in range(layers)]
               if mod.META["saves"] else [])
    try:
        with torch.no_grad():
            out = mod.forward(_meta_weights(spec, mod), b, kv, staging)
    finally:
        standin.uninstall()
    return spec, out, tokens


@pytest.mark.skipif(standin.torch_npu_available(), reason="real torch_npu installed; stand-in not used")
@pytest.mark.parametrize("variant", ["decode", "mempool_prefill", "splitfuse"])
@pytest.mark.parametrize("model", [*MODELS[:3], *(pytest.param(m, marks=pytest.mark.slow)  # ~5 s each: kept out
                                    for m in (*MODELS[3:], *sorted(LAYOUTS)))])        # of the default run
def test_full_size_module_traces_on_meta(model, variant, fake_group, tmp_path):
    spec, out, _ = _trace(model, variant, fake_group, tmp_path)
    logits = out[0] if spec.mtp is not None else out  # a spec with MTP: (logits, hidden)
    assert logits.device.type == "meta" and logits.dtype == torch.bfloat16
    assert tuple(logits.shape) == (4, spec.dims.vocab_size)  # the last position of each of the 4 sequences


@pytest.mark.skipif(standin.torch_npu_available(), reason="real torch_npu installed; stand-in not used")
@pytest.mark.parametrize("step", ["mtp_draft", "mtp_draft_tp32", "verify_k3",
                                  pytest.param("verify_k15", marks=pytest.mark.slow)])
def test_full_size_mtp_graphs_trace_on_meta(step, fake_group, tmp_path):
    """DeepSeek-V3.1 with its MTP layer: the draft graph (MTP layer 61 over the history, prev_hidden in,
    logits and hidden out) and the speculative verify step = the decode module with K + 1 query tokens per
    row (absorbed FIA v2 BNSD, sparse_mode 3 + mask), logits at every row, K + 1 <= 16. ``mtp_draft_tp32``:
    rank 0 of the draft graph at tp 32 (rendered here), the MTP layer's weights sliced as a decoder layer's, the
    vocabulary-parallel embedding and LM head gathered to the whole vocabulary."""
    variant = "mtp_draft" if step.startswith("mtp_draft") else "decode"
    model = "deepseek_v3_1_mtp_tp32" if step == "mtp_draft_tp32" else "deepseek_v3_1_mtp"
    k = {"verify_k3": 3, "verify_k15": 15}.get(step)
    seqs = None if k is None else [(260, k + 1), (3, k + 1)]
    spec, (logits, hidden), tokens = _trace(model, variant, fake_group, tmp_path, seqs=seqs, every_row=k is not None)
    rows = 4 if k is None else tokens  # one row per sequence (4), or every token of a verify step
    assert tuple(logits.shape) == (rows, spec.dims.vocab_size) and logits.device.type == "meta"
    assert tuple(hidden.shape) == (tokens, spec.dims.hidden_size) and hidden.dtype == torch.bfloat16


@pytest.mark.skipif(standin.torch_npu_available(), reason="real torch_npu installed; stand-in not used")
def test_full_size_verify_beyond_16_tokens_per_row_is_refused(fake_group, tmp_path):
    """Negative control: K = 16 (17 query tokens per row) is outside absorbed FIA's 1-16 envelope."""
    from graphgen.npu.check.limits import KernelLimitError

    with pytest.raises(KernelLimitError, match="fia2.mla.heads"):
        _trace("deepseek_v3_1_mtp", "decode", fake_group, tmp_path, seqs=[(260, 17), (3, 17)], every_row=True)
