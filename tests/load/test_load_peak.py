"""Device memory while loading, counted by the ledger device (graphgen.dryrun.ledger): the ledger itself,
load-time weights built recipe by recipe with their sources freed (device peak = the weights + the
largest recipe, not + every recipe), and the engine's order: weights, then the KV cache sized from
what they left, then the runner."""
from __future__ import annotations

import types

import pytest
import torch

from graphgen.dryrun.ledger import DeviceOutOfMemory, Ledger
from graphgen.modelspec.loader import load_spec
from support.paths import SPECS

MIB = 1 << 20


def test_the_ledger_counts_storages_views_temporaries_and_refuses_past_its_capacity():
    with Ledger(64 * MIB) as led:
        a = torch.empty(4 * MIB, dtype=torch.uint8, device="meta")
        v = a[:MIB].view(torch.int32)  # a view: no new bytes
        assert led.live == 4 * MIB and led.allocations == 1
        b = torch.cat([a, a])  # an op's output is a new storage
        assert led.live == 12 * MIB
        del a
        assert led.live == 12 * MIB  # the view keeps its base alive, as on a device
        del v, b
        assert led.live == 0 and led.peak == 12 * MIB
        dst = torch.empty(1024, 2048, dtype=torch.bfloat16, device="meta")
        dst.t().copy_(torch.zeros(2048, 1024))  # into a strided view: a contiguous temporary for the copy
        assert led.peak == 12 * MIB and led.live == 4 * MIB
        dst[:, :1024].copy_(torch.zeros(1024, 1024))  # (also strided: 2 MiB temporary)
        big = torch.empty(30 * MIB, dtype=torch.uint8, device="meta")
        with pytest.raises(DeviceOutOfMemory, match=r"tried to allocate 0\.03 GiB \(.*uint8.*\) with 0\.03 GiB"):
            torch.empty(31 * MIB, dtype=torch.uint8, device="meta")
        del big, dst


def _tiny_dsv3_npu():
    """The NPU modules of tiny DeepSeek-V3 (merged gate/up, transposed expert stacks) and meta weights."""
    from graphgen.lower.compile import compile_spec
    from graphgen.runtime.core.weights import source_constants

    spec = load_spec(SPECS / "tiny_deepseek_v3_npu.yaml")
    compiled = compile_spec(spec, targets=["npu"], variants=["decode"], check=False)
    src = next(iter(compiled[0].sources.values()))
    mod = types.SimpleNamespace(**source_constants(src, ("LOAD_TIME_WEIGHTS",)))
    return spec, mod


def _recipe_bytes(W, mod) -> list[int]:
    return [sum(W[s].numel() * W[s].element_size() for s in r["cat"]) for r in mod.LOAD_TIME_WEIGHTS.values()]


@pytest.mark.parametrize("consume", [True, False], ids=["each-recipe-freed", "negative-control-all-held"])
def test_load_time_weights_peak_at_the_largest_recipe(consume):
    from graphgen.families import FAMILIES
    from graphgen.runtime.core.weights import load_time_weights

    spec, mod = _tiny_dsv3_npu()
    fam = FAMILIES[spec.family]
    with Ledger() as led:
        W = {k: torch.empty(s, dtype=torch.bfloat16, device="meta")
             for k, s in fam.checkpoint_layout(spec.dims, stacked=True).items() if 0 not in s}
        start = led.live
        recipes = _recipe_bytes(W, mod)
        out = load_time_weights(W, [mod], consume=consume)
        del W
        assert led.live == start  # the same bytes, merged
        extra = led.peak - start
        del out
    if consume:
        assert extra == max(recipes)  # one recipe's result beside the weights, at most
    else:  # the order before: every merged weight built while every source is held
        assert extra == sum(recipes) and len(recipes) > 2


class _Runner:
    def __init__(self, order, cache):
        order.append(("runner", cache.num_blocks))

    def close(self):
        pass


def test_the_engine_loads_weights_then_sizes_the_cache_from_what_they_left():
    import dataclasses

    from graphgen.runtime.core.kvcache import token_shapes
    from graphgen.runtime.engine.assembly import build_engine

    spec = load_spec(SPECS / "tiny_qwen3.yaml")
    shapes = {k: (spec.kv_cache.block_size, *v) for k, v in token_shapes(spec.family, dataclasses.asdict(spec.dims)).items()}
    order = []

    def size_kv(block_bytes):
        order.append(("size", block_bytes))
        return 40

    eng = build_engine(spec, kv_shapes=shapes, make_runner=lambda c, a, n, r: _Runner(order, c), num_blocks=None,
                       reserved_blocks=1, load_weights=lambda: order.append(("weights",)), size_kv=size_kv)
    per_block = spec.kv_layers * sum(torch.Size(s).numel() for s in shapes.values()) * 4  # float32 cache
    assert order == [("weights",), ("size", per_block), ("runner", 40)]  # 39 blocks + the reserved one
    assert eng.alloc.num_free == 39
    eng.close()
    with pytest.raises(ValueError, match="no device memory is left for the KV cache"):
        build_engine(spec, kv_shapes=shapes, make_runner=lambda *a: None, num_blocks=None, size_kv=lambda b: 0)


def test_kv_blocks_that_fit_is_vllms_rule():
    from graphgen.runtime.core.device_memory import kv_blocks_that_fit

    gib = 1 << 30
    # 64 GiB, 0.9 of it: 57.6 GiB; 30 GiB used by the weights, 1 GiB of rings to come, 16 MiB blocks
    assert kv_blocks_that_fit(30 * gib, 64 * gib, 16 * MIB, utilization=0.9, after_bytes=gib) == (
        int(0.9 * 64 * gib) - 31 * gib) // (16 * MIB)
    assert kv_blocks_that_fit(60 * gib, 64 * gib, MIB, utilization=0.9) == 0
    with pytest.raises(ValueError, match="in \\(0, 1\\]"):
        kv_blocks_that_fit(0, gib, MIB, utilization=1.5)
