"""A rank's weights streamed from the checkpoint files (`CheckpointWeights` through `place_weights`) equal
what the whole-model path gives: `load_hf_weights` (every tensor, float32), `rank_weights` /
`dp_rank_weights` (the rank's slices) and `load_time_weights` (merged q/k/v, gate/up, transposed
experts, [in, out] CPU projections) -- for every rank of every tiny parallel layout, both targets'
recipes, single-file and sharded checkpoints in bfloat16. The reference path is the one the CPU ranks
ran until now (and the transformers parity tests pin it: tests/runtime/test_ops_vs_hf.py); here the
streaming path must reproduce it bit for bit, padding of uneven chunks included."""
from __future__ import annotations

import functools
import json
import os

import pytest
import torch

from graphgen.ir.weights import graph_weight_names
from graphgen.lower.compile import compile_spec
from graphgen.modelspec.loader import load_spec
from graphgen.runtime.checkpoint.hf import load_hf_weights, write_random_hf_checkpoint
from graphgen.runtime.checkpoint.plan import RankSlicing
from graphgen.runtime.checkpoint.stream import CheckpointWeights, SliceReader
from graphgen.runtime.core.weights import place_weights
from graphgen.runtime.parallel.dp_rank import DPLayout, dp_rank_weights
from graphgen.runtime.parallel.ops import rank_weights
from support.paths import SPECS


def _checkpoint(tmp_path, spec, *, sharded: bool) -> str:
    import dataclasses

    out = write_random_hf_checkpoint(str(tmp_path / "ckpt"), spec.family, dataclasses.asdict(spec.dims), seed=3,
                                     dtype=torch.bfloat16, tokenizer=False)
    if sharded:  # the published layout: several files and an index (keys dealt round-robin)
        from safetensors.torch import load_file, save_file

        tensors = load_file(os.path.join(out, "model.safetensors"))
        os.remove(os.path.join(out, "model.safetensors"))
        weight_map = {}
        for n in range(3):
            fname = f"model-{n + 1:05d}-of-00003.safetensors"
            part = sorted(tensors)[n::3]
            save_file({k: tensors[k] for k in part}, os.path.join(out, fname))
            weight_map.update({k: fname for k in part})
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return out


@functools.lru_cache(maxsize=None)
def _compiled_once(name, target, override):
    spec = load_spec(SPECS / f"{name}.yaml").with_overrides(**dict(override))
    compiled = compile_spec(spec, targets=[target], check=False)
    return [t for c in compiled for t in c.sources.values()], graph_weight_names(c.graph for c in compiled)


def _compiled(spec, target, name=None, override=()):  # (module sources, graph weight names)
    if name is not None:
        return _compiled_once(name, target, tuple(sorted(override.items())))
    compiled = compile_spec(spec, targets=[target], check=False)
    return [t for c in compiled for t in c.sources.values()], graph_weight_names(c.graph for c in compiled)


def _reference(spec, full, names, rank, sources, dtype):
    par = spec.parallel
    if par.dp > 1:
        mine = dp_rank_weights(full, names, DPLayout.of(par, rank))
    else:
        mine = rank_weights(full, names, rank % par.tp, par.tp)
    return place_weights(mine, sources, family=spec.family, dtype=dtype)


# (spec, target whose recipes are built, layout override, sharded checkpoint)
LAYOUTS = [("tiny_qwen3_tp2", "cpu", {}, False), ("tiny_qwen3_npu", "npu", {"tp": 2}, True),
           ("tiny_deepseek_v3_tp2ep2", "cpu", {}, True), ("tiny_deepseek_v3_npu", "npu", {"tp": 2}, False),
           ("tiny_deepseek_v3_dp2ep2", "cpu", {}, True), ("tiny_deepseek_v3", "cpu", {}, False)]


@pytest.mark.parametrize("name,target,override,sharded", LAYOUTS,
                         ids=[f"{n}-{t}-{'sharded' if s else 'single'}" for n, t, _, s in LAYOUTS])
def test_streamed_rank_weights_equal_the_whole_model_path(tmp_path, name, target, override, sharded):
    spec = load_spec(SPECS / f"{name}.yaml")
    if override:
        spec = spec.with_overrides(**override)
    ckpt = _checkpoint(tmp_path, spec, sharded=sharded)
    sources, names = _compiled(spec, target, name, override)
    dtype = getattr(torch, spec.targets.npu.dtype if target == "npu" else spec.kv_cache.dtype)
    full = load_hf_weights(ckpt)
    for rank in range(spec.parallel.world):
        want = _reference(spec, full, names, rank, sources, dtype)
        got = place_weights(CheckpointWeights(ckpt, frozenset(names), RankSlicing.of(spec.parallel, rank)), sources,
                            family=spec.family, dtype=dtype)
        assert sorted(got) == sorted(want)
        for k in want:
            assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
            assert got[k].is_contiguous() and torch.equal(got[k], want[k]), (rank, k)
        if spec.family == "deepseek_v3":  # the family's float32 keys stay float32 (router, score bias)
            assert got["model.layers.1.mlp.gate.weight"].dtype == torch.float32


def test_uneven_chunks_are_zero_padded_as_slice_weight_does(tmp_path):
    """Negative space of the layouts above (they all divide evenly): a 3-way split of the embedding
    (vocab 256) and of a stacked expert dim, each rank's chunk ceil(n/3) long, the last one padded."""
    from graphgen.runtime.parallel.ops import slice_weight

    spec = load_spec(SPECS / "tiny_deepseek_v3.yaml")
    ckpt = _checkpoint(tmp_path, spec, sharded=False)
    full = load_hf_weights(ckpt)
    names = ["model.embed_tokens.weight[d0/3]", "model.layers.1.mlp.experts.up_proj.weight[d1/3]",
             "model.layers.1.mlp.experts.down_proj.weight[d0/3]"]
    for rank in range(3):
        got = place_weights(CheckpointWeights(ckpt, frozenset(names), RankSlicing(rank, 3, rank, 3)), [],
                            family=spec.family, dtype=torch.float32)
        for n in names:
            key, dim, parts = n.split("[")[0], int(n[-4]), 3
            want = slice_weight(full[key], dim, parts, rank, 3)
            assert torch.equal(got[n], want), (rank, n)
    assert got[names[0]][-1].abs().sum() == 0 and got[names[0]].shape[0] == 86  # 256 = 86 + 86 + 84 (+2 pad)


def test_a_rank_reads_its_slices_only_into_a_buffer_of_the_largest_slice(tmp_path):
    """Host memory while loading: one reused buffer of the largest stored slice (+ a row block for
    strided slices), not the model; bytes asked of the files: this rank's rows only for dim-0 splits."""
    spec = load_spec(SPECS / "tiny_qwen3_npu.yaml").with_overrides(tp=2)
    ckpt = _checkpoint(tmp_path, spec, sharded=True)
    sources, names = _compiled(spec, "npu")
    from graphgen.runtime.checkpoint.stream import stream_weights
    from graphgen.runtime.core.weights import collect_recipes

    w = CheckpointWeights(ckpt, frozenset(names), RankSlicing(1, 2))
    plan = w.plan(collect_recipes(sources))
    largest = max(f.nbytes for p in plan for f in p.fills)
    with SliceReader() as reader:
        stream_weights(plan, reader=reader)
        assert largest <= reader._buf.numel() <= largest  # exactly the largest slice, never the model
        assert reader.buffer_bytes <= largest + (64 << 20)
        placed = sum(p.nbytes for p in plan)
        whole = sum(s.nbytes for s in w.index().tensors.values())
        assert placed < 0.6 * whole and reader.bytes_read < whole  # about half the model, not all of it


def test_the_streamed_load_reports_its_bytes_to_the_load_phase(tmp_path):
    """The streaming loader feeds the start's progress (`graphgen.runtime.progress`): `place_weights` of a
    checkpoint reports the bytes placed / the rank's total to the process's ``load`` phase, which a rank
    sends its launcher (whose board prints bytes and GB/s per rank). A rank enters the phase before it
    loads (its deadline covers the load): the loader then sets the total without restarting the phase.
    Negative control: an explicit ``progress=`` (the dry run's own lines) leaves the process's reporter alone."""
    from graphgen.runtime.core.weights import collect_recipes
    from graphgen.runtime.progress import Progress, reporting

    spec = load_spec(SPECS / "tiny_qwen3_npu.yaml").with_overrides(tp=2)
    ckpt = _checkpoint(tmp_path, spec, sharded=True)
    sources, names = _compiled(spec, "npu")
    w = CheckpointWeights(ckpt, frozenset(names), RankSlicing(1, 2))
    total = sum(p.nbytes for p in w.plan(collect_recipes(sources)))
    events = []
    report = Progress(events.append, min_interval_s=0.0)
    report.phase("load")  # as rank.py does before it builds the engine: total unknown yet
    with reporting(report):
        place_weights(w, sources, family=spec.family, dtype=torch.bfloat16)
    assert [e["phase"] for e in events] == ["load"] * len(events) and events[0]["total"] is None
    assert events[1]["total"] == total and events[-1]["done"] == total  # then every event has the total
    done = [e["done"] for e in events[1:]]
    assert done == sorted(done) and len(set(done)) > 2  # tensor by tensor, not one jump at the end
    events.clear()
    mine = []
    with reporting(Progress(events.append, min_interval_s=0.0)):
        place_weights(w, sources, family=spec.family, dtype=torch.bfloat16, progress=lambda d, t: mine.append((d, t)))
    assert events == [] and mine[0] == (0, total) and mine[-1] == (total, total)


def test_the_reader_returns_safetensors_slices_of_data_and_holes(tmp_path):
    """Every kind of read (whole, a row range, a column range read row by row, short columns read in row
    blocks) of tensors that are data, holes, or both, equals safetensors' own ``get_slice``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(64, 48, generator=g).to(torch.bfloat16), "b": torch.randn(3, 700, 1024, generator=g),
               "c": torch.randn(40, 4096, generator=g).to(torch.bfloat16), "d": torch.randn(5, 6, generator=g)}
    path = str(tmp_path / "m.safetensors")
    save_file(tensors, path)
    from graphgen.runtime.checkpoint.index import read_header

    stored = read_header(path)
    # rewrite the file with holes (skipped, page-aligned) over part of "b" and all of "c": zeros there
    data, gaps = open(path, "rb").read(), []
    for key, lo, hi in (("b", 0.3, 0.8), ("c", 0.0, 1.0)):
        s = stored[key]
        gaps.append((-(-(s.begin + int(lo * s.nbytes)) // 4096) * 4096, (s.begin + int(hi * s.nbytes)) // 4096 * 4096))
    with open(path, "wb") as f:
        pos = 0
        for a, z in gaps:
            f.write(data[pos:a])
            f.seek(z)
            pos = z
        f.write(data[pos:])
    with SliceReader() as reader:  # the file system made holes of them (else this test proves less)
        fd = reader._fd(path)
        assert all(reader._hole(fd, a, z - a) for a, z in gaps) and not reader._hole(fd, 0, 4096)
    with safe_open(path, framework="pt") as f, SliceReader(block_bytes=1 << 16) as reader:
        for key in tensors:
            s = stored[key]
            want = f.get_slice(key)
            assert torch.equal(reader.read(s), want[:]), key
            for dim in range(len(s.shape)):
                n = s.shape[dim]
                for start, length in ((0, n // 2), (n // 3, n - n // 3), (n - 1, 1)):
                    idx = tuple(slice(start, start + length) if d == dim else slice(None) for d in range(len(s.shape)))
                    assert torch.equal(reader.read(s, (dim, start, length)), want[idx]), (key, dim, start)


@pytest.mark.parametrize("path", ["qwen3_32b/npu/max_autotune/decode.py", "deepseek_v3_1/npu/max_autotune/splitfuse.py",
                                  "tiny_deepseek_v3/cpu/splitfuse.py"])
def test_module_constants_are_read_as_python_reads_them(path):
    """`source_constants` parses each constant's statement alone; the whole module parsed gives the same."""
    import ast

    from graphgen.runtime.core.weights import source_constants
    from support.paths import REPO

    src = (REPO / "generated" / path).read_text()
    names = ("LOAD_TIME_WEIGHTS", "META", "KV_SHAPES", "KV_DTYPE", "ROPE")
    want = {n.targets[0].id: ast.literal_eval(n.value) for n in ast.parse(src).body
            if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) in names}
    assert want.get("LOAD_TIME_WEIGHTS") and source_constants(src, names) == want
