"""Two DeepSeek-V3 configs a random-config check against transformers found broken, end to end:

- ``q_lora_rank: null`` (uncompressed queries, DeepSeek-V2-Lite style: one ``q_proj``);
- ``n_shared_experts: 0`` (transformers still writes the shared-expert projections, zero-size).

Each case builds a random transformers model, saves it with ``save_pretrained``, imports its config
with ``graphgen import-hf`` and runs ``graphgen run --json --logits`` on the checkpoint, both through
the CLI's ``main`` in this interpreter (`support.inproc.cli_inproc`; the entry point as a subprocess:
tests/e2e/test_e2e_cli.py). Expected values come from transformers: the first generated
position's logits within 1e-4 and the greedy tokens.
"""

from __future__ import annotations

import json
import os

import pytest

import transformers  # noqa: F401  (an extra ./dev installs: a missing one fails, never skips)
import safetensors  # noqa: F401  (an extra ./dev installs: a missing one fails, never skips)

import torch  # noqa: E402

from graphgen.families import FAMILIES  # noqa: E402
import support.hf as hfm  # noqa: E402
from support.cli import cli_inproc  # noqa: E402

ATOL = 1e-4



CASES = {
    "q_lora_null": dict(hfm.DSV3_DIMS, q_lora_rank=None),
    "no_shared_experts": dict(hfm.DSV3_DIMS, n_shared_experts=0),
    "both": dict(hfm.DSV3_GROUPED_YARN_DIMS, q_lora_rank=None, n_shared_experts=0),
}


def _cli(*args):
    return cli_inproc(*args, timeout=300)


def _saved_shapes(hf_dir: str) -> dict[str, tuple]:
    from safetensors import safe_open

    with safe_open(os.path.join(hf_dir, "model.safetensors"), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


@pytest.mark.parametrize("case", CASES)
def test_layout_matches_transformers(case, tmp_path):
    """The family's checkpoint layout is exactly what transformers' save_pretrained writes (keys and
    shapes, zero-size shared experts included; the tied-free configs here store lm_head)."""
    dims = CASES[case]
    _, hf_dir = hfm.build_hf_model("deepseek_v3", dims, str(tmp_path / "hf"), seed=0)
    fam = FAMILIES["deepseek_v3"]
    assert _saved_shapes(hf_dir) == fam.checkpoint_layout(fam.dims_of(dims))


@pytest.mark.parametrize("case", CASES)
def test_import_and_run_match_transformers(case, tmp_path):
    dims = CASES[case]
    model, hf_dir = hfm.build_hf_model("deepseek_v3", dims, str(tmp_path / "hf"), seed=3)
    shapes = _saved_shapes(hf_dir)
    # the checkpoint really has the shape that used to be refused
    if dims["n_shared_experts"] == 0:
        assert shapes["model.layers.1.mlp.shared_experts.gate_proj.weight"][0] == 0
    if dims["q_lora_rank"] is None:
        assert "model.layers.0.self_attn.q_proj.weight" in shapes
        assert not any("q_a_proj" in k for k in shapes)

    spec_path = tmp_path / "m.yaml"
    res = _cli("import-hf", hf_dir, "--out", spec_path, "--name", "gap_model")
    assert res.returncode == 0, res.stderr
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, dims["vocab_size"], (7,), generator=g).tolist()
    res = _cli("run", "--spec", spec_path, "--weights", hf_dir, "--json", "--logits", "--max-new-tokens", 3,
               "--num-blocks", 16, "--prompt-ids", ",".join(map(str, prompt)))
    assert res.returncode == 0, res.stderr
    (obj,) = [json.loads(line) for line in res.stdout.splitlines() if line.strip()]
    tokens = obj["tokens"]
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([prompt + tokens[:-1]])).logits[0].float()[len(prompt) - 1:]
    assert tokens == ref.argmax(-1).tolist(), "graphgen's greedy tokens differ from transformers'"
    err = (torch.tensor(obj["logits"]) - ref[0]).abs().max().item()
    assert err <= ATOL, f"{case}: logits vs transformers max |diff| {err:.3g}"
