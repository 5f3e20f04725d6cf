"""Post-AOT op lists for the GE converter tests (tests/npu/test_ge_converters.py), cached as test data.

Tracing every bucket of the tiny specs through the stand-in, and the full-size modules on meta
tensors, costs minutes on 2 cores.  The op lists only change when something that shapes the trace
changes, so they are cached in ``tests/npu/data/ge_ops/<spec>.json`` keyed by the sha256 of the
generated module sources, of the stand-in and host-input code, and of torch's version.  A stale key
retraces (and warns how to refresh the cache); a fresh key reuses the cached lists, and the converter
check itself always runs on them.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(__file__).parent / "data" / "ge_ops"
# what the traced op lists depend on besides the generated module itself
TRACE_CODE = sorted([*(ROOT / "graphgen/npu/standin").glob("*.py"), ROOT / "graphgen/npu/run/inputs.py",
                     ROOT / "graphgen/npu/run/bucketing.py", ROOT / "graphgen/npu/run/compile.py",
                     ROOT / "graphgen/npu/check/geops.py", ROOT / "graphgen/npu/check/ge_converters.json",
                     Path(__file__)])
REFRESH = "GRAPHGEN_REFRESH_GE_OPS=1 python -m pytest tests/npu/test_ge_converters.py -k cached"
# pseudo-variants traced from another variant's module: a speculative verify step is the decode module
# with K + 1 query tokens per row (K = VERIFY_K)
MODULE_OF = {"verify": "decode"}
VERIFY_K = 3


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def cache_key(spec_name: str, variants, full_size: bool) -> dict:
    import torch

    mods = {v: _sha(ROOT / "generated" / spec_name / "npu" / "max_autotune" / f"{MODULE_OF.get(v, v)}.py")
            for v in variants}
    code = hashlib.sha256("".join(_sha(p) for p in TRACE_CODE).encode()).hexdigest()
    return {"modules": mods, "trace_code": code, "torch": torch.__version__, "full_size": full_size}


def cached(spec_name: str, key: dict):
    p = CACHE / f"{spec_name}.json"
    if not p.exists():
        return None
    doc = json.loads(p.read_text())
    return doc["report"] if doc.get("key") == key else None


def store(spec_name: str, key: dict, report: dict) -> None:
    CACHE.mkdir(parents=True, exist_ok=True)
    (CACHE / f"{spec_name}.json").write_text(json.dumps({"key": key, "report": report}, indent=1, sort_keys=True)
                                             + "\n")


def trace_tiny(spec_path: Path, sources=None) -> dict:
    """Every bucket of every variant (one deterministic step each) through the stand-in."""
    from graphgen.modelspec.loader import load_spec
    from graphgen.npu.check.geops import ops_report
    from graphgen.npu.run.bucketing import run_standin_loop

    spec = load_spec(spec_path)
    results = run_standin_loop(spec, steps=0, every_bucket=True, sources=sources)
    return ops_report(spec.name, results)


def trace_full_size_meta(spec_name: str, variant: str, fake_group) -> dict:
    """One bucket (the smallest) of a shipped full-size module, compiled through the stand-in's AOT on
    META tensors (no weights allocated); returns one ``--ops-json`` graph entry."""
    import torch

    from graphgen.modelspec.loader import load_spec
    from graphgen.npu.check.geops import captured_targets
    from graphgen.npu.run.bucketing import Buckets, bucket_steps, bucketed_step
    from graphgen.npu.run.compile import compile_module, load_module
    from graphgen.npu.run.bucketing import PAD_BLOCK
    from graphgen.npu.run.inputs import StepPadding
    from graphgen.npu.standin import fakes as standin
    from test_full_size_meta import _meta, _meta_weights, init_layout

    standin.install()
    spec = load_spec(ROOT / "specs" / f"{spec_name}.yaml")
    torch._dynamo.reset()
    with standin.fresh_tags():
        mod = load_module(ROOT / "generated" / spec_name / "npu" / "max_autotune" / f"{MODULE_OF.get(variant, variant)}.py")
    init_layout(spec, mod, fake_group)
    v = spec.variants[MODULE_OF.get(variant, variant)]
    buckets = Buckets.from_spec(spec)
    bs = spec.kv_cache.block_size
    if variant == "verify":  # the smallest decode bucket, every row K + 1 tokens over its history
        seqs = [(bs + 1 + i, VERIFY_K + 1) for i in range(buckets.decode_batch[0])]
        pad = StepPadding(len(seqs), len(seqs) * (VERIFY_K + 1), buckets.max_blocks, PAD_BLOCK, buckets.save_rows)
    else:
        seqs = bucket_steps(v.phase, bool(v.history), buckets, bs)[0]
        pad = buckets.padding(v.phase, len(seqs), sum(q for _, q in seqs))
    b, nb = bucketed_step(mod, spec, buckets, seqs, pad=pad)
    dtype = getattr(torch, mod.KV_DTYPE)
    if mod.META["phase"] == "mtp":  # the hidden state each MTP row drafts from
        b = dataclasses.replace(b, prev_hidden=torch.empty(len(b.input_ids), spec.dims.hidden_size, dtype=dtype))
    b = dataclasses.replace(b, **{f.name: _meta(getattr(b, f.name)) for f in dataclasses.fields(b)})
    layers = spec.kv_layers
    kv = [tuple(torch.empty(nb, *s, dtype=dtype, device="meta") for s in mod.KV_SHAPES) for _ in range(layers)]
    staging = ([tuple(torch.empty(buckets.save_rows, *s, dtype=dtype, device="meta") for s in mod.KV_SHAPES)
                for _ in range(layers)] if mod.META["saves"] else [])
    target, backend = compile_module(mod, "max-autotune", use_standin=True, buckets=1)
    with torch.no_grad():
        target.forward(_meta_weights(spec, mod), b, kv, staging)
    (cg,) = backend.graphs
    ops, calls = captured_targets(cg)
    return {"variant": variant, "mode": "max-autotune", "bucket": {"batch": pad.batch, "tokens": pad.tokens},
            "ops": ops, "callables": calls}
