"""Overlapping steps with delayed commits: each step's pooled blocks are its own (audit risk 4).

The generated tiny_qwen3_npu mempool_prefill (NPU, max-autotune; bf16, block size 128) runs EAGERLY through the CPU stand-in
(sequential CPU execution, no real streams): step N+1 is launched before step N's commit runs (the
commit thread is held until then), which is the overlap an async engine creates.  The pool must hold,
under step N's keys, exactly the cache blocks step N wrote.  Negative control: one staging buffer
reused by every step (the old contract) fails the same check.  The documented kernel limits stay on:
the hardware-shaped spec is inside them.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

import torch

from graphgen.modelspec.loader import load_spec  # noqa: E402
from graphgen.npu.standin import fakes as standin  # noqa: E402
from graphgen.npu.run.staging import Committer, StagingExhausted, StagingRing  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(standin.torch_npu_available(), reason="real torch_npu installed; stand-in not used")
STEPS, NB = 4, 8


class _OneReusedStaging(StagingRing):
    """The old contract: the same staging buffer for every step, whatever commit is still reading it."""

    def acquire(self):
        return 0, self.buffers[0]

    def release(self, index):
        pass


def _run(ring_size: int, single_reused: bool):
    from graphgen.npu.run.compile import load_module
    from graphgen.npu.run.inputs import kv_buffers, random_weights, tiny_step

    assert standin.install()
    spec = load_spec(ROOT / "specs/tiny_qwen3_npu.yaml")
    mod = load_module(ROOT / "generated/tiny_qwen3_npu/npu/max_autotune/mempool_prefill.py")
    W = random_weights(spec, rope=mod.ROPE)
    kv, _ = kv_buffers(mod, spec.dims.num_hidden_layers, NB)
    sets = [kv_buffers(mod, spec.dims.num_hidden_layers, NB, staging_rows=2)[1] for _ in range(ring_size)]
    ring = _OneReusedStaging(sets) if single_reused else StagingRing(sets)
    committer = Committer(ring)
    pool, expected, gates = {}, {}, []
    with torch.no_grad():
        for step in range(STEPS):
            b = tiny_step(mod, spec, [(0, 7)], NB, seed=step)     # 1 block (of 128), new content every step
            blocks = [step]
            b.kv_index[:, 0] += step                               # this step's own block
            b.save_block_ids = torch.tensor(blocks)
            b.save_rows = torch.arange(1).view(-1, 1)
            while ring.in_flight > 2:   # the engine's bound: at most 2 commits in flight at a launch
                time.sleep(0.001)
            idx, staging = ring.acquire()
            mod.forward(W, b, kv, staging)
            expected[step] = [kv[L][c][blocks].clone() for L in range(len(kv)) for c in range(len(kv[L]))]
            gate = threading.Event()
            gates.append(gate)

            def commit(st, step=step):
                pool[step] = [st[L][c][:1].clone() for L in range(len(st)) for c in range(len(st[L]))]
            committer.submit(gate.wait, idx, commit)
            if step:                 # step N's commit may run only after step N+1 was launched
                gates[step - 1].set()
        gates[-1].set()
        committer.close()
    return pool, expected


def _own(pool, expected):
    return all(all(torch.equal(a, e) for a, e in zip(pool[s], expected[s])) for s in expected)


def test_overlapping_steps_commit_their_own_blocks_with_a_staging_ring():
    # in flight at a launch: the previous step's gated commit and possibly the one before -> 3 buffers
    pool, expected = _run(ring_size=3, single_reused=False)
    assert set(pool) == set(range(STEPS)) and _own(pool, expected)  # step 3 reused step 0's buffer


def test_negative_control_one_reused_staging_commits_the_next_steps_blocks():
    pool, expected = _run(ring_size=1, single_reused=True)
    assert not _own(pool, expected)


def test_ring_never_blocks_the_launch_it_raises_when_too_small():
    ring = StagingRing([object()])
    ring.acquire()
    with pytest.raises(StagingExhausted):
        ring.acquire()
