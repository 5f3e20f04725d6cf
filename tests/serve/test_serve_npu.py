"""``graphgen serve --target npu --standin``: the server over the NPU model runner (CPU stand-in), one
request through the official ``openai`` client; its greedy tokens equal ``graphgen run --target npu
--standin``'s. A wiring check of the server over the NPU runner, not an NPU result."""
from __future__ import annotations

import json

from serve_util import ROOT
from support.cli import graphgen, run_args

SPEC = ROOT / "specs" / "tiny_qwen3_npu.yaml"
PROMPT = list(range(5, 40))


def test_serve_target_npu_standin_one_request(servers, npu_ckpts):
    ckpt = npu_ckpts["tiny_qwen3_npu"]
    s = servers.get(ckpt, "--target", "npu", "--standin", "--ignore-eos", "--no-async-scheduling", spec=SPEC,
                    cli=True)
    r = s.client().completions.create(model="tiny_qwen3_npu", prompt=PROMPT, max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    got = list(r.choices[0].model_extra["token_ids"])
    assert "not an NPU result" in s.stderr(10**6)  # the one line on what is verified (its exit 0: the factory's)
    res = graphgen(*run_args(SPEC, ckpt, [PROMPT], 3, "--target", "npu", "--standin", "--ignore-eos"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert got == json.loads(res.stdout.splitlines()[0])["tokens"]
