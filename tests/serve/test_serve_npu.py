"""``graphgen serve --target npu --standin``: the server over the NPU model runner (CPU stand-in), one
request through the official ``openai`` client; its greedy tokens equal ``graphgen run --target npu
--standin``'s. A wiring check of the server over the NPU runner, not an NPU result."""
from __future__ import annotations

import json

from serve_util import ROOT, Server
from support.cli import graphgen, run_args

SPEC = ROOT / "specs" / "tiny_qwen3_npu.yaml"
PROMPT = list(range(5, 40))


def test_serve_target_npu_standin_one_request(npu_ckpts):
    ckpt = npu_ckpts["tiny_qwen3_npu"]
    s = Server(ckpt, "--target", "npu", "--standin", "--ignore-eos", "--no-async-scheduling", spec=SPEC, cli=True)
    try:
        r = s.client().completions.create(model="tiny_qwen3_npu", prompt=PROMPT, max_tokens=3, temperature=0)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
        got = list(r.choices[0].model_extra["token_ids"])
    finally:
        rc = s.terminate()
    err = s.proc.stderr.read()
    assert rc == 0, err[-3000:]
    assert "not an NPU result" in err  # the one line on what is verified
    res = graphgen(*run_args(SPEC, ckpt, [PROMPT], 3, "--target", "npu", "--standin", "--ignore-eos"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert got == json.loads(res.stdout.splitlines()[0])["tokens"]
