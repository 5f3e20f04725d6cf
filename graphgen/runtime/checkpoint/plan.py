"""What one rank places on its device, tensor by tensor, and which stored bytes fill each: the load plan.

A rank's modules read graph weight names (``key[d<dim>/<parts>]``: this rank's chunk of a checkpoint key,
`graphgen.ir.weights`) and load-time weights (``LOAD_TIME_WEIGHTS`` recipes: sources concatenated, then
transposed; `graphgen.runtime.core.weights`). `plan_weights` turns both into `Placement` s: the final
tensor's shape and dtype, and the `Fill` s that write it, each one stored tensor's slice (a range of one
dim, or all of it) copied into a view of the destination (a transpose, a range, an expert index). So a
merged q/k/v or a transposed expert stack is never built from device copies of its sources: each source
slice is read from the file and copied straight to where it ends up, and the device holds each final
weight once (no load-time peak), the host one slice at a time.

Chunks follow `graphgen.runtime.parallel.ops.slice_weight`: ``ceil(n / parts)`` per chunk, the last one
zero-padded (`Placement.zero`), chunk ``index`` of the rank (`RankSlicing`). A stacked expert key
(``[E, ...]``) is its experts' stored tensors: a chunk of dim 0 is whole experts (expert parallel), a
chunk of another dim the same range of every expert. Pure Python, no torch: `graphgen validate` and
the dry run read the same numbers from it.

Quantized checkpoints and weights: a fill of an FP8 tensor carries its `BlockScales` (`Fill.scale`), and
the loader dequantizes the slice it read with the scale blocks covering it (`scale_narrow`); a W8A8
load-time weight (recipe ``"quant": "w8a8_dynamic"``, `graphgen.ir.quant`) is an int8 placement with a
second tensor of scales, one per output channel (`Placement.scale_shape`: the concatenation's shape less
its input dim), which each fill's slice quantizes into row by row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional

from ...ir.quant import scale_dtype, scale_name
from ...ir.weights import parse_shard, shard_index
from .index import ITEMSIZE, BlockScales, CheckpointIndex, Stored

__all__ = ["Fill", "Placement", "RankSlicing", "plan_weights", "TORCH_DTYPE", "dtype_bytes"]

# safetensors dtype -> the torch dtype's name
TORCH_DTYPE = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
               "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
               "U8": "uint8", "BOOL": "bool"}
_BYTES = {TORCH_DTYPE[k]: v for k, v in ITEMSIZE.items()}


def dtype_bytes(name: str) -> int:
    """Bytes per element of a torch dtype name (``bfloat16`` -> 2)."""
    return _BYTES[name]


@dataclass(frozen=True)
class RankSlicing:
    """Which chunk of a ``parts``-way split a rank holds: its TP rank's, or under DP attention, for a
    split into ``ep`` parts (experts, the shared experts' width), its EP rank's (`dp_rank_weights`)."""
    tp_rank: int = 0
    tp: int = 1
    ep_rank: int = 0
    ep: int = 1

    @classmethod
    def of(cls, parallel, rank: int) -> "RankSlicing":
        """World rank ``rank`` of a spec's ``parallel:`` layout: its TP rank is innermost in the rank order;
        under DP attention its EP index is ``dp_rank × tp + tp_rank`` (the world rank at cp = 1; at cp > 1 the
        CP ranks of one DP and TP rank hold the same experts: `RankLayout.coords`)."""
        # the rank order of `graphgen.runtime.parallel.layout.RankLayout.coords` (this part may not import it:
        # tests/parallel/test_layout.py holds the two equal): rank = (dp_rank × cp + cp_rank) × tp + tp_rank
        tp_rank, dp_rank = rank % parallel.tp, rank // (parallel.cp * parallel.tp)
        return cls(tp_rank, parallel.tp, dp_rank * parallel.tp + tp_rank if parallel.dp > 1 else tp_rank, parallel.ep)

    def chunk(self, parts: int) -> int:
        if self.ep > 1 and parts == self.ep:
            return shard_index(self.ep_rank, parts, self.ep)
        return shard_index(self.tp_rank, parts, self.tp)


@dataclass(frozen=True)
class Fill:
    """Stored tensor ``src`` (all of it, or ``narrow`` = (dim, start, length) of it) copied into the view
    of the destination that ``view`` names: ops applied in order, ``("t", a, b)`` (transpose),
    ``("narrow", dim, start, length)``, ``("select", dim, index)``."""
    src: Stored
    narrow: Optional[tuple[int, int, int]]
    view: tuple
    scale: Optional[BlockScales] = None  # an FP8 tensor's block scales: the slice is dequantized with them

    def scale_narrow(self) -> Optional[tuple[int, int, int]]:
        """The range of the scale blocks covering this slice (of ``scale.src``; None: all of them)."""
        if self.scale is None or self.narrow is None:
            return None
        dim, start, length = self.narrow
        b = self.scale.block[dim]
        first = start // b
        return dim, first, -(-(start + length) // b) - first

    @property
    def shape(self) -> tuple[int, ...]:
        if self.narrow is None:
            return self.src.shape
        dim, _, length = self.narrow
        return tuple(length if d == dim else s for d, s in enumerate(self.src.shape))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.src.dtype]

    @property
    def scale_nbytes(self) -> int:
        """Bytes of the scale blocks this slice reads (0: not FP8)."""
        if self.scale is None:
            return 0
        shape = list(self.scale.src.shape)
        narrow = self.scale_narrow()
        if narrow is not None:
            shape[narrow[0]] = narrow[2]
        return math.prod(shape) * ITEMSIZE[self.scale.src.dtype]


@dataclass(frozen=True)
class Placement:
    """One tensor the modules read as ``W[name]``: ``shape``/``dtype`` (a torch dtype name), written by
    ``fills``; ``zero``: parts no fill covers are zeros (a padded last chunk)."""
    name: str
    shape: tuple[int, ...]
    dtype: str
    fills: tuple
    zero: bool = False
    # W8A8: ``dtype`` is int8, ``compute`` the dtype the weight would have had (the slices are rounded to it
    # before they are quantized, as a dict of weights in that dtype would be), and W[scale_name(name)] holds
    # the scales, ``scale_shape`` (the output channels), in `graphgen.ir.quant.scale_dtype` of ``compute``
    quant: Optional[str] = None
    compute: str = ""
    scale_shape: tuple[int, ...] = ()

    @property
    def scale_dtype(self) -> str:
        return scale_dtype(self.compute)

    @property
    def scale_key(self) -> str:
        return scale_name(self.name)

    @property
    def nbytes(self) -> int:
        """Device bytes of the placement (its scales included)."""
        scales = math.prod(self.scale_shape) * dtype_bytes(self.scale_dtype) if self.quant else 0
        return math.prod(self.shape) * dtype_bytes(self.dtype) + scales


def _chunk(index: CheckpointIndex, name: str, slicing: RankSlicing):
    """(shape, fills, zero, stored dtype) of graph weight ``name`` on this rank (fills' views relative to it)."""
    key, dim, parts = parse_shard(name)
    src = index.source(key)  # a tuple: a stack of experts, stored one by one
    full = index.shape(key)
    dtype = (src[0] if isinstance(src, tuple) else src).dtype
    if dim is None or parts == 1:
        fills = ([Fill(s, None, (("select", 0, e),)) for e, s in enumerate(src)] if isinstance(src, tuple)
                 else [Fill(src, None, ())])
        return full, fills, False, dtype
    n = full[dim]
    c = -(-n // parts)
    start = min(slicing.chunk(parts) * c, n)
    real = max(0, min(c, n - start))
    shape = tuple(c if d == dim else s for d, s in enumerate(full))
    pad = real < c
    if isinstance(src, tuple) and dim == 0:  # whole experts
        fills = [Fill(src[start + j], None, (("select", 0, j),)) for j in range(real)]
    elif isinstance(src, tuple):  # the same range of every expert (its dim - 1)
        narrow = (dim - 1, start, real)
        fills = [Fill(s, _whole(s, narrow), (("select", 0, e),) + ((("narrow", dim - 1, 0, real),) if pad else ()))
                 for e, s in enumerate(src)] if real else []
    else:
        fills = [Fill(src, _whole(src, (dim, start, real)), (("narrow", dim, 0, real),) if pad else ())] if real else []
    return shape, fills, pad, dtype


def _whole(src: Stored, narrow):
    dim, start, length = narrow
    return None if start == 0 and length == src.shape[dim] else narrow


def _recipe(index, key: str, r: Mapping, slicing) -> tuple:
    """(shape, fills, zero, stored dtype) of a load-time weight: its sources' fills behind the views that
    undo the transposes and pick the source's range of the concatenation."""
    dim = r["dim"]
    parts = [_chunk(index, s, slicing) for s in r["cat"]]
    cat = list(parts[0][0])
    cat[dim] = sum(p[0][dim] for p in parts)
    undo = ((("t", 0, 1),) if r.get("transpose01") else ()) + ((("t", 1, 2),) if r["transpose12"] else ())
    fills, offset = [], 0
    for shape, part_fills, _, _ in parts:
        into = undo + (("narrow", dim, offset, shape[dim]),)
        fills += [Fill(f.src, f.narrow, into + f.view) for f in part_fills]
        offset += shape[dim]
    final = list(cat)
    if r["transpose12"]:
        final[1], final[2] = final[2], final[1]
    if r.get("transpose01"):
        final[0], final[1] = final[1], final[0]
    return tuple(final), fills, any(p[2] for p in parts), parts[0][3], tuple(cat)


def plan_weights(index: CheckpointIndex, names: Iterable[str], recipes: Mapping[str, Mapping],
                 slicing: RankSlicing = RankSlicing(), dtype_of: Optional[Callable[[str], Optional[str]]] = None
                 ) -> list[Placement]:
    """The placements of one rank: every recipe of ``recipes`` (``{key: LOAD_TIME_WEIGHTS entry}``) and
    every name of ``names`` no recipe consumes (as `load_time_weights` drops a recipe's sources).
    ``dtype_of(name)``: the device dtype's name of a tensor (None: the checkpoint's). Ordered by where
    their first bytes lie (file, offset), so the files are read front to back. A recipe source missing
    from ``names`` is a ``KeyError`` naming the recipe."""
    names = set(names)
    consumed = {s for r in recipes.values() for s in r["cat"]}
    out = []
    for key in sorted(recipes):
        missing = [s for s in recipes[key]["cat"] if s not in names]
        if missing:
            raise KeyError(f"load-time weight {key!r} needs {missing}, which the weights do not have")
        out.append((key, recipes[key].get("quant"), *_recipe(index, key, recipes[key], slicing)))
    out += [(name, None, *_chunk(index, name, slicing), None) for name in sorted(names - consumed)]
    placements = []
    for name, quant, shape, fills, zero, stored, cat in out:
        want = (dtype_of(name) if dtype_of is not None else None) or TORCH_DTYPE[stored]
        if want.startswith("float8"):  # FP8 is a storage format: dequantized, a weight without a dtype is float32
            want = "float32"
        fills = tuple(Fill(f.src, f.narrow, f.view, index.scale_of(f.src)) for f in fills)
        if quant:
            placements.append(Placement(name, tuple(shape), "int8", fills, zero, quant, want, tuple(cat[:-1])))
        else:
            placements.append(Placement(name, tuple(shape), want, fills, zero))
    return sorted(placements, key=lambda p: (p.fills[0].src.path, p.fills[0].src.begin) if p.fills else ("", 0))
