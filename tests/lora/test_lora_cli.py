"""Multi-LoRA at the CLI (issue 40): ``graphgen serve --lora-modules NAME=PATH`` -- /v1/models lists each adapter,
``"model": NAME`` picks it, an unknown model is a 404 as vLLM answers -- driven by the official ``openai`` client;
``graphgen run --lora PATH``; a bad adapter is one sentence and exit 2 before anything starts."""

from __future__ import annotations

import json

import openai
import pytest

from graphgen.modelspec.loader import load_spec
from support.cli import run_args
from support.hf import build_hf_model
from support.inproc import cli_inproc
from support.lora import SPECS, assert_greedy_within, hf_dims, write_adapter
from support.servers import Server

SPEC = SPECS["qwen3_dense"]
PROMPT = [5, 17, 33, 2, 250, 9, 41]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_cli")
    base, folder = build_hf_model("qwen3_dense", hf_dims(load_spec(SPEC)), str(tmp / "base"), seed=5)
    refs = {None: base, "a": write_adapter(base, tmp / "a", ["q_proj", "v_proj", "down_proj"], 4, 8, False, seed=1),
            "b": write_adapter(base, tmp / "b", ["o_proj", "up_proj"], 8, 8, True, seed=2)}
    return tmp, folder, refs


@pytest.mark.slow
def test_serve_lists_adapters_picks_them_by_model_and_404s_unknown(ckpt):
    tmp, folder, refs = ckpt
    server = Server(folder, "--lora-modules", f"a={tmp / 'a'}", f"b={tmp / 'b'}", spec=SPEC)
    try:
        c = server.client()
        models = {m.id: m for m in c.models.list().data}
        assert set(models) == {"tiny_qwen3_lora", "a", "b"}
        assert models["a"].model_extra["parent"] == "tiny_qwen3_lora" and models["a"].model_extra["root"] == str(tmp / "a")
        got = {}
        for model, ref in (("a", "a"), ("b", "b"), ("tiny_qwen3_lora", None), ("a", "a")):
            r = c.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
            assert r.model == model
            got.setdefault(model, []).append(list(r.choices[0].model_extra["token_ids"]))
            assert_greedy_within(refs[ref], PROMPT, got[model][-1], what=f"served {model}")
        assert got["a"][0] == got["a"][1]  # the second one hit the pool: same tokens
        with pytest.raises(openai.NotFoundError) as info:
            c.completions.create(model="c", prompt=PROMPT, max_tokens=2)
        assert info.value.status_code == 404 and info.value.body["code"] == "model_not_found"
        assert "'a', 'b'" in info.value.body["message"]
    finally:
        server.terminate()


def test_run_lora_and_bad_adapters_at_the_cli(ckpt):
    tmp, folder, refs = ckpt
    # a spec without a lora: section: --lora gives it one (vLLM's defaults), the graphs compiled on the fly
    res = cli_inproc(*run_args(SPECS["qwen3_dense"].parent / "tiny_qwen3.yaml", folder, [PROMPT], 4,
                               "--lora", tmp / "a"))
    assert res.returncode == 0, res.stderr[-3000:]
    tokens = [json.loads(s)["tokens"] for s in res.stdout.splitlines() if s.startswith("{")]
    assert_greedy_within(refs["a"], PROMPT, tokens[0], what="run --lora")
    for extra, says in ((("--lora", tmp / "missing"), "no such folder"),
                        (("--lora", tmp / "b", "--max-lora-rank", "1"), "rank r=8 exceeds lora.max_lora_rank 1"),
                        (("--max-loras", "0"), "--max-loras must be >= 1")):
        res = cli_inproc(*run_args(SPEC, folder, [PROMPT], 2, *extra))
        assert res.returncode == 2 and says in res.stderr and "Traceback" not in res.stderr, res.stderr[-2000:]
    res = cli_inproc("serve", "--spec", SPEC, "--weights", folder, "--port", "0", "--lora-modules", "a")
    assert res.returncode == 2 and "--lora-modules 'a': expected NAME=PATH" in res.stderr, res.stderr[-2000:]
