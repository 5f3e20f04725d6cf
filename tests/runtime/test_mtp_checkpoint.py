"""MTP weights: DeepSeek-V3's published layout (model.layers.{num_hidden_layers + k}.*) written by
write_random_hf_checkpoint and read by load_hf_weights (embedding/head shared with the target where the
checkpoint omits them); the engine refuses a spec whose MTP layers the checkpoint lacks; the MTP
layer is one more KV layer, so the pool keys' layout fingerprint differs with and without MTP."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from graphgen.families.deepseek_v3 import checkpoint_layout
from graphgen.modelspec.loader import load_spec
from graphgen.runtime.checkpoint.hf import WeightsError, check_config, load_hf_weights, write_random_hf_checkpoint
from graphgen.runtime.core.kvcache import PagedKVCache
from graphgen.runtime.pool.keys import block_keys
from support.paths import TINY_DSV3, TINY_DSV3_MTP

SPEC = load_spec(TINY_DSV3_MTP)
DIMS = dataclasses.asdict(SPEC.dims)
L = SPEC.dims.num_hidden_layers


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp_ckpts")
    return {name: write_random_hf_checkpoint(str(root / name), "deepseek_v3", DIMS, seed=3, tokenizer=False, **kw)
            for name, kw in (("plain", {}), ("mtp", {"mtp_layers": 1}),
                             ("mtp_shared", {"mtp_layers": 1, "mtp_copies": False}))}


def test_published_layout_is_written_and_read(ckpts):
    cfg = json.load(open(os.path.join(ckpts["mtp"], "config.json")))
    assert cfg["num_nextn_predict_layers"] == 1
    w = load_hf_weights(ckpts["mtp"], mtp_layers=1)
    p = f"model.layers.{L}"
    for part in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head", "embed_tokens"):
        assert f"{p}.{part}.weight" in w
    assert tuple(w[f"{p}.eh_proj.weight"].shape) == (SPEC.dims.hidden_size, 2 * SPEC.dims.hidden_size)
    # the MTP decoder layer is MLA + MoE (stacked experts, like every MoE layer the runtime holds)
    assert tuple(w[f"{p}.mlp.experts.gate_proj.weight"].shape)[0] == SPEC.dims.n_routed_experts
    assert set(w) == set(checkpoint_layout(SPEC.dims, stacked=True, mtp_layers=1))
    # published copies of the target's embedding and head
    assert torch.equal(w[f"{p}.embed_tokens.weight"], w["model.embed_tokens.weight"])
    assert torch.equal(w[f"{p}.shared_head.head.weight"], w["lm_head.weight"])


def test_target_weights_do_not_depend_on_mtp(ckpts):
    plain, mtp = load_hf_weights(ckpts["plain"]), load_hf_weights(ckpts["mtp"])
    assert set(plain) == set(mtp)  # without mtp_layers the MTP tensors are skipped, as before
    assert all(torch.equal(plain[k], mtp[k]) for k in plain)


def test_omitted_embedding_and_head_are_the_targets(ckpts):
    w = load_hf_weights(ckpts["mtp_shared"], mtp_layers=1)
    assert w[f"model.layers.{L}.embed_tokens.weight"] is w["model.embed_tokens.weight"]
    assert w[f"model.layers.{L}.shared_head.head.weight"] is w["lm_head.weight"]


def test_missing_mtp_layers_are_refused_in_one_sentence(ckpts):
    with pytest.raises(WeightsError, match="declares num_nextn_predict_layers: 0"):
        load_hf_weights(ckpts["plain"], mtp_layers=1)
    with pytest.raises(ValueError) as info:
        check_config(SPEC, ckpts["plain"])
    msg = str(info.value)
    assert "mtp: {num_layers: 1}" in msg and "num_nextn_predict_layers: 0" in msg and "\n" not in msg
    check_config(SPEC, ckpts["mtp"])  # a checkpoint with the layer passes
    check_config(load_spec(TINY_DSV3), ckpts["mtp"])  # and serves a spec without MTP (the layer skipped)


def test_mtp_spec_has_its_own_layout_fingerprint():
    plain = load_spec(TINY_DSV3)
    shapes = {"ckv": (4, 16), "kpe": (4, 8)}
    caches = [PagedKVCache(s.kv_layers, shapes, 2, torch.float32) for s in (plain, SPEC)]
    assert caches[0].layout != caches[1].layout
    keys = [block_keys(list(range(8)), 4, model="m", layout=c.layout) for c in caches]
    assert not set(keys[0]) & set(keys[1])  # neither reuses the other's pool blocks


def test_import_hf_writes_the_section_only_for_a_checkpoint_holding_mtp(ckpts, tmp_path):
    from graphgen.modelspec.import_hf import import_hf
    from graphgen.modelspec.model import Mtp

    spec = import_hf(ckpts["mtp"], tmp_path / "a.yaml")
    assert spec.mtp == Mtp(num_layers=1) and spec.variants["mtp_draft"].phase == "mtp"
    assert spec.targets.npu is not None  # the npu target stays (issue 38 item 2): the launch table refuses
    assert spec.targets == import_hf(ckpts["plain"], tmp_path / "p.yaml").targets  # as without the layer
    # a config that declares an MTP layer its weights lack (transformers' default config + save_pretrained)
    cfg_path = os.path.join(ckpts["plain"], "config.json")
    cfg = json.load(open(cfg_path))
    declaring = tmp_path / "declaring"
    declaring.mkdir()
    (declaring / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    os.symlink(os.path.join(ckpts["plain"], "model.safetensors"), declaring / "model.safetensors")
    assert import_hf(declaring, tmp_path / "b.yaml").mtp is None
    assert "holds no MTP tensors" in (tmp_path / "b.yaml").read_text()
