"""The NPU commit path: the saved blocks from the graph's device staging to the pool, off the
critical path and safe when steps overlap (audit 2 rows 4, 7, 8; issue 15 item 7).

A saving graph copies the blocks it saves into a ``staging`` graph input on its save stream (in the
graph, joined to the main stream before the logits: the save join). After the graph:

1. the runner records the **save event** on the current (main) stream after the graph call;
2. a dedicated **copy stream** waits on that event, then issues **one** ``non_blocking`` D2H copy
   per (layer, component) over all saved rows, from the slot's device staging into the slot's
   **pinned host ring** memory, and records its own **copy event**;
3. the connector (`graphgen.runtime.engine.connector.KVConnector`: inline for ``write: sync``, on its
   host stream for ``async``) waits for the copy event, then puts each block from the host rows
   (no device-side connector staging, no per-block device copy);
4. the ring slot (its device staging and its host rows) is free again only when its copy completed
   **and** its puts finished (the connector's ``on_committed``).

``StagingRing``: a fixed set of K persistent slots (fixed addresses: aclgraph replays a capture only
while its mutated inputs keep their addresses); ``acquire`` never waits (it raises when every slot is
in flight; `CommitPath` then waits for the connector's oldest commit).

The launch never waits for a commit: ``submit`` returns once the copies are issued. Nothing here
ran on an NPU. On the CPU stand-in the copy stream and the events are **modelled**
(`graphgen.npu.standin.streams`: a host thread per stream, FIFO, cross-stream waits), and the host
ring is ordinary pageable memory (CPU torch refuses ``pin_memory=True``): the ordering logic is
exercised (tests/npu/test_staging.py, overlapping steps with gated streams), the NPU's streams,
pinned memory and asynchronous D2H are not. vllm-ascend's alternative (put straight from registered
device addresses, no D2H in Python) would need a pool that takes device memory; see docs/npu.md.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

__all__ = ["StagingExhausted", "StagingRing", "RingSlot", "NpuStreams", "DeviceBinding", "CopyDone", "CommitPath"]


class StagingExhausted(RuntimeError):
    """Every ring slot still has a commit in flight: K is smaller than the commits in flight + 1."""


class StagingRing:
    def __init__(self, buffers: Sequence):
        if not buffers:
            raise ValueError("StagingRing needs at least one staging buffer set")
        self.buffers = list(buffers)
        self._free = list(range(len(self.buffers)))
        self._lock = threading.Lock()

    def acquire(self) -> tuple[int, object]:
        """A slot no commit is using; never blocks."""
        with self._lock:
            if not self._free:
                raise StagingExhausted(f"all {len(self.buffers)} staging buffers have a commit in flight; "
                                       f"use more buffers (commits in flight + 1)")
            i = self._free.pop(0)
        return i, self.buffers[i]

    def release(self, index: int) -> None:
        with self._lock:
            if index in self._free:
                raise ValueError(f"staging buffer {index} released twice")
            self._free.append(index)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self.buffers) - len(self._free)


@dataclass(frozen=True)
class RingSlot:
    """One ring slot: per layer a tuple of ``[S, *KV_SHAPES[i]]`` tensors on the device (the graph's
    ``staging`` input) and the same shapes in pinned host memory (the D2H target the puts read)."""
    device: list
    host: list


class NpuStreams:
    """The commit path's device interface on an NPU (torch_npu's CUDA-like stream API). Never run:
    no NPU here; `graphgen.npu.standin.streams.ModelledStreams` models it on the stand-in."""

    modelled = False

    def __init__(self):
        import torch

        self._npu = torch.npu  # type: ignore[attr-defined]  (torch_npu registers torch.npu)
        self._torch = torch

    def current_stream(self):
        return self._npu.current_stream()

    def new_stream(self, name: str):
        return self._npu.Stream()

    def event(self):
        return self._npu.Event()

    def wait(self, stream, event) -> None:
        stream.wait_event(event)

    def copy(self, stream, dst, src) -> None:
        with self._npu.stream(stream):
            dst.copy_(src, non_blocking=True)  # pinned dst: an async D2H on ``stream``

    def gather(self, stream, dst, src, index) -> None:
        """``dst[:] = src[index]`` (rows, on the device) issued on ``stream``."""
        with self._npu.stream(stream):
            self._torch.index_select(src, 0, index, out=dst)

    def host_empty(self, shape, dtype):
        return self._torch.empty(tuple(shape), dtype=dtype, pin_memory=True)


class DeviceBinding:
    """Every thread that touches NPU objects sets its device first (audit 3 N7). torch_npu's current
    device is per thread, as CUDA's: a thread that never set it works on device 0, so rank r > 0 would
    open a second context on NPU 0 or find no context for its events (vllm-ascend #12200, #8041). The
    runner's thread and the connector's commit thread (it synchronizes the copy events) call `ensure`
    before touching a device object; the first call in a thread sets the device. ``bound``: the
    threads (idents) that set it."""

    def __init__(self, index: int, set_device: Callable[[int], None]):
        self.index, self._set = index, set_device
        self._local = threading.local()
        self.bound: set[int] = set()

    def ensure(self) -> None:
        if getattr(self._local, "set", False):
            return
        self._set(self.index)
        self._local.set = True
        self.bound.add(threading.get_ident())


class CopyDone:
    """A slot's copies as the connector waits on them (its `SaveHandle`): the copy event, synchronized
    by a thread bound to the device (``binding``, `DeviceBinding`)."""

    def __init__(self, event, binding: Optional[DeviceBinding] = None):
        self._event, self._binding = event, binding

    def wait(self, timeout: Optional[float] = None) -> None:
        if self._binding is not None:
            self._binding.ensure()
        self._event.synchronize()

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        try:
            if self._binding is not None:
                self._binding.ensure()
            self._event.synchronize()
        except BaseException as e:  # the connector counts it (save_failures); nothing is put
            return e
        return None


class CommitPath:
    """The ring, the copy stream and the hand-off to the connector (see the module doc).

    ``wait_for_save=False`` drops the copy stream's wait on the save event: only for the negative
    control of tests/npu/test_staging.py (the copies may then read a slot the save has not written)."""

    def __init__(self, ring: StagingRing, streams, *, wait_for_save: bool = True,
                 binding: Optional[DeviceBinding] = None):
        self.ring, self.streams, self.wait_for_save, self.binding = ring, streams, wait_for_save, binding
        self.copy_stream = streams.new_stream("kv_copy")
        self.filled_saves = 0  # blocks saved by save_filled (decode-time saves, write-backs)

    @staticmethod
    def slots(device_buffers: Sequence[list], streams) -> list[RingSlot]:
        """One slot per device staging set, its host rows allocated once (pinned on an NPU)."""
        return [RingSlot(dev, [tuple(streams.host_empty(t.shape, t.dtype) for t in layer) for layer in dev])
                for dev in device_buffers]

    def save_call(self, connector, block_ids: Sequence[int], keys: Sequence[str], graph: Callable[[list], object]):
        """One saving graph call: take a slot, pin the blocks, run ``graph(slot.device)``, record the
        save event after it, issue the slot's copies and hand the save to the connector (which puts
        after the copy event and then frees the slot). Returns what ``graph`` returned."""
        idx, slot = self._acquire(connector)
        n = len(block_ids)
        try:
            pending = connector.prepare_save(block_ids, keys, staging=self._host_views(connector, slot, n),
                                             on_committed=lambda: self.ring.release(idx))
        except BaseException:
            self.ring.release(idx)
            raise
        try:
            out = graph(slot.device)
            saved = self.streams.event()
            saved.record(self.streams.current_stream())  # after the graph: covers its save (the join)
            done = self._copy(slot, n, saved)
        except BaseException:
            connector.cancel(pending)  # frees the slot: nothing was copied from it
            raise
        connector.handoff(pending, done, done)
        return out

    def save_filled(self, connector, block_ids: Sequence[int], keys: Sequence[str], kv: list) -> None:
        """Blocks a landed step filled (decode-time saves, write-backs: audit 3 N8), through the same
        path as a saving graph's, never a synchronous pageable copy per (layer, component, block): per
        ring slot (at most its rows), the blocks are pinned, the copy stream waits for the current
        stream's work (the steps that wrote them), gathers them from the device cache ``kv`` (the
        runner's per-layer views) into the slot's device staging, issues its D2H copies, and the
        connector puts after the copy event and frees the slot (`KVConnector.handoff`)."""
        import torch

        rows = self.ring.buffers[0].device[0][0].shape[0]
        for start in range(0, len(block_ids), rows):
            ids, ks = list(block_ids[start:start + rows]), list(keys[start:start + rows])
            idx, slot = self._acquire(connector)
            try:
                pending = connector.prepare_save(ids, ks, staging=self._host_views(connector, slot, len(ids)),
                                                 on_committed=lambda i=idx: self.ring.release(i))
            except BaseException:
                self.ring.release(idx)
                raise
            try:
                landed = self.streams.event()
                landed.record(self.streams.current_stream())
                index = torch.tensor(ids, dtype=torch.int64, device=kv[0][0].device)
                done = self._copy(slot, len(ids), landed, gather=(kv, index))
            except BaseException:
                connector.cancel(pending)
                raise
            connector.handoff(pending, done, done)
            self.filled_saves += len(ids)

    @staticmethod
    def _host_views(connector, slot: RingSlot, n: int) -> list:
        """The slot's host rows as the connector's staging: per layer, per component ``[n, *block shape]``."""
        return [tuple(h[:n].view(n, *shape) for h, shape in zip(layer, connector.cache.component_shapes.values()))
                for layer in slot.host]

    def _acquire(self, connector):
        while True:
            try:
                return self.ring.acquire()
            except StagingExhausted:
                # more commits in flight than slots: wait for the oldest (it frees its slot)
                if not connector.wait_oldest():
                    raise

    def _copy(self, slot: RingSlot, n: int, saved, gather=None) -> CopyDone:
        """On the copy stream, after ``saved``: (``gather`` = (kv, index): the rows into the slot's device
        staging first, then) one D2H per (layer, component) of the slot's first ``n`` rows."""
        s = self.copy_stream
        if self.wait_for_save:
            self.streams.wait(s, saved)
        if gather is not None and n:
            kv, index = gather
            for dev_layer, cache_layer in zip(slot.device, kv):
                for d, c in zip(dev_layer, cache_layer):
                    self.streams.gather(s, d[:n], c, index)
        for dev_layer, host_layer in zip(slot.device, slot.host):
            for d, h in zip(dev_layer, host_layer):
                if n:
                    self.streams.copy(s, h[:n], d[:n])  # one D2H per (layer, component), all n rows
        done = self.streams.event()
        done.record(s)
        return CopyDone(done, self.binding)

    def close(self) -> None:
        close = getattr(self.copy_stream, "close", None)  # the modelled stream's thread
        if close is not None:
            close()
