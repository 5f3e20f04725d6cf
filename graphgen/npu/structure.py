"""Trace one generated NPU module through the CPU stand-in and check its post-AOT graph.

This proves graph *structure* only (event order, stream scopes, in-place KV/staging writes after
torchair-style re-inplacing) — never NPU behaviour: the stand-in's kernels are not Ascend kernels.
Used by ``graphgen compile --target npu --standin`` and usable from tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# (history, new tokens) per sequence for a representative step of each kind of variant.
SAMPLE_SEQS = {("prefill", False): [(0, 5), (0, 3)], ("prefill", True): [(4, 3), (2, 2)],
               ("decode", False): [(5, 1), (2, 1)], ("decode", True): [(5, 1), (2, 1)]}
NUM_BLOCKS = 8


@dataclass
class StructureReport:
    module: str
    mode: str
    saves: bool
    problems: list[str]
    graph_code: str

    @property
    def ok(self) -> bool:
        return not self.problems


def trace_and_check(module_path: str | Path, spec) -> StructureReport:
    import torch

    from . import aotcheck, standin
    from .compile import compile_module, load_module
    from .inputs import kv_buffers, random_weights, tiny_step

    if not standin.install():
        raise RuntimeError("torch_npu is installed: use the real torchair, not the CPU stand-in")
    with standin.fresh_tags():
        mod = load_module(Path(module_path))
        target, backend = compile_module(mod, mod.COMPILE_MODE, use_standin=True)
    meta = mod.META
    b = tiny_step(mod, spec, SAMPLE_SEQS[(meta["phase"], bool(meta["history"]))], NUM_BLOCKS)
    kv, staging = kv_buffers(mod, spec.dims.num_hidden_layers, NUM_BLOCKS,
                             staging_rows=NUM_BLOCKS if meta["saves"] else 0)
    W = random_weights(spec, rope=mod.ROPE)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            target.forward(W, b, kv, staging)
    finally:
        standin.uninstall()
    cg = backend.graphs[-1]
    caches = [cg.placeholder_for(t) for layer in kv for t in layer]
    stagings = [cg.placeholder_for(t) for layer in staging for t in layer]
    problems = aotcheck.check_kv_save_graph(cg.gm, caches, stagings) if meta["saves"] else []
    if "aten.copy_" in cg.gm.code:
        problems.append("a write into a graph input survived as aten.copy_ (functionalisation epilogue)")
    return StructureReport(str(module_path), mod.COMPILE_MODE, bool(meta["saves"]), problems, cg.gm.code)
