"""A device that holds no data but keeps a ledger of its bytes: meta tensors plus accounting.

Inside ``with Ledger(capacity):`` every tensor created on the ``meta`` device, by any torch op (``empty``,
``zeros``, ``cat``, ``contiguous``, ``.to("meta")``, ...: a ``TorchDispatchMode`` sees them all), is charged
its storage's bytes when the storage is born and credited when it dies (a finalizer on the storage, so a
view keeps its base's bytes alive, as on a real device). A copy from the host into a non-contiguous meta
view is charged, for the copy, a contiguous temporary of the view's size (what a device copy through the
host does: ATen's copy into a strided device tensor stages the data contiguous on the device first).
``hold(n)`` charges memory that is not a tensor (a communicator's buffers). An allocation past the
capacity raises `DeviceOutOfMemory`, as the NPU's allocator would; ``peak`` is the high-water mark.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["Ledger", "DeviceOutOfMemory"]

GIB = 1 << 30


class DeviceOutOfMemory(RuntimeError):
    """An allocation on the ledger device past its capacity (what the NPU's allocator raises)."""


class Ledger(TorchDispatchMode):
    """See the module doc. ``capacity``: bytes the device gives its tensors (None: no limit)."""

    def __init__(self, capacity: int | None = None):
        super().__init__()
        self.capacity = capacity
        self.live = 0
        self.peak = 0
        self.allocations = 0
        self._storages: dict[int, int] = {}

    def _charge(self, n: int, what: str) -> None:
        if self.capacity is not None and self.live + n > self.capacity:
            raise DeviceOutOfMemory(
                f"ledger device out of memory: tried to allocate {n / GIB:.2f} GiB ({what}) with "
                f"{self.live / GIB:.2f} GiB already allocated of {self.capacity / GIB:.2f} GiB")
        self.live += n
        self.peak = max(self.peak, self.live)

    def _release(self, key: int) -> None:
        self.live -= self._storages.pop(key, 0)

    def hold(self, n: int, what: str = "held") -> None:
        """Charge ``n`` bytes that are not a tensor (kept until the ledger is dropped)."""
        self._charge(n, what)

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._storages:
            return  # a view of a tensor already charged
        n = storage.nbytes()
        self._charge(n, f"a {str(t.dtype).removeprefix('torch.')} tensor of shape {list(t.shape)}")
        self._storages[key] = n
        self.allocations += 1
        weakref.finalize(storage, self._release, key)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ to keep Dynamo out of it, importing torch._dynamo (~4 s) at
        # the first op; the ledger never runs under torch.compile (torch's documented opt-out)
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            if dst.device.type == "meta" and src.device.type != "meta" and not dst.is_contiguous():
                n = dst.numel() * dst.element_size()
                self._charge(n, "the contiguous temporary of a copy into a strided view")
                self.live -= n
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                self._track(t)
        return out
