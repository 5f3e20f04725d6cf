"""Warm-up: every graph a runner can run, compiled (or loaded from the compile cache) before the first request.

A GE compile takes minutes (vllm-ascend measured 0.5-1.5 min per graph: audit 3 N1), so `warm_up` runs
one step per bucket of every variant (``bucketing.bucket_steps``) and, on a history prefill variant,
one per mixed-grid cell (``MixedGrid.cell_steps``): sequences that live only in the reserved pad block,
so nothing but the pad block and one staging slot (never committed) is written. It reports the
``warmup`` phase to the process's progress reporter (`graphgen.runtime.progress`: graphs i/N with an
ETA; in a rank process the launcher holds the phase to its deadline) and prints one line per graph.

Largest shapes first (audit 3 N12): torchair's graph memory pool reuses a block only for a request no
larger than it (``torchair/npu_graph_executor/memory/Allocator.cpp:54-83``), so warming the largest
bucket first lets every smaller graph reuse its feature memory, as vllm-ascend does ("Capture the large
shapes first", ``0b65ac6c4b:…/torchair_model_runner.py:256``); smallest first kept one block per bucket.
"""
from __future__ import annotations

import sys
import time

import torch

from ...runtime import current_progress
from .bucketing import bucket_steps
from .compile import bucket_entry, step_bucket

__all__ = ["warm_up", "warmup_plans"]


def pad_sequence(runner, hist: int, q: int) -> dict:
    """A warm-up sequence of ``hist`` history and ``q`` new tokens stored only in the runner's pad block."""
    pad, bs = runner.pad_block, runner.block_size
    pos = list(range(hist, hist + q))
    return {"ids": [0] * q, "pos": pos, "slots": [pad * bs + p % bs for p in pos], "table": [pad] * -(-(hist + q) // bs),
            "seq_len": hist + q, "save": [], "load": [], "loaded": []}


def runs_mixed_cells(runner) -> bool:
    """Whether ``runner`` ever pads a call to a mixed-grid cell: not with a ``call_padding`` seam (DP's
    agreement), nor as a rank of a layout with dp > 1 (warm-up runs before the rank wraps the runner and plugs
    that seam in: ``npu_engine``'s ``make_runner``)."""
    groups = getattr(runner, "groups", None)
    return getattr(runner, "call_padding", None) is None and not (groups is not None and groups.layout.dp > 1)


def warmup_plans(runner) -> list[tuple[str, list, object]]:
    """``(variant, seqs, cell padding or None)`` per graph, each variant's largest shapes first."""
    plans = []
    for v, mod in runner.modules.items():
        history = bool(mod.META.get("history"))
        mine = [(v, seqs, None) for seqs in bucket_steps(mod.META["phase"], history, runner.buckets,
                                                          runner.block_size)]
        # and every cell of the mixed grid on each history prefill variant: a mixed batch padded to a
        # cell nobody compiled would compile mid-serving (minutes of GE on an NPU); not where the runner
        # never runs one (DP: every call is padded to an agreed bucket instead; audit 4 M5: 12 of the
        # 2-node spec's 23 graphs, and the largest activations, were cells DP never runs)
        if history and mod.META["phase"] == "prefill" and runs_mixed_cells(runner):
            mine += [(v, step.seqs, runner.grid.padding(step, runner.pad_block))
                     for step in runner.grid.cell_steps(runner.block_size)]
        plans += sorted(mine, key=lambda p: _size(runner, p), reverse=True)
    return plans


def _size(runner, plan) -> tuple[int, int]:
    """(tokens, batch) of a plan's padded step: the order of the graphs' feature memory."""
    v, seqs, pad = plan
    if pad is None:
        pad = runner.buckets.padding(runner.modules[v].META["phase"], len(seqs), sum(q for _, q in seqs),
                                     runner.pad_block)
    return pad.tokens, pad.batch


def warm_up(runner, out=None) -> int:
    """Compile (or load) every graph of ``runner`` (`NpuModelRunner`) now; returns the graphs warmed."""
    out = out or sys.stderr
    plans = warmup_plans(runner)
    report = current_progress()
    report.phase("warmup", total=len(plans))
    t0 = time.monotonic()
    for i, (variant, seqs, pad) in enumerate(plans, 1):
        mod = runner.modules[variant]
        phase, saves, history = mod.META["phase"], bool(mod.META["saves"]), bool(mod.META.get("history"))
        chunk = [pad_sequence(runner, hist, q) for hist, q in seqs]
        b, _ = runner._step_inputs(mod, chunk, pad=pad)
        target = runner.compiled(variant)
        seen = len(runner.cache_uses(variant))
        idx, slot = runner.commits.ring.acquire() if saves else (None, None)
        try:
            with torch.no_grad(), runner._limits():
                if history:
                    mod.load(b, runner.kv, runner._chunk_loads(mod, chunk))
                target.forward(runner.W, b, runner.kv, slot.device if saves else ())
        finally:
            if saves:  # the next graph writing this slot is queued after this one (same stream)
                runner.commits.ring.release(idx)
        runner.seen.add((variant, bucket_entry(b)))
        batch, tokens = step_bucket(b)
        kind = "bucket" if pad is None else f"mixed cell decode_rows={len(seqs) - runner.grid.prefill_seqs}"
        uses = runner.cache_uses(variant)[seen:]  # this graph's first call, with a compile cache
        how = uses[0].describe() if uses else "compiled"
        left = (time.monotonic() - t0) / i * (len(plans) - i)
        print(f"warm-up {i}/{len(plans)}: {variant} {kind} batch={batch} tokens={tokens} {how}"
              f"{f' (eta {left:.0f} s)' if i < len(plans) else ''}", file=out, flush=True)
        report.advance(1, note=variant)
    report.stepping()
    return len(plans)
