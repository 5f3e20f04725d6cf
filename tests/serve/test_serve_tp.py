"""``graphgen serve`` on two tensor-parallel ranks (``tiny_qwen3_tp2``: the spec's own ``parallel: {tp: 2}``),
driven by the ``openai`` client on 127.0.0.1: greedy completions, sent concurrently (continuous batching
over the ranks), equal what ``graphgen run --tp 2 --json`` prints for the same prompts (whose logits
tests/parallel checks against transformers); a seeded sampled request gives the same tokens twice; an
unseeded one completes (that its ranks drew the same tokens is not visible from outside: only rank 0's
come back) and a greedy request after it, now a pool hit on both ranks, still gives ``run``'s tokens;
a ``json_schema`` request validates and gives a tp=1 engine's tokens for the same grammar; SIGTERM exits 0 (the
server factory's check). Every wait is bounded."""
from __future__ import annotations

import json

import jsonschema

from graphgen.runtime import SamplingParams, eos_token_ids, open_engine
from graphgen.serve.structured import response_format_grammar, structured
from serve_util import ROOT
from support.inproc import run_tokens_inproc

SPEC_TP2 = ROOT / "specs" / "tiny_qwen3_tp2.yaml"
PROMPTS = [[5, 17, 33, 2, 9, 100, 41], list(range(1, 14)), [255, 0, 128]]
N_NEW = 6
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                          "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["city", "n"], "additionalProperties": False}
RF = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}


def _run_tp2(ckpt) -> list[list[int]]:
    return run_tokens_inproc(SPEC_TP2, ckpt, PROMPTS, N_NEW, "--tp", "2", timeout=240)


def test_serve_tp2_greedy_equals_run_tp2_and_seeded_sampling_repeats(servers, ckpt):
    want = _run_tp2(ckpt)
    assert len(want) == len(PROMPTS)
    s = servers.get(ckpt, "--write", "sync", "--num-blocks", "64", spec=SPEC_TP2)  # (exit 0: the factory's)
    c = s.client()
    assert s.greedy(PROMPTS, N_NEW, "tiny_qwen3_tp2") == want

    def sampled(**kw):
        r = c.completions.create(model="tiny_qwen3_tp2", prompt=[9, 8, 7], max_tokens=8, temperature=1.0,
                                 **kw)
        return list(r.choices[0].model_extra["token_ids"])

    first, second = sampled(seed=1234), sampled(seed=1234)
    assert first == second and len(first) == 8
    # no seed: the server chose one for both ranks (ignore_eos: a random draw may hit EOS before 8)
    assert len(sampled(extra_body={"ignore_eos": True})) == 8
    assert s.greedy(PROMPTS[:1], N_NEW, "tiny_qwen3_tp2") == want[:1]  # its blocks now come from the pool on both ranks

    # structured output at tp=2: each rank builds its own matcher from the request's grammar and
    # advances it with the token every rank sampled from the same gathered logits. A rank whose
    # matcher diverged would feed a different token next step, which the ranks' plan-fingerprint
    # check refuses; the tokens equal one in-process tp=1 engine given the same grammar.
    r = c.completions.create(model="tiny_qwen3_tp2", prompt=[9, 8, 7], max_tokens=40, temperature=0,
                             extra_body={"response_format": RF})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    structured_tp2 = list(r.choices[0].model_extra["token_ids"])
    params = SamplingParams(max_tokens=40, structured=structured(response_format_grammar(RF), str(ckpt), "rf"))
    with open_engine(ROOT / "specs" / "tiny_qwen3.yaml", ckpt, num_blocks=64,
                     eos_token_ids=eos_token_ids(ckpt)) as e:
        req = e.core.add_request("tp1", [9, 8, 7], params)
        while not req.finished:
            e.core.step()
        assert structured_tp2 == req.tokens
