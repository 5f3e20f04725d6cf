"""Post-AOT graph structure of the KV write -> record/wait -> save lowering, on the CPU STAND-IN.

These tests prove graph structure only (node order, streams, in-place-ness after the modelled
torchair re-inplace); nothing here runs on an NPU.
"""
import sys

import pytest
import torch

from graphgen.npu.check import aotcheck
from graphgen.npu.standin import fakes as standin

pytestmark = pytest.mark.skipif(standin.torch_npu_available(), reason="real torch_npu installed; stand-in not used")

NB, BS, HD, T, S = 4, 2, 3, 3, 2


@pytest.fixture(autouse=True)
def _tiny_specs_are_outside_the_kernel_limits():
    """The tiny specs these tests trace are float32 with block size 4 and head_dim 16: outside the
    kernels' documented limits by construction (tests/npu/test_limits.py proves the stand-in rejects
    them).  This file checks post-AOT structure (its toy ops use float32 and tiny shapes), so it runs with the limits off."""
    with standin.enforce_limits(False):
        yield


@pytest.fixture(scope="module")
def ta():
    assert standin.install()
    import torchair
    assert standin.is_standin(torchair) and "stand-in" in torchair.__file__
    return torchair


class Toy(torch.nn.Module):
    """Two 'layers': main-stream KV write, record, save-stream wait + gather into staging."""

    def __init__(self, variant="good"):
        super().__init__()
        self.variant = variant

    def forward(self, x, idx, blocks, rows, caches, stagings):
        import torchair
        import torch_npu
        v = self.variant
        for cache, st in zip(caches, stagings):
            h = x * 2
            if v != "write_after_record":
                torch_npu.npu_scatter_nd_update_(cache, idx, h)
            r = torchair.ops.record()
            if v == "write_after_record":
                torch_npu.npu_scatter_nd_update_(cache, idx, h)
            with torchair.scope.npu_stream_switch("kv_save", 0):
                if v != "no_wait":
                    torchair.ops.wait([r])
                if v == "slice_copy":      # partial copy into a graph input -> slice_scatter + copy_
                    st[:S - 1].copy_(cache.index_select(0, blocks)[:S - 1])
                elif v != "save_out_of_scope":
                    torch_npu.npu_scatter_nd_update_(st, rows, cache.index_select(0, blocks))
            if v == "save_out_of_scope":
                torch_npu.npu_scatter_nd_update_(st, rows, cache.index_select(0, blocks))
            x = x + cache.sum()
        return x


def _args():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(T, HD, generator=g), torch.tensor([[0, 1], [1, 0], [3, 1]]), torch.tensor([0, 3]),
            torch.tensor([[0], [1]]), [torch.zeros(NB, BS, HD) for _ in range(2)],
            [torch.zeros(S, BS, HD) for _ in range(2)])


def _compile(ta, module, mode, args):
    torch._dynamo.reset()
    cfg = ta.CompilerConfig()
    cfg.mode = mode
    backend = ta.get_npu_backend(compiler_config=cfg)
    compiled = torch.compile(module, backend=backend, fullgraph=True)
    with torch.no_grad():
        out = compiled(*args)
    (cg,) = backend.graphs
    caches = [cg.placeholder_for(t) for t in args[4]]
    stagings = [cg.placeholder_for(t) for t in args[5]]
    return out, cg, caches, stagings


@pytest.mark.parametrize("mode", ["max-autotune", "reduce-overhead"])
def test_recommended_lowering_keeps_writes_in_place_and_in_scope(ta, mode):
    args, ref = _args(), _args()
    out, cg, caches, stagings = _compile(ta, Toy(), mode, args)
    # The raw post-AOT graph shows the pitfall: writes come back as trailing copy_ after the last scope_exit.
    raw = aotcheck.check_kv_save_graph(cg.raw, caches, stagings)
    assert any("after the final scope_exit" in p for p in raw), raw
    # After the (modelled) torchair re-inplace every write is in place, ordered and in its scope.
    aotcheck.assert_kv_save_graph(cg.gm, caches, stagings)
    assert len(cg.reinplaced) == 4
    assert "aten.copy_" not in cg.gm.code
    # The compiled (re-inplaced) graph computes what eager does, buffers included.
    with torch.no_grad():
        expected = Toy()(*ref)
    assert torch.allclose(out, expected)
    for got, want in zip(args[4] + args[5], ref[4] + ref[5]):
        assert torch.equal(got, want)
    assert args[5][0].abs().sum() > 0  # the save really gathered written blocks


@pytest.mark.parametrize("variant, needle", [
    ("no_wait", "is not ordered after write"),
    ("save_out_of_scope", "is not on stream 'kv_save'"),
    ("write_after_record", "is not ordered after write"),
    ("slice_copy", "after the final scope_exit"),
])
def test_mutated_toy_fails_the_checks(ta, variant, needle):
    _, cg, caches, stagings = _compile(ta, Toy(variant), "reduce-overhead", _args())
    problems = aotcheck.check_kv_save_graph(cg.gm, caches, stagings)
    assert any(needle in p for p in problems), problems
    with pytest.raises(AssertionError):
        aotcheck.assert_kv_save_graph(cg.gm, caches, stagings)


class PaToy(torch.nn.Module):
    """KV write via npu_scatter_pa_kv_cache: its functional twin has two outputs, which torchair 2.14
    does not re-inplace in reduce-overhead -> the write stays a trailing copy_ (why we avoid it)."""

    def forward(self, k, v, slots, blocks, rows, kc, vc, st):
        import torchair
        import torch_npu
        torch_npu.npu_scatter_pa_kv_cache(k, v, kc, vc, slots, cache_mode="Norm")
        r = torchair.ops.record()
        with torchair.scope.npu_stream_switch("kv_save", 0):
            torchair.ops.wait([r])
            torch_npu.npu_scatter_nd_update_(st, rows, kc.index_select(0, blocks))
        return k + 1


def test_scatter_pa_kv_cache_is_left_functional(ta):
    torch._dynamo.reset()
    cfg = ta.CompilerConfig()
    cfg.mode = "reduce-overhead"
    backend = ta.get_npu_backend(compiler_config=cfg)
    a = (torch.randn(T, HD), torch.randn(T, HD), torch.tensor([0, 3, 7]), torch.tensor([0, 3]),
         torch.tensor([[0], [1]]), torch.zeros(NB, BS, HD), torch.zeros(NB, BS, HD), torch.zeros(S, BS, HD))
    with torch.no_grad():
        torch.compile(PaToy(), backend=backend, fullgraph=True)(*a)
    (cg,) = backend.graphs
    assert "npu_scatter_pa_kv_cache_functional" in cg.gm.code
    problems = aotcheck.check_kv_save_graph(cg.gm, [cg.placeholder_for(a[5]), cg.placeholder_for(a[6])],
                                            [cg.placeholder_for(a[7])])
    assert any("after the final scope_exit" in p for p in problems), problems


class TaggedToy(torch.nn.Module):
    """reduce-overhead form: tagged events created outside the compiled region."""

    def __init__(self, events, drop_wait=False):
        super().__init__()
        self.events, self.drop_wait = events, drop_wait

    def forward(self, x, idx, blocks, rows, caches, stagings):
        import torchair
        import torch_npu
        for layer, (cache, st) in enumerate(zip(caches, stagings)):
            torch_npu.npu_scatter_nd_update_(cache, idx, x * 2)
            torchair.ops.npu_tagged_event_record(self.events[layer])
            with torchair.scope.npu_stream_switch("kv_save", 0):
                if not self.drop_wait:
                    torchair.ops.npu_tagged_event_wait(self.events[layer])
                torch_npu.npu_scatter_nd_update_(st, rows, cache.index_select(0, blocks))
            x = x + cache.sum()
        return x


@pytest.mark.parametrize("drop_wait", [False, True])
def test_tagged_event_lowering(ta, drop_wait):
    with standin.fresh_tags():
        events = [ta.ops.npu_create_tagged_event(f"graphgen.toy.decode.kv_ready.L{i:02d}") for i in range(2)]
        with pytest.raises(ValueError):
            ta.ops.npu_create_tagged_event("graphgen.toy.decode.kv_ready.L00")  # tags must be unique
        args = _args()
        _, cg, caches, stagings = _compile(ta, TaggedToy(events, drop_wait), "reduce-overhead", args)
    problems = aotcheck.check_kv_save_graph(cg.gm, caches, stagings)
    if drop_wait:
        assert any("is not ordered after write" in p for p in problems), problems
    else:
        assert problems == [], problems
        assert "graphgen.toy.decode.kv_ready.L01" in cg.gm.code


def test_fake_torch_npu_maps_to_ops(ta):
    import torch_npu
    assert standin.is_standin(torch_npu)
    y, rstd = torch_npu.npu_rms_norm(torch.ones(2, 4), torch.full((4,), 2.0), 1e-6)
    assert torch.allclose(y, torch.full((2, 4), 2.0), atol=1e-5)
    assert torch_npu.npu_swiglu(torch.zeros(2, 4)).shape == (2, 2)


def test_compile_module_standin_and_unavailable(ta):
    from graphgen.npu.run.compile import NpuUnavailable, compile_module
    target, backend = compile_module(Toy(), "max-autotune", use_standin=True)
    with torch.no_grad():
        torch._dynamo.reset()
        target.forward(*_args())
    assert backend.graphs and backend.graphs[0].mode == "max-autotune"
    with pytest.raises(NpuUnavailable) as ei:
        compile_module(Toy(), "max-autotune")  # real torchair requested: the stand-in must not pass for it
    assert "\n" not in str(ei.value)
    with pytest.raises(ValueError):
        compile_module(Toy(), "fast", use_standin=True)
