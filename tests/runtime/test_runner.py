"""The model runner: `StepHandles` name the step's own logits, save job and save event.

Hand-written modules with the generated interface (EVENTS, HOST_EVENT, run) make each property
observable; the last test runs a real generated module (tiny_qwen3 mempool_prefill, random weights)
through the runner."""
from __future__ import annotations

import dataclasses
import threading
import time
import types

import pytest
import torch

from graphgen.runtime.core import kvcache

from graphgen.runtime.core.cpu_runtime import CpuRuntime
from graphgen.runtime.engine.runner import CpuModelRunner, StepHandles
from graphgen.runtime.core.streams import EventAborted, EventTimeout
from support.paths import REPO


def fake_module(*, fail=False, launches=1, gate=None):
    """A module whose save program waits for ev.fwd, appends its step's generation, records ev.save."""
    mod = types.ModuleType("fake")
    mod.EVENTS, mod.HOST_EVENT = ("ev.fwd", "ev.save"), "ev.save"
    mod.saved = []

    def run(rt, W, b, kv, staging, loads, ev):
        def save_program():
            rt.wait(ev["ev.fwd"])
            if gate is not None:
                assert gate.wait(5)
            mod.saved.append(ev["ev.save"].gen)
            rt.record(ev["ev.save"])
        for _ in range(launches):
            rt.launch("kv_save", save_program)
        if fail:
            raise RuntimeError("forward broke")
        rt.record(ev["ev.fwd"])
        return torch.full((1, 3), float(b))

    mod.run = run
    return mod


@pytest.fixture
def rt():
    r = CpuRuntime(event_timeout=5)
    yield r
    r.close()


def test_handles_are_this_steps_logits_job_and_event(rt):
    gate = threading.Event()
    mod = fake_module(gate=gate)
    runner = CpuModelRunner({"v": mod}, {}, None, rt, event_timeout=5)
    h1 = runner.execute("v", 1, staging=[])
    assert isinstance(h1, StepHandles) and h1.logits.tolist() == [[1.0, 1.0, 1.0]]
    assert not h1.save_job.done()                 # the save is still gated: returned, not waited for
    with pytest.raises(EventTimeout):
        h1.save_done.wait(timeout=0.02)
    gate.set()
    h2 = runner.execute("v", 2, staging=[])
    h2.save_done.wait()
    h1.save_job.result(5)
    assert mod.saved == [1, 2]                    # one generation per step, in order
    assert (h1.save_done.gen, h2.save_done.gen) == (1, 2) and h1.save_job is not h2.save_job


def test_a_module_without_save_gets_no_staging_and_no_handles(rt):
    mod = types.ModuleType("decode")
    mod.EVENTS, mod.HOST_EVENT = (), None
    mod.run = lambda rt_, W, b, kv, staging, loads, ev: torch.zeros(1, 2)
    runner = CpuModelRunner({"decode": mod, "v": fake_module()}, {}, None, rt)
    h = runner.execute("decode", None)
    assert (h.save_job, h.save_done) == (None, None) and not runner.saves("decode") and runner.saves("v")
    with pytest.raises(ValueError, match="staging area is needed exactly when"):
        runner.execute("decode", None, staging=[])
    with pytest.raises(ValueError, match="staging area is needed exactly when"):
        runner.execute("v", 1)


def test_failed_forward_aborts_the_steps_events_and_releases_the_save(rt):
    mod = fake_module(fail=True)
    runner = CpuModelRunner({"v": mod}, {}, None, rt, event_timeout=30)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="forward broke"):
        runner.execute("v", 1, staging=[])
    assert time.monotonic() - t0 < 5              # not the 30 s event timeout: the wait was aborted
    rt.start("kv_save", lambda: None).result(5)   # the save stream is free again
    assert mod.saved == []
    ok = CpuModelRunner({"v": fake_module()}, {}, None, rt).execute("v", 2, staging=[])
    ok.save_done.wait()


def test_aborted_save_job_reports_event_aborted(rt):
    mod = fake_module(fail=True)
    runner = CpuModelRunner({"v": mod}, {}, None, rt, event_timeout=30)
    jobs = []
    orig = rt.start
    rt.start = lambda stream, fn: jobs.append(orig(stream, fn)) or jobs[-1]
    with pytest.raises(RuntimeError):
        runner.execute("v", 1, staging=[])
    assert isinstance(jobs[0].exception(5), EventAborted)


def test_two_programs_on_one_stream_in_a_step_are_refused(rt):
    runner = CpuModelRunner({"v": fake_module(launches=2)}, {}, None, rt, event_timeout=1)
    with pytest.raises(RuntimeError, match="second program on stream 'kv_save'"):
        runner.execute("v", 1, staging=[])


def test_unknown_stream_is_refused(rt):
    with pytest.raises(ValueError, match="stream 'nope'"):
        rt.start("nope", lambda: None)


def test_real_generated_module_step(rt, tmp_path):
    from graphgen.modelspec.loader import load_spec
    from graphgen.runtime.core import ops
    from graphgen.runtime.core.cpu_runtime import load_cpu_modules
    from graphgen.runtime.core.kvcache import PagedKVCache, slot_mapping
    from graphgen.runtime.engine.runner import StepInputs
    from graphgen.runtime.checkpoint.hf import load_hf_weights, write_random_hf_checkpoint

    spec = load_spec(REPO / "specs" / "tiny_qwen3.yaml")
    dims = dataclasses.asdict(spec.dims)
    write_random_hf_checkpoint(tmp_path, spec.family, dims, seed=0)
    W = load_hf_weights(str(tmp_path))
    bs = spec.kv_cache.block_size
    shapes = kvcache.kv_cache_shapes(spec.family, dims, 4, bs)
    cache = PagedKVCache(spec.dims.num_hidden_layers, {k: s[1:] for k, s in shapes.items()}, 4, torch.float32)
    mods = load_cpu_modules(spec, "specs/tiny_qwen3.yaml")
    runner = CpuModelRunner({"mempool_prefill": mods["mempool_prefill"]}, W, cache, rt)
    n, table = 9, [2, 0, 3]
    b = StepInputs(input_ids=torch.arange(n), positions=torch.arange(n), slot_mapping=slot_mapping(table, 0, n, bs),
                   block_tables=torch.tensor([table]), seq_lens=torch.tensor([n]), query_lens=torch.tensor([n]),
                   logits_indices=torch.tensor([n - 1]), save_block_ids=torch.tensor([2, 0]))
    staging = cache.make_staging(2)
    h = runner.execute("mempool_prefill", b, staging)
    h.save_done.wait()
    assert h.logits.shape == (1, spec.dims.vocab_size) and h.save_job.exception(5) is None
    assert all(s.abs().sum() > 0 for st in staging for s in st)
    for layer, st in zip(cache, staging):         # the save copied exactly blocks 2 and 0
        for comp, s in zip(layer, st):
            assert torch.equal(s[0], comp[2]) and torch.equal(s[1], comp[0])


def test_runner_builds_the_cpu_layout_once_and_drops_the_sources(rt, tmp_path):
    """The generated CPU modules read dense projections as load-time weights (q/k/v and gate/up merged,
    stored [in, out]): the runner builds each from the checkpoint tensors and drops the sources; a
    checkpoint missing one is an error naming the recipe."""
    from graphgen.modelspec.loader import load_spec
    from graphgen.runtime.core.cpu_runtime import load_cpu_modules
    from graphgen.runtime.checkpoint.hf import load_hf_weights, write_random_hf_checkpoint

    spec = load_spec(REPO / "specs" / "tiny_qwen3.yaml")
    write_random_hf_checkpoint(tmp_path, spec.family, dataclasses.asdict(spec.dims), seed=0)
    W = load_hf_weights(str(tmp_path))
    mods = load_cpu_modules(spec, "specs/tiny_qwen3.yaml")
    runner = CpuModelRunner(mods, W, None, rt)
    a, m = "model.layers.1.self_attn.", "model.layers.1.mlp."
    qkv = runner.W[f"graphgen.load:{a}q_proj.weight+{a}k_proj.weight+{a}v_proj.weight:cat0:t01"]
    assert qkv.is_contiguous() and torch.equal(qkv, torch.cat([W[a + p + "_proj.weight"] for p in "qkv"]).t())
    gate_up = runner.W[f"graphgen.load:{m}gate_proj.weight+{m}up_proj.weight:cat0:t01"]
    assert torch.equal(gate_up, torch.cat((W[m + "gate_proj.weight"], W[m + "up_proj.weight"])).t())
    assert torch.equal(runner.W[f"graphgen.load:{m}down_proj.weight:cat0:t01"], W[m + "down_proj.weight"].t())
    gone = [k for k in W if k.endswith(("q_proj.weight", "gate_proj.weight", "o_proj.weight", "down_proj.weight"))]
    assert gone and not set(gone) & set(runner.W)  # each weight held once
    assert torch.equal(runner.W["lm_head.weight"], W["lm_head.weight"])  # not a projection source: as loaded
    del W[a + "v_proj.weight"]
    with pytest.raises(KeyError, match="v_proj.weight"):
        CpuModelRunner(mods, W, None, rt)
