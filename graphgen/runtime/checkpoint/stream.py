"""A rank's weights streamed from the checkpoint files to its device, one stored slice at a time.

`CheckpointWeights` names what a rank loads (a checkpoint folder, the graph weight names its modules
read, its `RankSlicing`); `stream_weights` executes the load plan (`graphgen.runtime.checkpoint.plan`):
for each final tensor it allocates the destination on the device (in the device dtype), then reads each
stored slice it needs into one reused host buffer (`SliceReader`: positioned reads of exactly the
slice's bytes, in the checkpoint's dtype) and copies it into its place (``copy_`` converts the dtype
where the device keeps a key in float32). Host memory: the largest slice plus a bounded read-block
buffer, whatever the model's size; device memory: the final weights, plus the copy's own temporary
where a destination view is not contiguous (one slice).

Why not ``safetensors.safe_open(...).get_slice``: for PyTorch it indexes a view of the whole file's
memory map, so every page a slice touches stays resident until the file is closed -- a 2 GiB row slice
of a 4 GiB tensor peaked at 4.3 GiB RSS, a column slice at 6.4 GiB (safetensors 0.8.0, measured with
``/usr/bin/time -v`` here); a shard holds ~4 GB. Positioned reads into a buffer keep only the buffer.

A slice along the first dim (or of a tensor whose leading dims are 1) is one contiguous range; a slice
along a later dim is read row by row where a row's range is at least 1 MiB, else as whole rows in blocks of
at most 64 MiB with the range copied out (``bytes_read`` counts the whole rows). File holes read as zeros,
as the kernel returns them: the reader finds them with ``SEEK_DATA``/``SEEK_HOLE`` and zeroes the buffer
there without a read (not at all where it already holds zeros), which keeps sparse checkpoints
(``scripts/sparse_checkpoint.py``) fast. The copy to the device is synchronous from pageable memory, so
the buffer is free again when ``copy_`` returns.

FP8 checkpoints: a slice of an FP8 weight is dequantized on the host before its copy (`dequantize_blocks`:
fp8 x its block's scale, in float32, after DeepSeek-V3's ``inference/kernel.py`` ``weight_dequant``), its
scale blocks read first (a small tensor, copied out of the buffer). A W8A8 placement's slices are then
quantized row by row (the ``quantize`` the caller passes: `graphgen.runtime.core.quant.quantize_rows`) into
the int8 weight and its scales. On a ``meta`` device (the dry run) the arithmetic is skipped: the bytes
are read and the copies made, with empty host tensors of the right shapes.
"""

from __future__ import annotations

import errno
import math
import os
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional

import torch

from .index import ITEMSIZE, CheckpointIndex, Stored
from .plan import TORCH_DTYPE, Fill, Placement, RankSlicing, plan_weights

__all__ = ["CheckpointWeights", "SliceReader", "stream_weights", "READ_BLOCK_BYTES", "dequantize_blocks"]

# quantize(weight [.., out, in], scale dtype) -> (int8 weight, scales [.., out]): a W8A8 placement's rows
Quantize = Callable[[torch.Tensor, torch.dtype], tuple[torch.Tensor, torch.Tensor]]

READ_BLOCK_BYTES = 64 << 20  # rows of a strided slice are read in blocks of at most this many bytes


@dataclass(frozen=True)
class CheckpointWeights:
    """A rank's weights, not yet read: checkpoint folder ``path``, the graph weight names its modules
    read (``key[d<dim>/<parts>]``), its chunk of each split (`RankSlicing`), the spec's MTP layers."""
    path: str
    names: frozenset
    slicing: RankSlicing = RankSlicing()
    mtp_layers: int = 0

    @classmethod
    def whole(cls, path, spec) -> "CheckpointWeights":
        """Every tensor of ``spec``'s model as one process holds it (tp 1, experts stacked, MTP layers
        included): the keys `load_hf_weights` gives, not read yet."""
        from ...families import FAMILIES

        fam = FAMILIES[spec.family]
        mtp = {"mtp_layers": spec.mtp_layers} if spec.mtp_layers else {}
        layout = fam.checkpoint_layout(fam.dims_of(spec.dims), stacked=True, **mtp)
        return cls(str(path), frozenset(k for k, s in layout.items() if 0 not in s), RankSlicing(), spec.mtp_layers)

    def index(self) -> CheckpointIndex:
        return CheckpointIndex.open(self.path, self.mtp_layers)

    def plan(self, recipes: Mapping, dtype_of: Optional[Callable[[str], Optional[str]]] = None) -> list[Placement]:
        return plan_weights(self.index(), self.names, recipes, self.slicing, dtype_of)

    def place(self, recipes: Mapping, dtype_of: Optional[Callable[[str], Optional[str]]] = None, device=None, *,
              progress: Optional[Callable[[int, int], None]] = None,
              reader: Optional["SliceReader"] = None, quantize: Optional[Quantize] = None) -> dict[str, torch.Tensor]:
        """Read and place this rank's weights (`stream_weights` of `plan`): what
        `graphgen.runtime.core.weights.place_weights` calls for a checkpoint."""
        return stream_weights(self.plan(recipes, dtype_of), device, reader=reader, progress=progress,
                              quantize=quantize)


class SliceReader:
    """Reads stored tensors, or one dim's range of them, into one reused host buffer (see the module
    doc). ``bytes_read``: bytes the slices asked for (a strided slice reads its rows whole);
    ``buffer_bytes``: the host memory it holds (the largest slice + the read block)."""

    def __init__(self, block_bytes: int = READ_BLOCK_BYTES):
        self.block_bytes = block_bytes
        self._fds: dict[str, int] = {}
        self._buf = torch.empty(0, dtype=torch.uint8)
        self._block = torch.empty(0, dtype=torch.uint8)
        self._zeros = {"_buf": 0, "_block": 0}  # leading bytes of each buffer known to be zero (a hole read)
        self.bytes_read = 0

    @property
    def buffer_bytes(self) -> int:
        return self._buf.numel() + self._block.numel()

    def _fd(self, path: str) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        return self._fds[path]

    def _take(self, attr: str, n: int) -> torch.Tensor:
        """Buffer ``attr`` with room for ``n`` bytes (the old one freed first: never two at once)."""
        if getattr(self, attr).numel() < n:
            setattr(self, attr, torch.empty(0, dtype=torch.uint8))
            setattr(self, attr, torch.empty(n, dtype=torch.uint8))
            self._zeros[attr] = 0
        return getattr(self, attr)

    @staticmethod
    def _next_data(fd: int, pos: int, end: int) -> int:
        """The first byte at or after ``pos`` that is not in a hole (``end`` when none before it)."""
        try:
            return min(os.lseek(fd, pos, os.SEEK_DATA), end)
        except OSError as e:  # ENXIO: only a hole after pos; anything else (no SEEK_DATA here): all data
            return end if e.errno == errno.ENXIO else pos

    def _hole(self, fd: int, offset: int, n: int) -> bool:
        """Whether the file's ``[offset, offset + n)`` is one hole (no data: reads as zeros)."""
        return self._next_data(fd, offset, offset + n) >= offset + n

    def _pread(self, fd: int, attr: str, start: int, n: int, offset: int) -> None:
        """Fill bytes ``[start, start + n)`` of buffer ``attr`` with the file's bytes at ``offset``: the data
        read, the holes zeros (written only where the buffer is not known to hold zeros already)."""
        buf = getattr(self, attr)
        self.bytes_read += n
        pos, end = offset, offset + n
        while pos < end:
            data = self._next_data(fd, pos, end)
            if data > pos:  # a hole: zeros
                a, b = start + pos - offset, start + data - offset
                if b > self._zeros[attr]:
                    buf[a:b].zero_()
                    if a <= self._zeros[attr]:
                        self._zeros[attr] = b
                pos = data
                continue
            try:
                stop = min(os.lseek(fd, pos, os.SEEK_HOLE), end)
            except OSError:
                stop = end
            a = start + pos - offset
            self._zeros[attr] = min(self._zeros[attr], a)
            view = memoryview(buf[a:a + stop - pos].numpy())
            done = 0
            while done < stop - pos:
                got = os.preadv(fd, [view[done:]], pos + done)
                if got <= 0:
                    raise OSError(f"short read at byte {pos + done} of a checkpoint file")
                done += got
            pos = stop

    def read(self, src: Stored, narrow: Optional[tuple[int, int, int]] = None) -> torch.Tensor:
        """``src`` (or its ``narrow`` = (dim, start, length) range) in its stored dtype, a view of the
        reader's buffer: valid until the next ``read``."""
        shape = list(src.shape)
        dim, start, length = narrow if narrow is not None else (0, 0, shape[0] if shape else 1)
        isz = ITEMSIZE[src.dtype]
        outer, inner = math.prod(shape[:dim]), math.prod(shape[dim + 1:]) * isz
        n = outer * length * inner
        out = self._take("_buf", n)[:n]
        fd = self._fd(src.path)
        w = length * inner  # bytes of one row's range
        if outer == 1 or narrow is None:  # one contiguous range
            self._pread(fd, "_buf", 0, n, src.begin + start * inner if outer == 1 else src.begin)
        elif w >= min(self.block_bytes, 1 << 20):  # rows long enough to read one by one
            row = shape[dim] * inner
            for r in range(outer):
                self._pread(fd, "_buf", r * w, w, src.begin + r * row + start * inner)
        elif self._hole(fd, src.begin, src.nbytes):  # short rows of a hole: the range is zeros too
            self._pread(fd, "_buf", 0, n, src.begin)
            self.bytes_read += src.nbytes - n  # (as the block reads below would)
        else:  # short rows: whole rows in blocks, the range copied out
            row = shape[dim] * inner
            per = max(1, self.block_bytes // row)
            self._take("_block", min(per, outer) * row)
            rows = out.view(outer, w)
            self._zeros["_buf"] = 0
            for r0 in range(0, outer, per):
                k = min(per, outer - r0)
                self._pread(fd, "_block", 0, k * row, src.begin + r0 * row)
                rows[r0:r0 + k].copy_(self._block[:k * row].view(k, row)[:, start * inner:start * inner + w])
        dtype = getattr(torch, TORCH_DTYPE[src.dtype])
        if narrow is not None:
            shape[dim] = length
        return out.view(dtype).view(shape)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._buf = self._block = torch.empty(0, dtype=torch.uint8)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _view(t: torch.Tensor, ops: tuple) -> torch.Tensor:
    for op in ops:
        if op[0] == "t":
            t = t.transpose(op[1], op[2])
        elif op[0] == "narrow":
            t = t.narrow(op[1], op[2], op[3])
        else:
            t = t.select(op[1], op[2])
    return t


def _scale_view(t: torch.Tensor, ops: tuple, ndim: int) -> torch.Tensor:
    """The view of a W8A8 placement's scales (the output channels: the concatenation less its last dim)
    that matches ``ops`` (a fill's view of the weight): the transposes and ranges of the input dim left out."""
    for op in ops:
        if op[0] == "narrow" and op[1] < ndim - 1:
            t = t.narrow(op[1], op[2], op[3])
        elif op[0] == "select":
            t = t.select(op[1], op[2])
            ndim -= 1
    return t


def dequantize_blocks(w: torch.Tensor, scales: torch.Tensor, block: tuple[int, int],
                      offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """An FP8 weight slice ``w`` [r, c] in float32: each element times its block's scale. ``scales`` are the
    blocks covering the slice (``[ceil((o0 + r) / b0), ceil((o1 + c) / b1)]``), ``offset`` = (o0, o1) where
    the slice starts inside its first block. DeepSeek-V3 ``inference/kernel.py`` ``weight_dequant``: block
    (i, j) of a [M, N] weight, the last ones partial, is x * s[i, j] in float32."""
    (b0, b1), (o0, o1) = block, offset
    r, c = w.shape
    s = scales.float().repeat_interleave(b0, 0)[o0:o0 + r].repeat_interleave(b1, 1)[:, o1:o1 + c]
    return w.float().mul_(s)


def _read_fill(reader: SliceReader, f: Fill, compute: Optional[torch.dtype], meta: bool) -> torch.Tensor:
    """The slice of ``f`` as the placement takes it: an FP8 one dequantized (in ``compute`` when given)."""
    if f.scale is None:
        return reader.read(f.src, f.narrow)
    scales = reader.read(f.scale.src, f.scale_narrow()).clone()  # before the weight: one buffer
    w = reader.read(f.src, f.narrow)
    if meta:
        return torch.empty(w.shape, dtype=compute or torch.float32)
    offset = [0, 0]
    if f.narrow is not None:
        offset[f.narrow[0]] = f.narrow[1] % f.scale.block[f.narrow[0]]
    out = dequantize_blocks(w, scales, f.scale.block, (offset[0], offset[1]))
    return out if compute is None else out.to(compute)


def _place(p: Placement, device, reader: SliceReader, quantize: Optional[Quantize]) -> tuple:
    """The tensor(s) of one placement: (weight,) or, W8A8, (int8 weight, scales)."""
    make = torch.zeros if p.zero else torch.empty
    dest = make(p.shape, dtype=getattr(torch, p.dtype), device=device)
    meta = dest.device.type == "meta"
    if not p.quant:
        for f in p.fills:
            _view(dest, f.view).copy_(_read_fill(reader, f, None, meta))
        return (dest,)
    if quantize is None:
        raise ValueError(f"{p.name}: a {p.quant} placement needs a quantize function")
    sdtype = getattr(torch, p.scale_dtype)
    scales = torch.zeros(p.scale_shape, dtype=sdtype, device=device)
    ndim = len(p.scale_shape) + 1
    for f in p.fills:
        w = _read_fill(reader, f, getattr(torch, p.compute), meta)
        if meta:
            q, s = torch.empty(w.shape, dtype=torch.int8), torch.empty(w.shape[:-1], dtype=sdtype)
        else:
            q, s = quantize(w.to(getattr(torch, p.compute)), sdtype)
        _view(dest, f.view).copy_(q)
        _scale_view(scales, f.view, ndim).copy_(s)
    return dest, scales


def stream_weights(plan: Iterable[Placement], device=None, *, reader: Optional[SliceReader] = None,
                   progress: Optional[Callable[[int, int], None]] = None,
                   quantize: Optional[Quantize] = None) -> dict[str, torch.Tensor]:
    """Execute ``plan`` onto ``device``: ``{name: tensor}`` (a W8A8 placement: also its scales, under
    `Placement.scale_key`). Placements that read the same bytes into the same shape and dtype (a tied
    embedding and LM head) share one tensor. ``progress(done, total)``: the placed bytes so far, before the
    first tensor and after each. ``quantize``: how a W8A8 placement's rows are quantized (see the module doc)."""
    plan = list(plan)
    own = reader is None
    reader = reader or SliceReader()
    total, done = sum(p.nbytes for p in plan), 0
    if progress is not None:
        progress(0, total)  # the total up front: the progress lines show it from the first
    out: dict[str, torch.Tensor] = {}
    same: dict[tuple, tuple] = {}
    try:
        for p in plan:
            sig = (p.shape, p.dtype, p.fills, p.zero, p.quant, p.compute)
            if sig not in same:
                same[sig] = _place(p, device, reader, quantize)
            out[p.name] = same[sig][0]
            if p.quant:
                out[p.scale_key] = same[sig][1]
            done += p.nbytes
            if progress is not None:
                progress(done, total)
    finally:
        if own:
            reader.close()
    return out
