"""``compile_module(cache_dir=..., buckets=N)``: one torchair compile-cache entry per shape bucket (audit 2,
row 9).  torchair's ``cache_compile`` keeps one compiled function per code object and drops the cache when that
code object compiles a second graph; the stand-in models that bookkeeping (``fakes.StandinCachedModel``, from
``air/inference/_cache_compiler.py``), not the serialised graph, so this shows the keying, not that GE
reloads a cache."""
from __future__ import annotations

from pathlib import Path

import pytest

from graphgen.lower.compile import compile_variant
from graphgen.modelspec.loader import load_spec
from graphgen.npu.standin import fakes as standin

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(standin.torch_npu_available(), reason="real torch_npu installed; stand-in not used")


def _decode_steps(cache_dir, batches, per_bucket=True, extra_blocks=0, hits=None, uses=None, calls=None):
    """Run decode steps of the given batch sizes on a KV cache of ``extra_blocks`` more blocks than the
    least; returns the cache entries written under cache_dir (``hits``: a list given the entries loaded)."""
    import warnings

    import torch

    from graphgen.npu.run.bucketing import Buckets, bucketed_step
    from graphgen.npu.run.compile import StaticShapeForward, compile_module, load_module
    from graphgen.npu.run.inputs import ROPE_CACHE_KEY, kv_buffers, random_weights, rope_cache

    spec = load_spec(ROOT / "specs" / "tiny_qwen3_npu.yaml")
    buckets = Buckets.from_spec(spec)
    assert standin.install()
    try:
        torch._dynamo.reset()
        mod = load_module(Path("<tiny_qwen3_npu>/npu/max_autotune/decode.py"),
                          compile_variant(spec, "decode", "npu", mode="max-autotune"))
        if per_bucket:
            target, _ = compile_module(mod, use_standin=True, cache_dir=cache_dir, buckets=len(buckets.decode_batch))
        else:  # the old path: one cache_compile wrapper (one code object) for every bucket
            import torchair

            target = mod.Model()
            cfg = torchair.CompilerConfig()
            target.forward = StaticShapeForward(torchair.inference.cache_compile(
                target.forward, config=cfg, dynamic=True, cache_dir=str(cache_dir)))
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8)
        from graphgen.npu.run.weights import load_time_weights

        W = load_time_weights({k: t.to(torch.bfloat16) for k, t in random_weights(spec).items()}, [mod])
        W[ROPE_CACHE_KEY] = rope_cache(mod.ROPE, buckets.max_blocks * spec.kv_cache.block_size, dtype=torch.bfloat16)
        kv, staging = kv_buffers(mod, spec.dims.num_hidden_layers, 1 + 8 * buckets.max_blocks + extra_blocks,
                                 staging_rows=0)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the modelled "Skip cache as ... recompiled"
            for i, n in enumerate(batches):
                b, _ = bucketed_step(mod, spec, buckets, [(5 + j, 1) for j in range(n)], seed=i)
                target.forward(W, b, kv, staging)
            if hits is not None:
                hits.extend(target.forward.compiled.hits)
            if uses is not None:
                uses.extend(target.forward.compiled.uses)
            if calls is not None:  # the keywords each bucket's cache_compile was called with
                calls.extend(fn.call for fn in target.forward.compiled.entries.values())
    finally:
        torch._dynamo.reset()
        standin.uninstall()
    return sorted(p.parent.name for p in Path(cache_dir).rglob("compiled_module"))


def test_two_buckets_get_two_cache_entries(tmp_path):
    entries = _decode_steps(tmp_path, [1, 3, 1])  # buckets 1, 4, 1 (decode buckets 1/2/4/8)
    assert entries == ["forward_bucket_b1_t1", "forward_bucket_b4_t4"]


def test_two_kv_block_counts_never_share_an_entry_and_a_rerun_loads_its_own(tmp_path):
    """Audit 4 M1: torchair's loaded graph asserts every input's size and stride as traced (the stand-in models
    ``assert_size_stride``) and the KV cache ``[NB, ...]`` is an input: a run with 32 more blocks must compile
    its own entry, and a third run with the first count loads the first entry (no assertion)."""
    first = _decode_steps(tmp_path, [1], extra_blocks=0)
    second = _decode_steps(tmp_path, [1], extra_blocks=32)
    assert first == ["forward_bucket_b1_t1"] and second == ["forward_bucket_b1_t1"] * 2
    assert len({p.parent.parent for p in tmp_path.rglob("compiled_module")}) == 2  # two entry directories
    hits: list = []
    assert _decode_steps(tmp_path, [1], extra_blocks=0, hits=hits) == second and hits == ["forward_bucket_b1_t1"]


def test_the_old_key_loads_the_other_block_counts_graph_and_fails_its_size_assert(tmp_path, monkeypatch):
    """Negative control: db0fc11's key (no input signature) gives both block counts one entry, and the second
    run's first call fails torchair's first-call ``assert_size_stride`` (as modelled) at the KV input."""
    from graphgen.npu.run import compile as npu_compile

    monkeypatch.setattr(npu_compile, "keyed_cache_dir", lambda root, *args: Path(root))
    assert _decode_steps(tmp_path, [1], extra_blocks=0) == ["forward_bucket_b1_t1"]
    with pytest.raises(AssertionError, match="assert_size_stride"):
        _decode_steps(tmp_path, [1], extra_blocks=32)


def test_the_input_signature_sees_shapes_strides_dtypes_and_flags_but_not_lengths():
    import torch

    from graphgen.npu.run.compile import input_signature

    base = input_signature({"w": torch.zeros(4, 2)}, [3, 5], True)
    assert base == input_signature({"w": torch.ones(4, 2)}, [7, 1], True)  # values and Python ints: same graph
    assert len({base, input_signature({"w": torch.zeros(5, 2)}, [3, 5], True),
                input_signature({"w": torch.zeros(2, 4).t()}, [3, 5], True),
                input_signature({"w": torch.zeros(4, 2, dtype=torch.bfloat16)}, [3, 5], True),
                input_signature({"v": torch.zeros(4, 2)}, [3, 5], True),
                input_signature({"w": torch.zeros(4, 2)}, [3, 5], False)}) == 6


def test_the_restart_asks_ge_for_its_cache_with_keywords_the_wheels_cache_compile_names(tmp_path):
    """Audit 4 M6: without ``ge_cache=True`` a restart loads torchair's entry and GE compiles every graph again.
    The public ``torchair.inference.cache_compile`` takes ``**kwargs`` (a misspelt keyword would vanish), so the
    keywords are bound against the callable it forwards them to, ``_cache_compiler.cache_compile`` (the manifest,
    extracted from the pinned wheel): ``ge_cache`` must be one of its named parameters, and True."""
    from graphgen.npu.check.conformance import _check_params, load_manifest
    from graphgen.npu.run.compile import ge_cache_option

    api = load_manifest()["python_api"]
    inner = [p for p in api["torchair.inference._cache_compiler.cache_compile"]["params"] if p["kind"] != "var_keyword"]
    assert "ge_cache" in [p["name"] for p in inner]
    calls: list = []
    _decode_steps(tmp_path, [1], calls=calls)
    kws = [k for k, v in calls[0].items() if v is not None and v is not False or k == "ge_cache"]
    assert calls[0]["ge_cache"] is True and _check_params(inner, 1, kws, False, False) == []
    assert _check_params(inner, 1, kws + ["gecache"], False, False) == ["unknown keyword argument 'gecache'"]
    assert ge_cache_option("reduce-overhead") == {}  # torchair ignores it there, with a warning (:711-713)
    uses: list = []
    _decode_steps(tmp_path, [1], uses=uses)  # the restart: torchair's entry and GE's model both found
    assert [(u.torchair, u.ge) for u in uses] == [(True, True)]
    assert uses[0].describe() == "loaded from the compile cache (torchair entry and GE model)"
    for om in tmp_path.rglob("*.om"):  # negative control: no GE model beside the entry
        om.unlink()
    uses.clear()
    _decode_steps(tmp_path, [1], uses=uses)
    assert [(u.torchair, u.ge) for u in uses] == [(True, False)] and "GE compiled its graph" in uses[0].describe()


def test_one_wrapper_for_every_bucket_loses_its_cache(tmp_path):
    """Negative control: the old single wrapper compiles a second graph from the same code object, and
    torchair's cache_compile (as modelled) drops the entry -- or, had a process seen one bucket only, a later
    process would load that one unguarded graph for every bucket."""
    assert _decode_steps(tmp_path, [1, 3], per_bucket=False) == []


# --------------------------------------------------------------------------- keyed by spec, variant, source (issue 27 item 6)
def _entry(root, mod, name, keyed):
    """Where torchair's cache_compile (as the stand-in models its key, air/inference/_cache_compiler.py:203-235)
    puts module ``mod``'s bucket ``name``: under ``root`` itself (the old keying) or under the module's
    `CacheKey` directory (spec, mode, variant, source hash, rank)."""
    import torchair

    from graphgen.npu.run.compile import CacheKey, bucket_method, source_hash

    cache_dir = CacheKey("tiny_qwen3_npu", "max-autotune", mod.META["variant"], source_hash(mod.SOURCE)).directory(root) \
        if keyed else root
    wrapper = torchair.inference.cache_compile(bucket_method(mod.Model(), name), config=torchair.CompilerConfig(),
                                               dynamic=True, cache_dir=str(cache_dir))
    return wrapper.cache_bin


def test_two_variants_never_share_an_entry_and_the_old_keying_collides(tmp_path):
    """Audit 3 N5: mempool_prefill and splitfuse are both `Model()` with the same repr, options and bucket
    names, so torchair's own key gives them ONE entry -- and LazyCompiledModel loads an existing entry
    unguarded (:648-657): splitfuse would run mempool_prefill's graph. The negative control is that old
    keying (the assertion below fails on it); graphgen's CacheKey directory gives each its own."""
    from graphgen.npu.run.compile import load_module

    assert standin.install()
    try:
        mods = []
        for v in ("mempool_prefill", "splitfuse"):
            path = ROOT / f"generated/tiny_qwen3_npu/npu/max_autotune/{v}.py"
            mods.append(load_module(path))
            mods[-1].SOURCE = path.read_text()
        old = [_entry(tmp_path, m, "forward_bucket_b3_t128", keyed=False) for m in mods]
        new = [_entry(tmp_path, m, "forward_bucket_b3_t128", keyed=True) for m in mods]
    finally:
        standin.uninstall()
    assert old[0] == old[1]  # the collision
    assert new[0] != new[1] and "mempool_prefill-" in str(new[0]) and "splitfuse-" in str(new[1])


def test_the_cache_key_separates_spec_mode_variant_source_and_rank():
    from graphgen.npu.run.compile import CacheKey, source_hash

    base = CacheKey("qwen3_32b", "max-autotune", "decode", source_hash("a"), 0, 2)
    others = [CacheKey("other", "max-autotune", "decode", source_hash("a"), 0, 2),
              CacheKey("qwen3_32b", "reduce-overhead", "decode", source_hash("a"), 0, 2),
              CacheKey("qwen3_32b", "max-autotune", "splitfuse", source_hash("a"), 0, 2),
              CacheKey("qwen3_32b", "max-autotune", "decode", source_hash("a "), 0, 2),
              CacheKey("qwen3_32b", "max-autotune", "decode", source_hash("a"), 1, 2)]
    others += [CacheKey("qwen3_32b", "max-autotune", "decode", source_hash("a"), 0, 2, "tp2-ep2-dp1-cp1"),
               CacheKey("qwen3_32b", "max-autotune", "decode", source_hash("a"), 0, 2, runtime="torch=2.14.0")]
    dirs = {k.directory("/c") for k in [base, *others]}
    assert len(dirs) == 8
    assert str(base.directory("/c")).startswith(f"/c/qwen3_32b/max_autotune/decode-{source_hash('a')}/single/rank0of2/runtime-")


def test_cache_dir_flag_defaults_to_the_user_cache_on_an_npu_and_to_none_with_the_standin(monkeypatch):
    import argparse

    from graphgen.engine_args import add_engine_arguments, check_engine_arguments, engine_options

    p = argparse.ArgumentParser()
    add_engine_arguments(p, max_num_seqs=8, async_scheduling=False)
    base = ["--spec", "s.yaml", "--weights", "w", "--target", "npu"]
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert engine_options(p.parse_args(base))["cache_dir"] == "/xdg/graphgen/npu"
    assert engine_options(p.parse_args(base + ["--no-compile-cache"]))["cache_dir"] is None
    assert engine_options(p.parse_args(base + ["--standin"]))["cache_dir"] is None
    assert engine_options(p.parse_args(base + ["--standin", "--cache-dir", "/d"]))["cache_dir"] == "/d"
    assert "--target npu only" in check_engine_arguments(
        p.parse_args(["--spec", "s.yaml", "--weights", "w", "--cache-dir", "/d"]))

