"""Trace one generated NPU module through the CPU stand-in and check its post-AOT graph.

This proves graph *structure* only (event order, stream scopes, in-place KV/staging writes after
torchair-style re-inplacing) — never NPU behaviour: the stand-in's kernels are not Ascend kernels.
Used by ``graphgen compile --target npu --standin`` and by tests/npu.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

# (history, new tokens) per sequence for a representative step of each kind of variant.
SAMPLE_SEQS = {("prefill", False): [(0, 5), (0, 3)], ("prefill", True): [(4, 3), (2, 2)],
               ("decode", False): [(5, 1), (2, 1)], ("decode", True): [(5, 1), (2, 1)]}
NUM_BLOCKS = 8


@dataclass
class Traced:
    """One step of a module run through the stand-in: the module, its captured graph and buffers."""

    module: Any
    graph: Any  # standin's captured graph: .gm (after modelled re-inplace), .raw, .placeholder_for()
    n_graphs: int
    logits: Any
    kv: list
    staging: list
    inputs: Any

    def problems(self) -> list[str]:
        """Post-AOT KV-save structure problems (empty when the graph saves nothing)."""
        from ..check import aotcheck

        problems = []
        if self.module.META["saves"]:
            caches = [self.graph.placeholder_for(t) for layer in self.kv for t in layer]
            stagings = [self.graph.placeholder_for(t) for layer in self.staging for t in layer]
            problems = aotcheck.check_kv_save_graph(self.graph.gm, caches, stagings)
            problems += aotcheck.check_save_join(self.graph.gm, self.module.GRAPH)
        if "aten.copy_" in self.graph.gm.code:
            problems.append("a write into a graph input survived as aten.copy_ (functionalisation epilogue)")
        return problems


def trace(module_path: str | Path, spec, source: Optional[str] = None, *, check_limits: bool = False) -> Traced:
    """Load (with fresh tagged-event tags), compile with the stand-in, run one sample step.

    ``check_limits``: enforce the documented kernel limits (``graphgen.npu.check.limits``).  Off by default
    because this is a STRUCTURE check and the tiny test specs (float32, block size 4, head_dim 16) are
    outside the hardware envelope by construction; ``graphgen.npu.run.bucketing.run_standin_loop`` and the
    limits tests trace with them on."""
    import torch

    from ..standin import fakes as standin
    from .compile import compile_module, load_module
    from .inputs import kv_buffers, load_buffers, random_weights, tiny_step

    if not standin.install():
        raise RuntimeError("torch_npu is installed: use the real torchair, not the CPU stand-in")
    try:
        with standin.enforce_limits(check_limits), standin.fresh_tags():
            mod = load_module(Path(module_path), source)
            target, backend = compile_module(mod, mod.COMPILE_MODE, use_standin=True)
        meta = mod.META
        b = tiny_step(mod, spec, SAMPLE_SEQS[(meta["phase"], bool(meta["history"]))], NUM_BLOCKS)
        kv, staging = kv_buffers(mod, spec.dims.num_hidden_layers, NUM_BLOCKS,
                                 staging_rows=NUM_BLOCKS if meta["saves"] else 0)
        loads = load_buffers(mod, spec.dims.num_hidden_layers,
                             0 if b.load_rows is None else b.load_rows.shape[0])
        from .weights import load_time_weights

        W = load_time_weights(random_weights(spec, rope=mod.ROPE), [mod])
        torch._dynamo.reset()
        with torch.no_grad(), standin.enforce_limits(check_limits):
            mod.load(b, kv, loads)  # eager, before the graph (see the module's load())
            logits = target.forward(W, b, kv, staging)
    finally:
        standin.uninstall()
    return Traced(mod, backend.graphs[-1], len(backend.graphs), logits, kv, staging, b)


@dataclass
class StructureReport:
    module: str
    mode: str
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def trace_and_check(module_path: str | Path, spec) -> StructureReport:
    t = trace(module_path, spec)
    return StructureReport(str(module_path), t.module.COMPILE_MODE, t.problems())
