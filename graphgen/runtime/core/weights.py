"""Weights in the dtype a target computes in, except the keys the family keeps in float32.

One home for the rule every engine applies (the CPU target, a CPU rank, the NPU runner): matrices and
norms take the compute dtype (the spec's ``kv_cache.dtype`` on CPU, ``targets.npu.dtype`` on the NPU),
while the family's ``fp32_suffixes`` (DeepSeek's router weight and score-correction bias) stay float32:
routing compares sigmoid scores plus a small bias, and bf16's 8 bits of mantissa would change which
experts win. Names may carry a shard suffix (``key[d0/2]``): the rule reads the checkpoint key.

And the load-time weights both targets' generated modules declare (``LOAD_TIME_WEIGHTS``, emitted by
`graphgen.lower.render.load_time_weight`): ``{key: {"cat": (sources...), "dim": d, "transpose12": bool[,
"transpose01": True]}}``, built once when the weights are loaded instead of every forward. The CPU
modules merge q/k/v and gate/up and store every dense projection as ``[in, out]`` (``transpose01``): a
decode row's projection is then a GEMV that streams the weight's rows (``x @ W^T`` on a contiguous
``W^T``), measured 1.17-1.41x faster than ``F.linear`` on the ``[out, in]`` checkpoint layout for the
8-layer bench model on one thread, prefill GEMMs within the spread (BENCHMARKS.md, issue 17 (d): the
``floor`` / ``floor-t`` rows of ``benchmarks/bench_cpu_kernels.py``). The
NPU layouts are described in `graphgen.npu.run.weights`.

`place_weights` is the one entry every engine loads through (the CPU target and its ranks, the NPU
runner, the dry run): a dict of tensors is cast and built recipe by recipe, each recipe's sources freed
after its last use (device peak: the final weights + the largest recipe, not + every recipe); a
checkpoint not yet read (`graphgen.runtime.checkpoint.stream.CheckpointWeights`) is streamed slice by
slice straight into the final tensors (`graphgen.runtime.checkpoint.plan`): no load-time peak at all.

A recipe with ``"quant": "w8a8_dynamic"`` (a linear layer of a W8A8 spec, `graphgen.ir.quant`) is built int8,
its scales beside it as ``W[key + ':scale']`` (`build_quantized_weight`; streamed: slice by slice).
"""

from __future__ import annotations

import ast
from typing import Callable, Iterable, Mapping, Optional

import torch

from ...families import FAMILIES
from ...ir.quant import SCALE_SUFFIX, scale_dtype, scale_name
from ...ir.weights import parse_shard
from ..progress import Progress, current_progress
from .quant import quantize_rows

__all__ = ["keeps_fp32", "cast_weights", "load_time_weights", "build_load_time_weight", "build_quantized_weight",
           "collect_recipes",
           "place_weights", "load_progress", "source_constants"]


def keeps_fp32(family: str, name: str) -> bool:
    """Whether weight ``name`` (a checkpoint key, or a graph name with a shard suffix) stays float32."""
    keep = FAMILIES[family].fp32_suffixes
    return bool(keep) and parse_shard(name)[0].endswith(keep)


def cast_weights(weights: Mapping[str, torch.Tensor], family: str, dtype: torch.dtype,
                 device: Optional[torch.device] = None) -> dict[str, torch.Tensor]:
    """``weights`` in ``dtype`` (on ``device``), the family's float32 keys in float32; W8A8's int8 weights and
    their scales (placed already: `graphgen.ir.quant`) keep their dtypes."""
    return {k: v.to(device=device) if not v.is_floating_point() or k.endswith(SCALE_SUFFIX) else
            v.to(device=device, dtype=torch.float32 if keeps_fp32(family, k) else dtype) for k, v in weights.items()}


def build_quantized_weight(sources: list, *, dim: int, transpose12: bool, transpose01: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """A W8A8 recipe (`graphgen.ir.quant`): the concatenation quantized row by row (its last dim is the
    input: one scale per output channel, in `scale_dtype` of the sources' dtype), then laid out as the
    recipe says. Returns (int8 weight, scales)."""
    cat = build_load_time_weight(sources, dim=dim, transpose12=False)
    q, scale = quantize_rows(cat, getattr(torch, scale_dtype(str(cat.dtype).removeprefix("torch."))))
    if transpose12 or transpose01:
        q = build_load_time_weight([q], dim=0, transpose12=transpose12, transpose01=transpose01)
    return q, scale


def build_load_time_weight(sources: list, *, dim: int, transpose12: bool, transpose01: bool = False) -> torch.Tensor:
    """One recipe: ``cat(sources, dim)``, then made contiguous — transposed ``(1, 2)`` when ``transpose12``,
    ``(0, 1)`` when ``transpose01``. One allocation: each source is copied straight to its place in the
    result (not a concatenation and then its transposed copy: two results' worth of memory at once)."""
    first = sources[0]
    if len(sources) == 1 and not (transpose12 or transpose01):
        return first.contiguous()
    shape = list(first.shape)
    shape[dim] = sum(s.shape[dim] for s in sources)
    if transpose12:
        shape[1], shape[2] = shape[2], shape[1]
    if transpose01:
        shape[0], shape[1] = shape[1], shape[0]
    out = torch.empty(shape, dtype=first.dtype, device=first.device)
    view = out.t() if transpose01 else out  # the concatenation's coordinates, as a view of the result
    view = view.transpose(1, 2) if transpose12 else view
    offset = 0
    for s in sources:
        view.narrow(dim, offset, s.shape[dim]).copy_(s)
        offset += s.shape[dim]
    return out


def collect_recipes(modules: Iterable) -> dict:
    """Every module's ``LOAD_TIME_WEIGHTS``, each key once (``ValueError`` when two modules disagree on
    one). A module may be given as its source text (the literal is read, nothing is executed)."""
    recipes: dict = {}
    for mod in modules:
        for key, r in (_recipes_in(mod) if isinstance(mod, str) else getattr(mod, "LOAD_TIME_WEIGHTS", {})).items():
            if recipes.setdefault(key, r) != r:
                raise ValueError(f"modules disagree on load-time weight {key!r}: {recipes[key]} vs {r}")
    return recipes


def _recipes_in(source: str) -> dict:
    return source_constants(source, ("LOAD_TIME_WEIGHTS",)).get("LOAD_TIME_WEIGHTS", {})


def source_constants(source: str, names) -> dict:
    """The values of a generated module's top-level literal constants ``NAME = ...`` among ``names``, read
    from its source, not executed: each statement is parsed alone (a full-size module is thousands of
    lines; its constants come first), the scan stops once every name is found."""
    out, lines, names = {}, source.splitlines(keepends=True), set(names)
    for i, line in enumerate(lines):
        name = line.split(" = ", 1)[0] if " = " in line and line[:1].isidentifier() else None
        if name in names:
            j = i + 1
            while j < len(lines) and (not lines[j].strip() or lines[j][0] in " \t}])"):
                j += 1
            node = ast.parse("".join(lines[i:j])).body[0]
            if not isinstance(node, ast.Assign):
                raise ValueError(f"{name} of a generated module is not a NAME = literal statement")
            out[name] = ast.literal_eval(node.value)
            if len(out) == len(names):
                break
    return out


def load_time_weights(W: Mapping[str, torch.Tensor], modules: Iterable, *,
                      consume: bool = False) -> dict[str, torch.Tensor]:
    """``W`` with every module's ``LOAD_TIME_WEIGHTS`` built (each once, however many modules share it)
    and their sources removed (the modules read only the built keys, so each weight is held once).
    A source missing from ``W`` is a ``KeyError`` naming the recipe. ``consume``: ``W`` is a dict nobody
    else holds: it is updated in place and each source is dropped right after the last recipe reading
    it, so at most one recipe's sources and result coexist (what a device's load peak is)."""
    recipes = collect_recipes(modules)
    out = W if consume and isinstance(W, dict) else dict(W)
    last = {s: key for key, r in recipes.items() for s in r["cat"]}  # the last recipe reading each source
    for key, r in recipes.items():
        if key in out:
            continue  # already built (W given twice)
        missing = [s for s in r["cat"] if s not in out]
        if missing:
            raise KeyError(f"load-time weight {key!r} needs {missing}, which the weights do not have")
        build = build_quantized_weight if r.get("quant") else build_load_time_weight
        built = build([out[s] for s in r["cat"]], dim=r["dim"], transpose12=r["transpose12"],
                      transpose01=r.get("transpose01", False))
        if r.get("quant"):  # the int8 weight and its scales (graphgen.ir.quant)
            out[key], out[scale_name(key)] = built
        else:
            out[key] = built
        if consume:
            for s in r["cat"]:
                if last[s] == key:
                    del out[s]
    for r in recipes.values():
        for s in r["cat"]:
            out.pop(s, None)
    return out


def load_progress(report: Optional[Progress] = None) -> Callable[[int, int], None]:
    """``progress(done, total)`` (bytes placed so far, of all) as the ``load`` phase of ``report`` (default:
    this process's, `graphgen.runtime.progress.current_progress`: a rank's goes to its launcher, whose
    `Board` prints bytes loaded / total and GB/s per rank; one process's is a board on stderr)."""
    report = report if report is not None else current_progress()
    seen = [0]

    def update(done: int, total: int) -> None:
        report.phase("load", total)  # in the load phase already (a rank): only its total is set
        report.advance(done - seen[0])
        seen[0] = done

    return update


def place_weights(weights, modules: Iterable, *, family: str, dtype: torch.dtype, device=None,
                  progress: Optional[Callable[[int, int], None]] = None, reader=None) -> dict[str, torch.Tensor]:
    """What a runner reads as ``W``: ``weights`` (a dict by graph weight name, or a checkpoint to stream:
    anything with ``place(recipes, dtype_of, device, progress=)``, `CheckpointWeights`) in ``dtype`` on
    ``device`` (the family's float32 keys float32), the modules' load-time weights built and their
    sources gone. ``progress(done, total)``: bytes placed (default: the process's load phase,
    `load_progress`); ``reader``: the `SliceReader` to read with (streaming only: a dry run counts its
    bytes). See the module doc for the device peak of each."""
    place = getattr(weights, "place", None)  # a checkpoint not read yet (checkpoint.stream.CheckpointWeights)
    if place is not None:
        name = str(dtype).removeprefix("torch.")
        return place(collect_recipes(modules), lambda k: "float32" if keeps_fp32(family, k) else name, device,
                     progress=progress if progress is not None else load_progress(), reader=reader,
                     quantize=quantize_rows)
    return load_time_weights(cast_weights(weights, family, dtype, device), modules, consume=True)
