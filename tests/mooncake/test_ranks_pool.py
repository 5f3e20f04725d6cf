"""Ranks on Mooncake (issue 37 item 2): two engines of tp-2 ranks (tiny DeepSeek, MLA) on one real master inside
the test's network namespace, each rank process its own Mooncake client (`rank_process.open_rank_pool`).

What is proven: the second engine's ranks hit the first's blocks (the MIN the ranks agree on is the whole
saved prefix) and give its tokens (logits within the ranks' tolerance, `support.tokens`); MLA's latent is
saved once per TP group (rank 1 puts nothing, but reads rank 0's latent through its own client); a master
killed mid-run costs recomputes only: every later request is answered, with the tokens of a recompute."""
from __future__ import annotations

import dataclasses
import os
import signal

import pytest
import torch

from support.netns import ROOT
from support.tokens import assert_agree

PORT = 50130
URL = f"mooncake://127.0.0.1:{PORT}"
SPEC = os.path.join(ROOT, "specs", "tiny_deepseek_v3_tp2ep2.yaml")
BS = 4                                      # the spec's block size (checked below)
P = [(5 * i) % 200 + 3 for i in range(17)]  # 17 tokens: 4 blocks looked up and saved
K = [(7 * i) % 250 + 1 for i in range(13)]
TOL = 1e-3                                  # the ranks' own tolerance vs one rank (tests/parallel)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    from graphgen.modelspec.loader import load_spec
    from graphgen.runtime.checkpoint.hf import write_random_hf_checkpoint

    spec = load_spec(SPEC)
    assert spec.kv_cache.block_size == BS and spec.parallel.tp == 2
    ckpt = tmp_path_factory.mktemp("mooncake_ranks") / "tiny_deepseek_tp2"
    write_random_hf_checkpoint(ckpt, spec.family, dataclasses.asdict(spec.dims), seed=3)
    return str(ckpt)


def _agree(a, b, i, where):
    assert_agree(a["tokens"][i], [torch.tensor(s) for s in a["logits"][i]],
                 b["tokens"][i], [torch.tensor(s) for s in b["logits"][i]], TOL, where=where)


def test_two_tp2_engines_share_a_prefix_and_a_killed_master_costs_recomputes(ns, weights):
    _, master_pid = ns.serve(PORT)
    opts = dict(spec=SPEC, weights=weights, write="async", collect_logits=True)
    a = ns.engine(URL, name="a", **opts)
    ra = a.call(op="gen", prompts=[P], logits=True, timeout=60)
    assert ra["hit"] == [0]
    sa = a.call(op="stats")
    # each rank's own client: rank 0 put P's 4 blocks; rank 1 holds the same latent (MLA): put nothing
    assert [p["puts"] for p in sa["rank_pools"]] == [4, 0], sa["rank_pools"]
    assert sa["rank_engines"][1]["skipped_puts"] == 4

    b = ns.engine(URL, name="b", **opts)
    rb = b.call(op="gen", prompts=[P], logits=True, timeout=60)
    assert rb["hit"] == [4 * BS] and rb["variant"] == ["splitfuse"]
    _agree(ra, rb, 0, "engine b (hit) vs engine a (cold)")
    sb = b.call(op="stats")
    # both ranks read the pool through their own client (rank 1: rank 0's latent, saved once)
    assert all(p["get_hits"] >= 4 for p in sb["rank_pools"]), sb["rank_pools"]
    assert all(p["errors"] == 0 and p["rejected"] == 0 for p in sb["rank_pools"])

    os.kill(master_pid, signal.SIGKILL)     # mid-run: both engines keep their clients
    rb2 = b.call(op="gen", prompts=[P, K], logits=True, timeout=90)
    assert rb2["hit"] == [0, 0]             # nothing reachable: recomputed, answered
    _agree(ra, rb2, 0, "engine b (master down) vs engine a (cold)")
    ra2 = a.call(op="gen", prompts=[K], logits=True, timeout=90)
    assert ra2["hit"] == [0]
    _agree(ra2, rb2 | {"tokens": rb2["tokens"][1:], "logits": rb2["logits"][1:]}, 0, "K on a vs b, master down")
    sb = b.call(op="stats")
    assert any(p["down"] for p in sb["rank_pools"]), sb["rank_pools"]
