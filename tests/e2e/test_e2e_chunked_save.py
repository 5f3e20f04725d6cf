"""Per-chunk async save (issue 17 item 2): every block a chunk completes is saved by that chunk's
step; a block is unpinned only after its own step's save and commit, so a prompt aborted in the
middle with several chunks' saves held back (a closed ``save_gate``) keeps all of those blocks out
of the free list, and what lands in the pool is exactly the KV an independent engine computes.
Negative control: the per-request rule (one save record per request, replaced by the next chunk's,
LMCache #3640) lets the first chunk's blocks go while its save still has to read them: a block
reused meanwhile ends up in the pool with the wrong bytes. The same holds for a prompt preempted
between its chunks (mixed batches: a running decode needs the blocks) with its chunks' saves held
back. And a later request hits the first chunks of a prompt that is still being prefilled, once
they are committed."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

import e2e_util as u

from graphgen.runtime import open_engine
from graphgen.runtime.core.faults import Faults
from graphgen.runtime.core.kvcache import OutOfBlocks
from graphgen.runtime.engine.connector import KVConnector
from graphgen.runtime.pool import HostPool

BUDGET = 8  # two blocks of 4 per chunk


class PerRequestPins(KVConnector):
    """The wrong rule: one save record per request (a single request runs here), replaced by the
    next chunk's save, whose pins replace the old ones; the replaced save still commits. (The
    replacement is decided on the engine's thread only: a commit on the host stream never changes
    which save is the request's record.)"""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._last = None
        self._replaced: set[int] = set()

    def prepare_save(self, block_ids, keys):
        if self._last is not None and self._last.block_ids:
            self.alloc.unpin(self._last.block_ids)          # the overwritten record's pins go with it
            self._replaced.add(id(self._last))
        self._last = super().prepare_save(block_ids, keys)
        return self._last

    def _commit(self, save, save_job, save_done):
        if id(save) in self._replaced:
            save = dataclasses.replace(save, block_ids=())  # already unpinned when it was replaced
        super()._commit(save, save_job, save_done)


def _overwrite_free_blocks(eng) -> None:
    """Write garbage into every block the allocator hands out now (what another request would do):
    blocks go out in the order they were freed, up to the first one still pinned."""
    taken = []
    while True:
        try:
            taken += eng.alloc.alloc(1)
        except OutOfBlocks:
            break
    for layer in eng.cache:
        for comp in layer:
            comp[taken] = 1e3
    eng.alloc.free(taken)


def _abort_mid_prompt(spec, weights, connector_cls):
    """Two chunks of a 24-token prompt run with their saves held back, the prompt is aborted, every
    block the allocator hands out is overwritten (what another request would do), then the saves go.
    Returns (blocks of the held saves that were in the free list, pool, keys of the two chunks)."""
    g = torch.Generator().manual_seed(5)
    prompt = u.rand_prompt(g, 3 * BUDGET)
    gate, pool = threading.Event(), HostPool(1 << 24)
    make = lambda p, c, a, n: connector_cls(p, c, a, write="async", stats=n)   # noqa: E731
    with open_engine(spec, weights, write="async", pool=pool, max_num_batched_tokens=BUDGET, num_blocks=12,
                     make_connector=make, faults=Faults(save_gate=gate)) as eng:
        llm, alloc = eng.core, eng.alloc
        r = llm.add_request("a", prompt, max_tokens=4)
        llm.step()
        llm.step()                                   # chunks [0, 8) and [8, 16): 4 blocks saving, held
        assert r in eng.scheduler.prefill and r.cached == 2 * BUDGET and len(pool) == 0
        held = list(r.table)
        llm.abort("a")
        freed = [b for b in held if not alloc.is_pinned(b)]
        _overwrite_free_blocks(eng)
        gate.set()
        eng.drain()
        assert alloc.num_free == alloc.num_blocks    # every pin went with its commit
        keys = u.keys_of(eng, prompt)[:4]
    return freed, pool, keys, prompt


@pytest.mark.parametrize("connector_cls,safe", [(KVConnector, True), (PerRequestPins, False)])
def test_an_aborted_prompt_keeps_each_chunks_blocks_until_its_own_save_lands(request, connector_cls, safe):
    spec, hf = u.TINY_QWEN3, request.getfixturevalue("qwen")
    freed, pool, keys, prompt = _abort_mid_prompt(spec, hf.dir, connector_cls)
    ref, _ = u.reference_blocks(spec, hf.dir, [prompt], max_num_batched_tokens=BUDGET)
    missing, wrong = u.pooled_mismatches(pool, keys, ref)
    if safe:
        assert freed == [] and missing == [] and wrong == []
    else:                                            # the negative control: the check catches it
        assert freed and wrong, (freed, missing, wrong)


def test_a_later_request_hits_the_first_chunks_of_a_prompt_still_being_prefilled(request):
    spec, hf = u.TINY_QWEN3, request.getfixturevalue("qwen")
    g = torch.Generator().manual_seed(6)
    a = u.rand_prompt(g, 4 * BUDGET)
    b = a[:BUDGET] + u.rand_prompt(g, 3)
    with open_engine(spec, hf.dir, write="async", max_num_batched_tokens=BUDGET) as eng:
        llm = eng.core
        ra = llm.add_request("a", a, max_tokens=2)
        llm.step()                                   # a's first chunk: blocks 0 and 1 saved
        eng.drain()
        assert eng.loader.lookup(u.keys_of(eng, a)) == 2 and ra in eng.scheduler.prefill
        rb = llm.add_request("b", b, max_tokens=2)
        while llm.has_work():
            llm.step()
        assert rb.result.hit_tokens == BUDGET and ra.result.hit_tokens == 0
    with open_engine(spec, hf.dir, write="off") as ref:
        want = [r.tokens for r in ref.generate([a, b], 2)]
    assert [ra.tokens, rb.tokens] == want


def _preempt_mid_prompt(spec, weights, connector_cls, finish: bool):
    """A short request decodes while a 24-token prompt arrives; they share mixed steps (its decode
    row, then a 7-token chunk) with every chunk's save held back (a closed ``save_gate``), until the
    decode needs a block that only the prompt holds: the prompt is preempted between its chunks.
    The scheduler's wait for commits is off (``wait_for_commits``), so the preemption happens with the
    saves still held (the engine's own allocation would first wait for the commits whose pins hold the
    next free blocks: a second line of defence, not tested here).
    Every block the allocator hands out then is overwritten, the saves go, and (``finish``) both
    requests finish. Returns (saved blocks of the held saves that were in the free list, pool, their keys, prompt,
    tokens per request, the reference tokens of each request alone)."""
    g = torch.Generator().manual_seed(7)
    short, prompt = u.rand_prompt(g, 3), u.rand_prompt(g, 3 * BUDGET)
    gate, pool = threading.Event(), HostPool(1 << 24)
    make = lambda p, c, a, n: connector_cls(p, c, a, write="async", stats=n)   # noqa: E731
    with open_engine(spec, weights, write="async", pool=pool, max_num_batched_tokens=BUDGET, num_blocks=8,
                     make_connector=make, faults=Faults(save_gate=gate)) as eng:
        llm, alloc, s = eng.core, eng.alloc, eng.scheduler
        s.wait_for_commits = False
        r0 = llm.add_request("short", short, max_tokens=20)
        for _ in range(6):
            llm.step()                               # r0: prefill and 5 decodes (8 tokens cached)
        r = llm.add_request("long", prompt, max_tokens=4)
        saved, held, mixed = [], [], 0
        for _ in range(20):
            if r.result.preemptions:
                break
            held = list(r.table)                     # its blocks before this step
            inner = eng.runner.submit
            plans = []
            eng.runner.submit = lambda plan, **kw: (plans.append(plan), inner(plan, **kw))[1]   # noqa: E731
            llm.step()
            eng.runner.submit = inner
            for p in plans:
                mixed += p.mixed
                saved += [b for row in p.rows if row.request is r for b in row.save_block_ids]
        assert r.result.preemptions == 1 and r in s.waiting and r.table == [] and mixed >= 2
        assert len(saved) >= 2 and set(saved) <= set(held) and len(pool) == 0   # preempted between chunks
        freed = [b for b in saved if not alloc.is_pinned(b)]
        _overwrite_free_blocks(eng)
        keys = u.keys_of(eng, prompt)[:len(saved)]
        gate.set()
        eng.drain()
        pooled = {k: pool.get(k) for k in keys}
        if not finish:
            return freed, pooled, keys, prompt, None, None
        while llm.has_work():
            llm.step()                               # the prompt is recomputed (a pool hit if saved right)
        eng.drain()
        assert alloc.num_free == alloc.num_blocks    # every pin went with its commit
        assert eng.core.stats()["loaded_blocks"] >= len(saved)   # the recompute loaded what the chunks saved
        tokens = [r0.tokens, r.tokens]
    with open_engine(spec, weights, write="off") as ref:
        want = [ref.generate([short], 20)[0].tokens, ref.generate([prompt], 4)[0].tokens]
    return freed, pooled, keys, prompt, tokens, want


@pytest.mark.parametrize("connector_cls,safe", [(KVConnector, True), (PerRequestPins, False)])
def test_a_prompt_preempted_between_chunks_keeps_each_chunks_blocks_until_its_own_save_lands(
        request, connector_cls, safe):
    spec, hf = u.TINY_QWEN3, request.getfixturevalue("qwen")
    freed, pooled, keys, prompt, tokens, want = _preempt_mid_prompt(spec, hf.dir, connector_cls, finish=safe)
    ref, _ = u.reference_blocks(spec, hf.dir, [prompt], max_num_batched_tokens=BUDGET)
    # the chunks here are 7 tokens (a decode row shares each step), the reference's 8: the same KV
    # up to float rounding (other GEMM shapes), so the blocks are compared at 1e-4, not bit for bit
    as_floats = lambda b: torch.frombuffer(bytearray(b), dtype=torch.float32)   # noqa: E731 (float32 KV)
    missing = [k for k in keys if pooled[k] is None]
    wrong = [k for k in keys if pooled[k] is not None
             and not torch.allclose(as_floats(pooled[k]), as_floats(ref[k]), rtol=0, atol=u.ATOL)]
    if safe:
        assert freed == [] and missing == [] and wrong == []
        assert tokens == want                        # and both requests still give their own tokens
    else:                                            # the negative control: the check catches it
        assert freed and wrong, (freed, missing, wrong)
