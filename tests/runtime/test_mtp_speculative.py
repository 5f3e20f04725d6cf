"""Greedy speculative decoding with the MTP layer, through the scheduler: the tokens equal
non-speculative greedy decoding and transformers' greedy continuation (wherever transformers' top-2
margin exceeds 1e-4: a K+1-row verify GEMM rounds differently from a 1-row one), for K = 1..3,
several prompt lengths batched together (chunked prefill and mixed steps), every write mode and
async scheduling; the acceptance counters add up; Qwen3 specs and checkpoints without MTP layers
are refused in one sentence."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from graphgen.modelspec.loader import load_spec
from graphgen.runtime import SamplingParams, open_engine
from graphgen.runtime.checkpoint.hf import write_random_hf_checkpoint
from graphgen.runtime.engine.spec_decode import check_speculative
from support.hf import hf_logits, load_hf_model, rand_prompt
from support.paths import TINY_DSV3_MTP, TINY_QWEN3
from support.mtp import drop_mtp_kv
from support.tokens import assert_tokens_agree, greedy_margins

SPEC = load_spec(TINY_DSV3_MTP)
MARGIN = 1e-4
NEW = 10


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    return write_random_hf_checkpoint(str(tmp_path_factory.mktemp("mtp_spec") / "ckpt"), "deepseek_v3",
                                      dataclasses.asdict(SPEC.dims), seed=11, tokenizer=False, mtp_layers=1)


@pytest.fixture(scope="module")
def hf_main(mtp_ckpt):
    return load_hf_model("deepseek_v3", mtp_ckpt).eval()


def _agrees_with_hf(model, prompt, tokens):
    """Each token is transformers' argmax at its position (teacher-forced), up to the first position
    whose top-2 margin is within MARGIN (rounding may pick either there; later tokens then follow it)."""
    ref = hf_logits(model, list(prompt) + list(tokens[:-1]))[len(prompt) - 1:]
    for i, tok in enumerate(tokens):
        top2 = ref[i].topk(2).values
        if (top2[0] - top2[1]).item() <= MARGIN:
            return True
        if tok != int(ref[i].argmax()):
            return False
    return True


def _check(ckpt, hf_main, prompts, ks, new, what, budget=8, **options):
    """Each K: all prompts at once through the scheduler (continuous batching; a step budget of 8
    tokens: longer prompts run in chunks, verify rows share steps with them; a budget of 3: verify
    rows cut to the drafts that fit)."""
    with open_engine(TINY_DSV3_MTP, ckpt, write=options.get("write"), collect_logits=True) as eng:
        plain = eng.generate(prompts, new)  # tokens and step logits: the reference's margins
    for k in ks:
        with open_engine(TINY_DSV3_MTP, ckpt, num_speculative_tokens=k, max_num_batched_tokens=budget,
                         **options) as eng:
            results = eng.generate(prompts, new, batch=True)
            stats = eng.core.stats()
        assert stats["mixed_steps"] > 0 or budget < 8, what  # verify rows and prompt chunks shared steps
        assert stats["spec_decode_num_draft_tokens"] == sum(r.num_draft_tokens for r in results) > 0
        for prompt, want, res in zip(prompts, plain, results):
            where = f"{what} K={k} prompt of {len(prompt)}"
            # a K+1-row verify GEMM rounds differently from a 1-row one: equal up to a near tie (support.tokens)
            assert_tokens_agree(want.tokens, want.step_logits, res.tokens, MARGIN, where=where)
            assert len(res.tokens) == new, where
            assert _agrees_with_hf(hf_main, prompt, res.tokens), where
            assert res.num_accepted_tokens == sum(res.accepted_per_pos) <= res.num_draft_tokens, where
            # a draft at position j is accepted only after every draft before it was
            assert all(a >= b for a, b in zip(res.accepted_per_pos, res.accepted_per_pos[1:])), where


def test_speculative_equals_greedy_and_transformers(mtp_ckpt, hf_main):
    gen = torch.Generator().manual_seed(3)
    _check(mtp_ckpt, hf_main, [rand_prompt(gen, n) for n in (3, 14)], (1, 3), 6, "write=off", write="off")


@pytest.mark.slow
@pytest.mark.parametrize("write,async_scheduling,budget", [("off", True, 8), ("sync", False, 3), ("async", True, 8)])
def test_speculative_equals_greedy_every_write_mode(write, async_scheduling, budget, mtp_ckpt, hf_main):
    gen = torch.Generator().manual_seed(4)
    _check(mtp_ckpt, hf_main, [rand_prompt(gen, n) for n in (3, 8, 13)], (1, 2, 3), NEW,
           f"write={write} async={async_scheduling} budget={budget}", budget, write=write,
           async_scheduling=async_scheduling)


def test_acceptance_counters_with_perfect_and_useless_drafts(mtp_ckpt):
    """The counters' controls: drafts that are the greedy continuation are all accepted (3 tokens per
    cycle), drafts that never match none (1 token per cycle); the output is greedy's either way. And a
    sampled request (temperature > 0) is reproducible from its seed."""
    prompt = [5, 17, 99, 3, 42]
    with open_engine(TINY_DSV3_MTP, mtp_ckpt, write="off", collect_logits=True) as eng:
        plain = eng.generate([prompt], NEW)[0]
    want = plain.tokens
    # the exact counters below need the speculative tokens to be greedy's: this prompt's every step has a
    # top-2 margin wider than MARGIN (the rounding this module allows a K+1-row verify GEMM; its narrowest
    # step is 4.5e-4 here), so rounding cannot move them (support.tokens; docs/testing.md)
    assert min(greedy_margins(plain.step_logits)) > MARGIN, greedy_margins(plain.step_logits)
    with open_engine(TINY_DSV3_MTP, mtp_ckpt, write="off", num_speculative_tokens=2) as eng:
        drafter = eng.core.drafter

        def perfect(r, logits, drafts, probs):  # the greedy continuation after what is drafted so far
            drafts[id(r)].append(want[len(r.tokens) + len(drafts[id(r)])])

        drafter._pick = perfect
        res = eng.generate([prompt], NEW)[0]
        assert res.tokens == want and res.num_draft_tokens == 6 == res.num_accepted_tokens  # 1 + 3 cycles x 3
        assert res.accepted_per_pos == [3, 3]
        drafter._pick = lambda r, logits, drafts, probs: drafts[id(r)].append((want[len(r.tokens)] + 1) % 256)
        res = eng.generate([prompt], NEW)[0]
        # every cycle emits one token; the drafts stop where no more tokens are needed
        assert res.tokens == want and res.num_accepted_tokens == 0 and res.num_draft_tokens == 2 * (NEW - 3) + 1
        # temperature > 0: the drafts are drawn from the MTP distribution and verified by rejection
        # sampling (tests/runtime/test_rejection_sampling.py proves its distribution), seeded per request
        del drafter._pick
        sampled = []
        for seed in (5, 5, 6):
            r = eng.core.add_request(None, prompt, SamplingParams(max_tokens=6, temperature=0.8, seed=seed))
            while eng.core.has_work():
                eng.core.step()
            assert r.result.num_draft_tokens > 0 and len(r.tokens) == 6
            sampled.append(r.tokens)
        assert sampled[0] == sampled[1] != sampled[2]


def test_refusals_are_one_sentence(mtp_ckpt, tmp_path):
    for bad, match in (((SPEC, 0), "in \\[1, 15\\]"), ((SPEC, 16), "in \\[1, 15\\]"),
                       ((load_spec(TINY_QWEN3), 1), "has no MTP layers")):
        with pytest.raises(ValueError, match=match):
            check_speculative(*bad)
    plain = write_random_hf_checkpoint(str(tmp_path / "plain"), "deepseek_v3", dataclasses.asdict(SPEC.dims),
                                       tokenizer=False)
    with pytest.raises(ValueError, match="num_nextn_predict_layers: 0"):
        open_engine(TINY_DSV3_MTP, plain)


def test_run_cli_speculative_reports_acceptance_and_refuses_in_one_sentence(mtp_ckpt, tmp_path):
    """Through the CLI's ``main`` in this interpreter (`support.inproc`; the entry point: tests/e2e)."""
    import json

    from support.cli import cli_inproc as cli, run_args

    prompts = [[5, 17, 99, 3, 42], [7, 7, 1]]
    res = cli(*run_args(TINY_DSV3_MTP, mtp_ckpt, prompts, 5, "--ignore-eos", "--speculative", "mtp",
                        "--num-speculative-tokens", "2"))
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(s) for s in res.stdout.splitlines() if s.startswith("{")]
    with open_engine(TINY_DSV3_MTP, mtp_ckpt) as eng:
        assert [r["tokens"] for r in rows] == [r.tokens for r in eng.generate(prompts, 5)]
    for r in rows:
        assert r["speculative"] == "mtp" and len(r["spec_decode_num_accepted_tokens_per_pos"]) == 2
        assert 0 <= r["spec_decode_num_accepted_tokens"] <= r["spec_decode_num_draft_tokens"]
    qwen = write_random_hf_checkpoint(str(tmp_path / "qwen"), "qwen3_dense",
                                      dataclasses.asdict(load_spec(TINY_QWEN3).dims), tokenizer=False)
    for argv, words in ((run_args(TINY_QWEN3, qwen, prompts[:1], 2, "--speculative", "mtp"), "has no MTP layers"),
                        (run_args(TINY_DSV3_MTP, mtp_ckpt, prompts[:1], 2, "--speculative", "mtp",
                                  "--num-speculative-tokens", "16"), "in [1, 15]")):
        res = cli(*argv)
        assert res.returncode == 2 and words in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


@pytest.mark.parametrize("write", ["sync", pytest.param("async", marks=pytest.mark.slow)])
def test_pool_hit_keeps_the_drafts(write, mtp_ckpt):
    """The pool-hit regression (SGLang #31600): after a full prefix hit from the pool, the draft
    logits of every step equal the cold run's (atol 1e-4) -- the MTP layer's KV came back with the
    target's. Negative control: a pool that drops the MTP layer's KV (its part of each loaded block
    zeroed) makes them differ."""
    from support.hf import ATOL

    L = SPEC.dims.num_hidden_layers
    prompt = [5, 17, 99, 3, 42, 8, 8, 1, 250, 7, 19]  # 11 tokens: (11 - 1) // 4 = 2 blocks looked up
    with open_engine(TINY_DSV3_MTP, mtp_ckpt, write=write, num_speculative_tokens=2, collect_logits=True) as eng:
        cold = eng.generate([prompt], 6)[0]
        eng.drain()
        assert cold.hit_tokens == 0 and cold.saved_blocks == 2 and eng.stats["puts"] == 2
        warm = eng.generate([prompt], 6)[0]
        assert warm.hit_tokens == 8 and warm.tokens == cold.tokens
        assert len(warm.draft_logits) == len(cold.draft_logits) > 0
        for a, b in zip(cold.draft_logits, warm.draft_logits):
            assert (a - b).abs().max().item() <= ATOL
        assert (warm.num_draft_tokens, warm.num_accepted_tokens) == (cold.num_draft_tokens, cold.num_accepted_tokens)

        drop_mtp_kv(eng, L)  # negative control: a pool of the target's KV alone
        lost = eng.generate([prompt], 6)[0]
        assert lost.hit_tokens == 8 and lost.tokens == cold.tokens  # the target verifies: output unchanged
        worst = max((a - b).abs().max().item() for a, b in zip(cold.draft_logits, lost.draft_logits))
        assert worst > 1e-3, "the drafts did not read the MTP layer's pooled KV"


def test_mtp_block_keys_carry_the_successor():
    from graphgen.runtime.pool.keys import mtp_block_keys
    from graphgen.runtime.pool.keys import block_keys

    a = mtp_block_keys([1, 2, 3, 4, 5, 6], 1, 4, model="m", layout="x")
    b = mtp_block_keys([1, 2, 3, 4, 9, 6], 1, 4, model="m", layout="x")
    assert a != b and a[0].endswith("@la5") and a[0].startswith(block_keys([1, 2, 3, 4], 4, model="m", layout="x")[0])
    with pytest.raises(ValueError, match="successor"):
        mtp_block_keys([1, 2, 3, 4], 1, 4, model="m", layout="x")
