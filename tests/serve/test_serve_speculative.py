"""``graphgen serve --speculative mtp``: the official ``openai`` client gets the greedy completions
of non-speculative decoding (the prompts sent concurrently: verify rows batched, async scheduling on,
the server's default), the acceptance counters on ``/metrics`` under vLLM's names, a 400 naming the
field for what speculation cannot do, a seeded sampled request reproducible; a spec without MTP
layers is refused at startup in one sentence, exit 2."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import urllib.request

import openai
import pytest

from graphgen.modelspec.loader import load_spec
from graphgen.runtime import open_engine
from graphgen.runtime.checkpoint.hf import write_random_hf_checkpoint
from support.inproc import cli_inproc
from support.paths import TINY_DSV3_MTP, TINY_QWEN3

PROMPTS = [[5, 17, 99, 3, 42], list(range(1, 14)), [7, 7, 1], list(range(30, 39))]
N_NEW = 6


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    dims = dataclasses.asdict(load_spec(TINY_DSV3_MTP).dims)
    return write_random_hf_checkpoint(str(tmp_path_factory.mktemp("serve_mtp") / "ckpt"), "deepseek_v3", dims,
                                      seed=11, mtp_layers=1)


@pytest.mark.slow  # a server process
def test_serve_speculative_equals_greedy_and_reports_acceptance(servers, mtp_ckpt):
    with open_engine(TINY_DSV3_MTP, mtp_ckpt) as eng:  # non-speculative greedy decoding (= serve without it)
        want = [r.tokens for r in eng.generate(PROMPTS, N_NEW)]
    s = servers.get(mtp_ckpt, "--speculative", "mtp", "--num-speculative-tokens", "2", spec=TINY_DSV3_MTP)
    # (its exit 0 on SIGTERM: the factory's)
    c = s.client()

    def one(p, **kw):
        r = c.completions.create(model="tiny_deepseek_v3_mtp", prompt=p, max_tokens=N_NEW,
                                 extra_body={"ignore_eos": True}, **kw)
        return list(r.choices[0].model_extra["token_ids"])

    with cf.ThreadPoolExecutor(len(PROMPTS)) as ex:
        got = list(ex.map(lambda p: one(p, temperature=0), PROMPTS, timeout=120))
    assert got == want
    sampled = [one(PROMPTS[0], temperature=0.9, seed=3) for _ in range(2)]
    assert sampled[0] == sampled[1] and len(sampled[0]) == N_NEW
    for field, kw in (("logprobs", {"logprobs": 2}), ("presence_penalty", {"presence_penalty": 0.5}),
                      ("logit_bias", {"logit_bias": {"5": 1.0}})):
        with pytest.raises(openai.BadRequestError) as e:
            one(PROMPTS[0], **kw)
        assert e.value.body["param"] == field and "--speculative" in e.value.body["message"], e.value.body
    text = urllib.request.urlopen(s.base + "/metrics", timeout=30).read().decode()
    metrics = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln and not ln.startswith("#")}
    drafts = metrics["graphgen_spec_decode_num_draft_tokens_total"]
    accepted = metrics["graphgen_spec_decode_num_accepted_tokens_total"]
    per_pos = [metrics[f'graphgen_spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'] for i in (0, 1)]
    assert drafts > 0 and 0 <= accepted <= drafts and sum(per_pos) == accepted and per_pos[0] >= per_pos[1]
    assert metrics['vllm:spec_decode_num_draft_tokens_total{model_name="tiny_deepseek_v3_mtp"}'] == drafts


@pytest.mark.slow  # a server process that refuses to start
def test_serve_refuses_speculative_without_mtp_layers(tmp_path):
    qwen = write_random_hf_checkpoint(str(tmp_path / "qwen"), "qwen3_dense",
                                      dataclasses.asdict(load_spec(TINY_QWEN3).dims), tokenizer=False)
    res = cli_inproc("serve", "--spec", TINY_QWEN3, "--weights", qwen, "--port", "0", "--speculative", "mtp")
    assert res.returncode == 2 and "has no MTP layers" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_run_speculative_prints_its_acceptance_rate_and_takes_torch_threads(mtp_ckpt):
    """``graphgen run --speculative mtp`` (issue 30 item 7): the run's draft acceptance rate on stderr,
    equal to the per-prompt counters ``--json`` prints; ``--torch-threads`` is the same flag as serve's."""
    res = cli_inproc("run", "--spec", TINY_DSV3_MTP, "--weights", mtp_ckpt, "--speculative", "mtp", "--json",
                     "--torch-threads", "1", "--max-new-tokens", "6", "--ignore-eos", "--prompt-ids", "5,17,99,3,42")
    assert res.returncode == 0, res.stderr[-2000:]
    (row,) = [json.loads(s) for s in res.stdout.splitlines() if s.startswith("{")]
    drafts, accepted = row["spec_decode_num_draft_tokens"], row["spec_decode_num_accepted_tokens"]
    assert drafts > 0
    assert f"acceptance rate {100.0 * accepted / drafts:.1f}% ({accepted}/{drafts} draft tokens accepted)" in res.stderr
    bad = cli_inproc("run", "--spec", TINY_DSV3_MTP, "--weights", mtp_ckpt, "--torch-threads", "0",
                     "--prompt-ids", "1")
    assert bad.returncode == 2 and "--torch-threads must be >= 1, got 0" in bad.stderr, bad.stderr
