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
# (history, new tokens) per sequence: prefill chunks longer than 16 tokens, lengths across blocks
SEQS = {"prefill": [(0, 40), (0, 130)], "splitfuse": [(130, 24), (5, 17)], "decode": [(260, 1), (3, 1)]}


def _meta_weights(spec, mod):
    """Rank 0's weights on meta tensors: the family's full layout, sliced as the graph names them."""
    from graphgen.families import FAMILIES
    from graphgen.runtime.parallel.ops import rank_weights
    from graphgen.ir.weights import graph_weight_names
    from graphgen.lower.compile import compile_spec

    fam = FAMILIES[spec.family]
    dtype = getattr(torch, spec.kv_cache.dtype)
    full = {k: torch.empty(s, dtype=torch.float32 if k.endswith(fam.fp32_suffixes) else dtype, device="meta")
            for k, s in fam.checkpoint_layout(spec.dims, stacked=True).items() if 0 not in s}
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
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(size: int):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def _meta(t):
    return None if t is None else (t.to("meta") if isinstance(t, torch.Tensor) else t)


@pytest.mark.skipif(standin.torch_npu_available(), reason="real torch_npu installed; stand-in not used")
@pytest.mark.parametrize("variant", ["decode", "mempool_prefill", "splitfuse"])
@pytest.mark.parametrize("model", ["qwen3_32b", "deepseek_v3_1"])
def test_full_size_module_traces_on_meta(model, variant, fake_group):
    import dataclasses

    from graphgen.modelspec.loader import load_spec
    from graphgen.npu.run.compile import load_module
    from graphgen.npu.run.inputs import npu_step_inputs

    standin.install()
    spec = load_spec(ROOT / "specs" / f"{model}.yaml")
    fake_group(spec.parallel.tp)
    with standin.fresh_tags():
        mod = load_module(ROOT / "generated" / model / "npu" / "max_autotune" / f"{variant}.py")
    phase = "decode" if mod.META["phase"] == "decode" else ("splitfuse" if mod.META["history"] else "prefill")
    seqs = SEQS[phase]
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
    b = npu_step_inputs(input_ids=ids, positions=pos, slot_mapping=slots, block_tables=tables,
                        seq_lens=[h + q for h, q in seqs], query_lens=qlens,
                        logits_indices=(torch.tensor(qlens).cumsum(0) - 1).tolist(), block_size=BS,
                        save_block_ids=list(range(nb)) if mod.META["saves"] else None, decode=phase == "decode")
    b = dataclasses.replace(b, **{f.name: _meta(getattr(b, f.name)) for f in dataclasses.fields(b)})
    dtype = getattr(torch, mod.KV_DTYPE)
    layers = spec.dims.num_hidden_layers
    kv = [tuple(torch.empty(nb, *s, dtype=dtype, device="meta") for s in mod.KV_SHAPES) for _ in range(layers)]
    staging = ([tuple(torch.empty(nb, *s, dtype=dtype, device="meta") for s in mod.KV_SHAPES) for _ in range(layers)]
               if mod.META["saves"] else [])
    try:
        with torch.no_grad():
            logits = mod.forward(_meta_weights(spec, mod), b, kv, staging)
    finally:
        standin.uninstall()
    assert logits.device.type == "meta" and logits.dtype == dtype
    assert tuple(logits.shape) == (len(seqs), spec.dims.vocab_size)
