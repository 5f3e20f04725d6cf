"""MTP through P/D, in one process (the handoff contract of docs/pd.md, "MTP through P/D"; the cluster on a
real Mooncake with the router: tests/serve/test_pd.py): a speculative P runs the prompt with ``max_tokens``
1 and saves the prompt's blocks **with the MTP layer's KV**, under the successor-keyed names its
`CacheNaming` hands off; a speculative D on the same pool loads them, and its drafts read that KV: every
draft's logits equal a cold run's (atol 1e-4), so the acceptance is the cold run's. Negative controls: a D
whose loads drop the MTP layer's part drafts differently; an engine without speculation names other keys
(no successor) and finds none of P's blocks."""

from __future__ import annotations

import dataclasses

import pytest

from graphgen.modelspec.loader import load_spec
from graphgen.runtime import HostPool, open_engine
from graphgen.runtime.checkpoint.hf import write_random_hf_checkpoint
from support.hf import ATOL
from support.paths import TINY_DSV3_MTP
from support.mtp import drop_mtp_kv
from support.tokens import assert_tokens_agree

SPEC = load_spec(TINY_DSV3_MTP)
BS = SPEC.kv_cache.block_size
MARGIN = 1e-4  # a K+1-row verify GEMM rounds differently from a 1-row one (tests/runtime/test_mtp_speculative.py)
PROMPT = [5, 17, 99, 3, 42, 8, 8, 1, 250, 7, 19, 60, 2]  # 13 tokens: 3 full blocks, all handed off
NEW = 6


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    return write_random_hf_checkpoint(str(tmp_path_factory.mktemp("mtp_pd") / "ckpt"), "deepseek_v3",
                                      dataclasses.asdict(SPEC.dims), seed=11, tokenizer=False, mtp_layers=1)


def _engine(ckpt, pool, **kw):
    return open_engine(TINY_DSV3_MTP, ckpt, pool=pool, write="async", num_speculative_tokens=2, **kw)


def test_prefill_hands_off_the_mtp_kv_and_the_first_drafts_read_it(mtp_ckpt):
    L = SPEC.dims.num_hidden_layers
    with open_engine(TINY_DSV3_MTP, mtp_ckpt, write="off", collect_logits=True) as eng:
        plain = eng.generate([PROMPT], NEW)[0]  # non-speculative greedy: the tokens' reference
    with _engine(mtp_ckpt, HostPool(1 << 24), collect_logits=True) as eng:
        cold = eng.generate([PROMPT], NEW)[0]  # speculative, nothing in its pool
    assert cold.hit_tokens == 0 and len(cold.draft_logits) > 1
    pool = HostPool(1 << 24)
    with _engine(mtp_ckpt, pool) as p:  # P: one token (dropped), its blocks saved once their MTP KV is computed
        naming = p.kv_naming()
        (keys,) = naming.handoff_keys(PROMPT)
        assert naming.lookahead and len(keys) == (len(PROMPT) - 1) // BS == 3 and all("@la" in k for k in keys)
        pre = p.generate([PROMPT], 1)[0]
        p.drain()
        # the request finished on its prefill's token: the draft run after it still ran and saved the blocks
        assert pre.saved_blocks == len(PROMPT) // BS and pool.leading_run(keys) == 3
        assert pre.num_draft_tokens == 0  # nothing left to draft for
    with open_engine(TINY_DSV3_MTP, mtp_ckpt, pool=pool, write="async") as plain_d:  # D without speculation
        other = plain_d.kv_naming()
        assert not other.lookahead and pool.leading_run(other.handoff_keys(PROMPT)[0]) == 0
    with _engine(mtp_ckpt, pool, collect_logits=True) as d:
        assert d.kv_naming().handoff_keys(PROMPT) == [keys]  # D names P's blocks as P does
        got = d.generate([PROMPT], NEW)[0]
        assert got.hit_tokens == 3 * BS
        assert_tokens_agree(plain.tokens, plain.step_logits, got.tokens, MARGIN, where="after the handoff")
        assert len(got.draft_logits) == len(cold.draft_logits)
        for i, (a, b) in enumerate(zip(cold.draft_logits, got.draft_logits)):
            assert (a - b).abs().max().item() <= ATOL, f"draft run {i}"
        assert (got.num_draft_tokens, got.num_accepted_tokens, got.accepted_per_pos) == \
            (cold.num_draft_tokens, cold.num_accepted_tokens, cold.accepted_per_pos)

        drop_mtp_kv(d, L)  # negative control: a pool of the target's KV alone
        lost = d.generate([PROMPT], NEW)[0]
        assert lost.hit_tokens == 3 * BS
        worst = max((a - b).abs().max().item() for a, b in zip(cold.draft_logits, lost.draft_logits))
        assert worst > 1e-3, "the first drafts did not read the handed-off MTP KV"


def test_a_request_finished_by_its_first_token_saves_its_prompt_blocks(mtp_ckpt):
    """Not only P/D: under speculation a prompt's blocks are saved by the draft run after its prefill, so a
    request that ends on its first token (``max_tokens`` 1 here) keeps its blocks for that run; with write
    off nothing runs for it and its blocks go back at once."""
    pool = HostPool(1 << 24)
    with _engine(mtp_ckpt, pool, async_scheduling=True) as eng:
        free = eng.alloc.num_free
        first = eng.generate([PROMPT, PROMPT[:9]], 1, batch=True)
        eng.drain()
        assert [r.saved_blocks for r in first] == [3, 2] and eng.stats["puts"] == 5
        assert eng.alloc.num_free == free  # the held blocks went back after the draft run
    with open_engine(TINY_DSV3_MTP, mtp_ckpt, write="off", num_speculative_tokens=2) as eng:
        free = eng.alloc.num_free
        assert eng.generate([PROMPT], 1)[0].saved_blocks == 0 and eng.alloc.num_free == free


def test_a_ranks_instance_names_the_successor_keys_its_speculative_ranks_save(mtp_ckpt):
    """`DistributedEngine.kv_naming` (P/D over ranks) names each shard's keys from a probe of the ranks
    (`launcher._key_parts`): for speculative ranks, the successor keys their schedulers look up and their
    drafters save, as a one-rank engine names them. (The probe runs here on a one-rank engine; real tp-2
    speculative ranks' naming and saves: tests/parallel/test_mtp_ranks.py's tp-2 test.)"""
    from graphgen.runtime.parallel.launcher import DistributedEngine, _key_parts

    for k in (2, 0):
        kw = {"num_speculative_tokens": k} if k else {}
        with open_engine(TINY_DSV3_MTP, mtp_ckpt, pool=HostPool(1 << 20), write="async", **kw) as eng:
            class Ranks:  # the launcher's view: one probe answer per rank
                def on_ranks(self, fn):
                    return [fn(eng)]

            ranks, own = DistributedEngine.block_naming(Ranks()), eng.kv_naming()
            assert ranks.lookahead is own.lookahead is bool(k)
            assert ranks.handoff_keys(PROMPT) == own.handoff_keys(PROMPT) and _key_parts(eng)[-1] is bool(k)
