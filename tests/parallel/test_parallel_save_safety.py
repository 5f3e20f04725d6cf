"""The async-save correctness tests of the single-rank engine (tests/e2e/test_e2e_save_safety.py),
per rank at tp=2: with a slowed save (or a slowed pool), on EVERY rank

* the pooled bytes of each block the rank saved equal exactly that rank's computed KV for that block,
  read back from the rank's own cache after the run (for Qwen3 each rank's half of the heads under
  its own key; for DeepSeek-V3's MLA latent rank 0's put under the shared key, which must equal what
  rank 1 computed too);
* no block is visible in the shared pool before its save's event: right after ``generate`` returned
  (every save op, or every put, held by a gate the test opens afterwards: a file) none of the prompt's keys is in the pool, and every commit (put) of a
  rank began after that rank's last copy into staging had finished.

Negative control (tp=2 for both families, and cp=2): the same byte check with the save stream's
waits skipped in the generated mempool_prefill module (a ``source_hook`` every rank applies, armed
after an unmutated prompt on the same engine) and the forward slowed fails: the save reads KV the
forward has not written yet. The probes run in the rank processes
(`DistributedEngine.on_ranks`), so they are module-level functions. Every engine start is bounded.
"""

from __future__ import annotations

import time

import pytest
import torch

from graphgen.runtime import open_engine
from graphgen.runtime.core.faults import Faults, FileGate
from support.hf import rand_prompt
from support.hooks import drop_save_waits_once_armed
from support.paths import REPO

TIMEOUT = 60          # seconds a rank may take to answer one command
SAVE_DELAY = 0.02     # per save op, after the gate: the save lags the forward
PUT_DELAY = 0.02      # per pool put, after the gate: a slow pool
FORWARD_DELAY = 0.04  # per KV write: a save that does not wait reads before this write

SPECS = {"qwen3": "specs/tiny_qwen3_tp2.yaml", "deepseek": "specs/tiny_deepseek_v3_tp2ep2.yaml",
         "qwen3_cp2": "specs/tiny_qwen3_cp2.yaml"}  # cp: KV replicated over the CP ranks, CP rank 0 writes


@pytest.fixture(scope="module")
def weights(qwen, tiny_dsv3):
    """The session checkpoints of tests/conftest.py (tiny_qwen3's and tiny_deepseek_v3's dims)."""
    return {"qwen3": qwen.dir, "deepseek": tiny_dsv3.dir, "qwen3_cp2": qwen.dir}


# ---- probes, run in each rank process ---------------------------------------------------------

def _install_recorders(eng) -> None:
    """Record on this rank: which cache blocks each save reads for which keys (prepare_save), when
    each copy into staging finished (rt.kv_save) and when each commit put began (connector pool)."""
    rec = eng._save_probe = {"saves": [], "copies": [], "puts": []}
    conn, rt = eng.connector, eng.runner.rt
    prepare, kv_save, put, put_many = conn.prepare_save, rt.kv_save, conn.pool.put, conn.pool.put_many

    def prepare_save(block_ids, keys):
        rec["saves"].append((list(block_ids), list(keys)))
        return prepare(block_ids, keys)

    def kv_save_(*a, **k):
        kv_save(*a, **k)
        rec["copies"].append(time.perf_counter())

    def put_(key, value):
        if not batch:   # a put of put_many's own (a FaultyPool's loop) is counted there
            rec["puts"].append(time.perf_counter())
        return put(key, value)

    def put_many_(items):   # the connector puts a commit's blocks in batches: each item is one put
        rec["puts"].extend([time.perf_counter()] * len(items))
        batch.append(True)
        try:
            return put_many(items)
        finally:
            batch.pop()

    batch: list = []   # the commits run on one host-stream thread

    conn.prepare_save, rt.kv_save, conn.pool.put, conn.pool.put_many = prepare_save, kv_save_, put_, put_many_


def _visible(eng, prompt) -> list[str]:
    """This rank's keys of ``prompt`` the shared pool holds now."""
    return [k for k in eng.loader.block_keys(prompt) if eng.pool.contains(k)]


def _report(eng) -> dict:
    """After drain: for every key this rank saved, the pooled bytes vs this rank's cache block."""
    from graphgen.runtime.core.kvcache import pack_block

    rec = eng._save_probe
    blocks = {k: b for ids, keys in rec["saves"] for b, k in zip(ids, keys)}
    missing = [k for k in blocks if eng.pool.get(k) is None]
    wrong = [k for k, b in blocks.items() if k not in missing and eng.pool.get(k) != pack_block(eng.cache, b)]
    return {"keys": sorted(blocks), "missing": missing, "wrong": wrong, "copies": rec["copies"],
            "puts": rec["puts"], "layers": eng.cache.num_layers, "skipped": getattr(eng.connector.pool, "skipped_puts", 0)}


# ---- the tests ----------------------------------------------------------------------------------

def _prompt(seed: int, n: int = 13):
    return rand_prompt(torch.Generator().manual_seed(seed), n)   # 13: 3 full blocks of 4 + 1 token


@pytest.mark.parametrize("model,delay", [("qwen3", "save"), ("qwen3", "put"), ("deepseek", "save"),
                                         ("deepseek", "put"), ("qwen3_cp2", "save")])
def test_delayed_save_pools_each_ranks_exact_kv_only_after_its_event(model, delay, weights, tmp_path):
    p = _prompt(41)
    # every rank's save ops (or pool puts) wait on a file this test creates once it has looked
    gate = FileGate(tmp_path / "open", timeout_s=TIMEOUT)
    faults = Faults(save_delay_s=SAVE_DELAY, save_gate=gate) if delay == "save" else \
        Faults(put_delay_s=PUT_DELAY, put_gate=gate)
    t0 = time.monotonic()
    with open_engine(REPO / SPECS[model], weights[model], write="async", num_blocks=32, timeout=TIMEOUT,
                          faults=faults) as eng:
        eng.on_ranks(_install_recorders)
        try:
            r = eng.generate([p], 1)[0]
            visible_early = eng.on_ranks(_visible, p)   # generate returned; the saves are held
        finally:
            gate.open()
        eng.drain()
        reports = eng.on_ranks(_report)
        stats = eng.rank_stats
    assert time.monotonic() - t0 < 4 * TIMEOUT
    assert r.variant.startswith("mempool_prefill") and r.saved_blocks == 3
    assert visible_early == [[], []], "a block was visible before its save's event"
    for rank, rep in enumerate(reports):
        assert len(rep["keys"]) == 3, (rank, rep["keys"])
        assert (rep["missing"], rep["wrong"]) == ([], []), f"rank {rank}: pooled bytes differ from its cache"
        # every commit began after this rank's last copy into staging had finished
        assert len(rep["copies"]) == rep["layers"] and len(rep["puts"]) == 3, rank
        assert min(rep["puts"]) >= max(rep["copies"]), rank
    if model == "qwen3":   # each rank's half of the heads under its own keys
        assert set(reports[0]["keys"]).isdisjoint(reports[1]["keys"])
        assert [s["puts"] for s in stats] == [3, 3]
    else:                  # the latent (or cp: all KV): one key set, put by rank 0 only, equal to rank 1's cache
        assert reports[0]["keys"] == reports[1]["keys"]
        assert [s["puts"] for s in stats] == [3, 0] and reports[1]["skipped"] == 3


def _arm_dropped_save_waits(eng) -> None:   # probe, in each rank: from now on the save stream does not wait
    eng.runner.rt.drop_save_waits = True


@pytest.mark.parametrize("model", ["qwen3", "deepseek", "qwen3_cp2"])
def test_save_event_is_what_keeps_each_ranks_pooled_kv_correct(model, weights):
    """One engine, forward slowed: a prompt with the save stream's waits (exact on every rank), then,
    the waits skipped on every rank (`drop_save_waits_once_armed`), another prompt (wrong bytes)."""
    good_p, bad_p = _prompt(47, 9), _prompt(48, 9)   # 2 full blocks + 1 token each, no shared block
    with open_engine(REPO / SPECS[model], weights[model], write="async", num_blocks=32, timeout=TIMEOUT,
                     faults=Faults(forward_delay_s=FORWARD_DELAY), source_hook=drop_save_waits_once_armed) as eng:
        results, reports = [], []
        for p in (good_p, bad_p):
            eng.on_ranks(_install_recorders)   # a fresh record per prompt
            results.append(eng.generate([p], 1)[0])
            eng.drain()
            reports.append(eng.on_ranks(_report))
            eng.on_ranks(_arm_dropped_save_waits)
    assert all(r.variant.startswith("mempool_prefill") and r.saved_blocks == 2 for r in results)
    good, bad = reports
    assert [(g["missing"], g["wrong"]) for g in good] == [([], []), ([], [])], "unmutated: must be exact"
    for rank, b in enumerate(bad):
        assert len(b["keys"]) == 2, (rank, b["keys"])   # the second prompt's saves only
        assert b["missing"] == [], "the mutation only removes the wait: the blocks are still committed"
        assert b["wrong"], f"rank {rank}: without the wait the save must read KV not yet written"
