"""Overlapping steps under the NPU commit path: each step's pooled blocks are its own (issue 15 item 7).

`CommitPath` as `NpuModelRunner` uses it (ring slot -> graph -> save event -> copy stream waiting on
it, one D2H per layer x component into the slot's host rows -> the connector puts after the copy
event -> the slot is freed), with the real `KVConnector` (``write: async``, its host stream) and
`HostPool`, the generated tiny_qwen3_npu mempool_prefill run eagerly through the CPU stand-in. The
device streams and events are MODELLED (`graphgen.npu.standin.streams`: one host thread per stream,
FIFO, cross-stream waits; host rows pageable, as CPU torch refuses pin_memory): this proves the commit
path's ordering under those semantics, not NPU stream behaviour. Gates queued on the modelled
streams force each interleaving deterministically:

* ``copy_late``: step k's copies are held until step k+1's forward has run (and written its slot);
* ``save_late``: the forward (main stream, modelled) is held until the copy stream had the chance to
  run ahead of it (the copy stream never gets past the save event when it waits on it).

Negative controls fail the same check: the copy stream's wait on the save event removed
(``save_late``), and a ring slot reused before its copy completed (``copy_late``).
"""
from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from graphgen.modelspec.loader import load_spec
from graphgen.npu.standin import fakes as standin
from graphgen.npu.run.staging import CommitPath, StagingExhausted, StagingRing

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(standin.torch_npu_available(), reason="real torch_npu installed; stand-in not used")
STEPS, NB = 3, 8


class _ReusedBeforeCopied(StagingRing):
    """A broken ring: always slot 0, whatever copy or put is still reading it."""

    def acquire(self):
        return 0, self.buffers[0]

    def release(self, index):
        pass


@pytest.fixture(scope="module")
def tiny():
    from graphgen.npu.run.compile import load_module
    from graphgen.npu.run.inputs import random_weights

    assert standin.install()
    spec = load_spec(ROOT / "specs/tiny_qwen3_npu.yaml")
    mod = load_module(ROOT / "generated/tiny_qwen3_npu/npu/max_autotune/mempool_prefill.py")
    from graphgen.npu.run.weights import load_time_weights

    return spec, mod, load_time_weights(random_weights(spec, rope=mod.ROPE), [mod])


def _run(tiny, schedule: str, *, wait_for_save: bool = True, broken_ring: bool = False):
    """Pooled bytes and the cache's bytes per step (each step writes and saves its own block)."""
    from graphgen.npu.run.inputs import kv_buffers, tiny_step
    from graphgen.npu.standin.streams import ModelledStream, ModelledStreams
    from graphgen.runtime.core.kvcache import BlockAllocator, PagedKVCache, pack_block, token_shapes
    from graphgen.runtime.engine.connector import KVConnector
    from graphgen.runtime.pool import HostPool
    import dataclasses

    spec, mod, W = tiny
    L = spec.dims.num_hidden_layers
    shapes = {k: (spec.kv_cache.block_size, *v) for k, v in token_shapes(spec.family, dataclasses.asdict(spec.dims)).items()}
    cache = PagedKVCache(L, shapes, NB, dtype=getattr(torch, mod.KV_DTYPE))
    kv = [tuple(t.view(t.shape[0], *s) for t, s in zip(layer, mod.KV_SHAPES)) for layer in cache]
    pool = HostPool(1 << 30)
    alloc = BlockAllocator(NB)
    assert alloc.alloc(STEPS) == list(range(STEPS))  # the steps' blocks (pinned while their save is in flight)
    connector = KVConnector(pool, cache, alloc, write="async")
    main = ModelledStream("main") if schedule == "save_late" else None  # else the caller (synchronous forward)
    streams = ModelledStreams(main)
    slots = CommitPath.slots([kv_buffers(mod, L, 0, staging_rows=2)[1] for _ in range(STEPS)], streams)
    path = CommitPath(_ReusedBeforeCopied(slots) if broken_ring else StagingRing(slots), streams,
                      wait_for_save=wait_for_save)
    copy_gates = [threading.Event() for _ in range(STEPS)]
    try:
        with torch.no_grad():
            for step in range(STEPS):
                b = tiny_step(mod, spec, [(0, 7)], NB, seed=step)  # new content every step
                b.kv_index[:, 0] += step                            # written into this step's own block
                b.save_block_ids = torch.tensor([step])
                b.save_rows = torch.arange(1).view(-1, 1)
                forward_gate = threading.Event()
                if schedule == "copy_late":
                    path.copy_stream.run(copy_gates[step].wait)     # hold this step's copies
                else:
                    main.run(forward_gate.wait)                     # hold this step's forward (and save)

                def graph(staging, b=b):
                    if main is None:
                        return mod.forward(W, b, kv, staging)
                    main.run(lambda: mod.forward(W, b, kv, staging))

                path.save_call(connector, [step], [f"k{step}"], graph)
                if schedule == "copy_late" and step:
                    copy_gates[step - 1].set()  # step k's copies run only after step k+1's forward ran
                if schedule == "save_late":
                    probe = streams.event()
                    probe.record(path.copy_stream)  # reached once the copies ran (never before the save
                    try:                            # when the copy stream waits on it)
                        probe.synchronize(timeout=0.2)
                    except TimeoutError:
                        pass
                    forward_gate.set()
            copy_gates[-1].set()
            connector.drain(timeout=60)
            if main is not None:
                done = streams.event()
                done.record(main)
                done.synchronize()
    finally:
        for g in copy_gates:
            g.set()
        path.close()
        if main is not None:
            main.close()
        connector.close()
    return {s: pool.get(f"k{s}") for s in range(STEPS)}, {s: pack_block(cache, s) for s in range(STEPS)}


def _own(pooled, expected):
    return all(pooled[s] is not None and pooled[s] == expected[s] for s in expected)


@pytest.mark.parametrize("schedule", ["copy_late", "save_late"])
def test_overlapping_steps_pool_their_own_blocks(tiny, schedule):
    pooled, expected = _run(tiny, schedule)
    assert _own(pooled, expected)
    assert len({expected[s] for s in expected}) == STEPS  # the steps' blocks differ: a mix-up shows


def test_negative_control_copy_stream_not_waiting_on_the_save_event(tiny):
    pooled, expected = _run(tiny, "save_late", wait_for_save=False)
    assert not _own(pooled, expected)


def test_negative_control_slot_reused_before_its_copy_completed(tiny):
    pooled, expected = _run(tiny, "copy_late", broken_ring=True)
    assert not _own(pooled, expected)


def test_ring_never_blocks_the_launch_it_raises_when_too_small():
    ring = StagingRing([object()])
    ring.acquire()
    with pytest.raises(StagingExhausted):
        ring.acquire()
