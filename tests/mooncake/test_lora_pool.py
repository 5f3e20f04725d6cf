"""Multi-LoRA over Mooncake (issue 40): two ``graphgen run`` processes -- two servers -- with the same adapter
file (copied to another folder under another name: the key is the weights' digest, not the name or path) share
its blocks through a real Mooncake master, inside a private network namespace. That another adapter and the base
model miss those blocks is proven in one process on the embedded pool (tests/lora/test_lora_numerics.py)."""
from __future__ import annotations

import json
import shutil

from graphgen.modelspec.loader import load_spec
from support.hf import build_hf_model
from support.lora import SPECS, assert_greedy_within, hf_dims, write_adapter

PORT = 50140
URL = f"mooncake://127.0.0.1:{PORT}"
SPEC = str(SPECS["qwen3_dense"])
P = list(range(1, 14))  # 13 tokens: 3 full blocks of 4 saved, 3 looked up


def _run(ns, ckpt, lora):
    res = ns.run("run", "--spec", SPEC, "--weights", ckpt, "--pool", URL, "--json", "--max-new-tokens", "3",
                 "--lora", lora, "--prompt-ids", ",".join(map(str, P)))
    assert res.returncode == 0, res.stderr[-3000:]
    return [json.loads(s) for s in res.stdout.splitlines() if s.startswith("{")][0]


def test_the_same_adapter_on_two_servers_shares_blocks_through_mooncake(ns, tmp_path):
    base, ckpt = build_hf_model("qwen3_dense", hf_dims(load_spec(SPEC)), str(tmp_path / "base"), seed=4)
    ref = write_adapter(base, tmp_path / "a", ["q_proj", "k_proj", "v_proj", "o_proj"], 4, 8, False, seed=1)
    shutil.copytree(tmp_path / "a", tmp_path / "a_copy")
    ns.serve(PORT)
    first = _run(ns, ckpt, str(tmp_path / "a"))
    second = _run(ns, ckpt, str(tmp_path / "a_copy"))
    assert (first["hit_tokens"], second["hit_tokens"]) == (0, 12)
    assert second["tokens"] == first["tokens"]
    assert_greedy_within(ref, P, second["tokens"], what="the second server, from the pool")
