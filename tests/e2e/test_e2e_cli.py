"""Acceptance 6 (and the CLI half of 1): `graphgen run` as a user runs it, in a subprocess (the
entry point); the error and flag cases through the CLI's ``main`` in this interpreter
(`support.inproc.cli_inproc`: same exit status and output, no second torch import).

`--json` prints one object per prompt, in order; the prompts share one engine and pool, so a repeated
prompt hits (write sync: the commit is done before the next prompt's lookup, so the hit is
deterministic); `--logits` prints the first generated position's logits, compared to transformers.
Bad input exits 2 with a message, never a traceback."""

from __future__ import annotations

import json

import pytest
import torch

import e2e_util as u

from graphgen.modelspec.loader import load_spec
from support.cli import cli_inproc

N_NEW = 3


@pytest.mark.parametrize("family", ["qwen3_dense", "deepseek_v3"])
def test_cli_run_json_logits_hits(family, imported):
    case = imported[family]
    bs = load_spec(case.spec).kv_cache.block_size
    g = torch.Generator().manual_seed(21)
    a = u.rand_prompt(g, bs + 2)
    b = a[:bs] + u.rand_prompt(g, 3)   # shares a's first full block
    prompts = [a, a, b]
    args = ["run", "--spec", case.spec, "--weights", case.hf.dir, "--write", "sync", "--json", "--logits",
            "--max-new-tokens", N_NEW, "--num-blocks", 16]
    for p in prompts:
        args += ["--prompt-ids", ",".join(map(str, p))]
    res = u.cli(*args)
    assert res.returncode == 0, res.stderr
    objs = [json.loads(line) for line in res.stdout.splitlines() if line.strip()]
    assert len(objs) == len(prompts)
    for i, (obj, p) in enumerate(zip(objs, prompts)):
        assert {"tokens", "hit_tokens", "ttft_ms", "logits"} <= set(obj), obj.keys()
        assert isinstance(obj["ttft_ms"], (int, float)) and obj["ttft_ms"] >= 0
        # order: object i belongs to prompt i (its tokens are prompt i's greedy continuation)
        assert len(obj["tokens"]) == N_NEW
        ref = u.assert_greedy_by_hf(case.hf.model, p, obj["tokens"], f"prompt {i}")[0]
        got = torch.tensor(obj["logits"])
        assert got.shape == ref.shape
        err = (got - ref).abs().max().item()
        assert err <= u.ATOL, f"prompt {i}: CLI logits vs HF max |diff| {err:.3g}"
    # first run cold; the repeat and the shared-prefix prompt reuse a's committed block
    assert [o["hit_tokens"] for o in objs] == [0, bs, bs]
    assert [o["variant"] for o in objs] == ["mempool_prefill", "splitfuse", "splitfuse"]


def test_cli_run_bad_input_exits_2(qwen, dsv3):
    cases = {
        "bad ids": (["--spec", u.TINY_QWEN3, "--weights", qwen.dir, "--prompt-ids", "abc"],
                    ["--prompt-ids", "expected comma-separated integers"]),
        # DSV3_DIMS has 2 layers, 4 experts, n_group 1: not the 3-layer spec
        "dims mismatch": (["--spec", u.TINY_DSV3, "--weights", dsv3.dir, "--prompt-ids", "1,2,3"],
                          ["does not match spec tiny_deepseek_v3", "num_hidden_layers", "import-hf"]),
        # same layers/hidden/vocab as tiny_qwen3, but another family: must not get as far as a KeyError
        "family mismatch": (["--spec", u.TINY_QWEN3, "--weights", dsv3.dir, "--prompt-ids", "1,2,3"],
                            ["does not match spec tiny_qwen3", "deepseek_v3", "import-hf"]),
    }
    for name, (argv, needles) in cases.items():
        res = cli_inproc("run", *argv)
        out, err = res.stdout, res.stderr
        assert res.returncode == 2, f"{name}: exit {res.returncode}\n{err}"
        assert "Traceback" not in err, f"{name}: {err}"
        assert out == "", f"{name}: {out}"
        for needle in needles:
            assert needle in err, f"{name}: {needle!r} not in {err!r}"


def test_cli_run_pool_policy_flag_and_a_bad_value(ckpt):
    """``--pool-policy`` overrides pool.policy and ``--pool-min-uses`` pool.min_uses:
    write_through_selective with min_uses 3 (the spec's default is 2) computes a repeated prompt
    three times before the fourth one hits; a bad value of either exits 2 with one sentence."""
    p = ",".join(str(t) for t in range(1, 11))   # 10 tokens: 2 full blocks of tiny_qwen3 (block 4)
    base = ["run", "--spec", u.TINY_QWEN3, "--weights", ckpt, "--write", "sync", "--json",
            "--max-new-tokens", 2, "--num-blocks", 16]
    good = cli_inproc(*base, "--pool-policy", "write_through_selective", "--pool-min-uses", 3,
                      *["--prompt-ids", p] * 4)
    bad = cli_inproc(*base, "--pool-policy", "write_sometimes", "--prompt-ids", p)
    bad_uses = cli_inproc(*base, "--pool-min-uses", 0, "--prompt-ids", p)
    assert good.returncode == 0, good.stderr
    assert [json.loads(line)["hit_tokens"] for line in good.stdout.splitlines() if line.strip()] == [0, 0, 0, 8]
    assert bad_uses.returncode == 2 and bad_uses.stdout == "" and "Traceback" not in bad_uses.stderr
    assert bad_uses.stderr.strip().splitlines() == ["graphgen run: error: --pool-min-uses must be >= 1, got 0"], bad_uses.stderr
    assert bad.returncode == 2 and bad.stdout == "" and "Traceback" not in bad.stderr
    last = bad.stderr.strip().splitlines()[-1]  # argparse's one sentence (after its usage line)
    assert "argument --pool-policy: invalid choice: 'write_sometimes'" in last and "write_back" in last
