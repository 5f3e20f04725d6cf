"""Decode-time saves and write-backs through the NPU commit path (audit 3 N8), and every thread touching
NPU objects bound to the device (N7).

`KVConnector.save_filled` (decode-time saves, write-backs) packs each block straight from the device
cache: a synchronous pageable copy per (layer, component, block) on the connector's thread. The NPU
runner makes a plan's saves from the cache through `CommitPath.save_filled` instead
(`NpuModelRunner.save_filled`): the blocks pinned, the copy stream gathers
them into a ring slot's device staging after the current stream's work, one D2H per (layer,
component), the puts after the copy event. The device streams are MODELLED here
(`graphgen.npu.standin.streams`: a host thread per stream; pageable host rows), so this proves the
path's ordering and bytes under those semantics, not NPU behaviour: a gate held on the modelled copy
stream holds the puts back (the old path put at once: the negative control), and the pooled bytes
equal the cache's blocks. `DeviceBinding` is called by the runner's thread and by whichever thread
waits on a copy event (the connector's commit thread under ``write: async``); recorded here, since CPU
torch has no device to set."""
from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest
import torch

from graphgen.modelspec.loader import load_spec
from graphgen.npu.standin import fakes as standin

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(standin.torch_npu_available(), reason="real torch_npu installed; stand-in not used")
NB = 8


def _parts(binding=None, *, via_ring: bool = True):
    from graphgen.npu.run.compile import load_module
    from graphgen.npu.run.inputs import kv_buffers
    from graphgen.npu.run.staging import CommitPath, StagingRing
    from graphgen.npu.standin.streams import ModelledStreams
    from graphgen.runtime.core.kvcache import BlockAllocator, PagedKVCache, token_shapes
    from graphgen.runtime.engine.connector import KVConnector
    from graphgen.runtime.pool import HostPool

    spec = load_spec(ROOT / "specs/tiny_qwen3_npu.yaml")
    assert standin.install()
    mod = load_module(ROOT / "generated/tiny_qwen3_npu/npu/max_autotune/decode.py")
    L = spec.dims.num_hidden_layers
    shapes = {k: (spec.kv_cache.block_size, *v) for k, v in token_shapes(spec.family, dataclasses.asdict(spec.dims)).items()}
    cache = PagedKVCache(L, shapes, NB, dtype=getattr(torch, mod.KV_DTYPE))
    for layer in cache:
        for t in layer:
            t.copy_(torch.randn(t.shape).to(t.dtype))
    kv = [tuple(t.view(t.shape[0], *s) for t, s in zip(layer, mod.KV_SHAPES)) for layer in cache]
    alloc = BlockAllocator(NB)
    alloc.alloc(4)  # blocks 0..3: the step's
    connector = KVConnector(HostPool(1 << 30), cache, alloc, write="async")
    streams = ModelledStreams()
    path = CommitPath(StagingRing(CommitPath.slots([kv_buffers(mod, L, 0, staging_rows=2)[1] for _ in range(2)],
                                                   streams)), streams, binding=binding)
    # how the NPU runner saves from the cache (NpuModelRunner.save_filled), or the connector's own path
    save = (lambda ids, keys: path.save_filled(connector, ids, keys, kv)) if via_ring else connector.save_filled
    return cache, alloc, connector, path, save


def test_decode_time_saves_go_through_the_copy_stream_and_pool_the_cache_blocks():
    from graphgen.runtime.core.kvcache import pack_block

    cache, alloc, connector, path, save = _parts()
    gate = threading.Event()
    path.copy_stream.run(gate.wait)  # hold the copy stream
    try:
        save([1, 2, 3], ["k1", "k2", "k3"])  # three blocks: two ring slots of two rows
        assert not any(connector.pool.contains(k) for k in ("k1", "k2", "k3"))  # the puts wait on the copies
        assert path.ring.in_flight == 2
    finally:
        gate.set()
    connector.drain(timeout=60)
    assert path.filled_saves == 3 and path.ring.in_flight == 0
    for b in (1, 2, 3):
        assert connector.pool.get(f"k{b}") == pack_block(cache, b), b
    alloc.unpin([])  # (nothing left pinned: an unpin of block 1 would raise)
    with pytest.raises(ValueError, match="not pinned"):
        alloc.unpin([1])
    connector.close()
    path.close()


def test_negative_control_the_old_path_puts_at_once_past_a_held_copy_stream():
    cache, alloc, connector, path, save = _parts(via_ring=False)
    gate = threading.Event()
    path.copy_stream.run(gate.wait)
    try:
        save([1], ["k1"])
        connector.drain(timeout=60)
        assert connector.pool.contains("k1") and path.filled_saves == 0  # packed from the cache, not the ring
    finally:
        gate.set()
        connector.close()
        path.close()


def test_the_commit_thread_binds_the_device_before_waiting_on_a_copy_event():
    from graphgen.npu.run.staging import DeviceBinding

    calls = []
    binding = DeviceBinding(3, lambda i: calls.append((i, threading.get_ident())))
    cache, alloc, connector, path, save = _parts(binding)
    host_thread = connector.host_stream.launch(threading.get_ident).result(timeout=60)
    save([1], ["k1"])
    connector.drain(timeout=60)
    binding.ensure()  # the runner's thread, as submit/collect do
    binding.ensure()  # once per thread
    assert sorted(calls) == sorted([(3, host_thread), (3, threading.get_ident())])
    assert binding.bound == {host_thread, threading.get_ident()}
    connector.close()
    path.close()
    # negative control: without the binding the commit thread never sets a device
    calls.clear()
    cache, alloc, connector, path, save = _parts(None)
    save([1], ["k1"])
    connector.drain(timeout=60)
    assert calls == []
    connector.close()
    path.close()
