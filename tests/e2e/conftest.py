"""Session fixtures for the end-to-end tests: tiny random float32 Hugging Face models written with
``save_pretrained`` (weights re-drawn at O(1) scale so logits are not flat), and specs made from
them by ``graphgen import-hf`` run as a subprocess."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

try:
    from . import e2e_util as u
except ImportError:
    import e2e_util as u

import torch  # noqa: E402

from graphgen.modelspec.loader import load_spec  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The models are tiny: a second intra-op thread buys nothing, and on a shared machine an
    oversubscribed OpenMP pool makes each small op ~100x slower. Restored for other tests."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _hf(tmp_path_factory, family: str, dims: dict, seed: int, name: str) -> SimpleNamespace:
    out = tmp_path_factory.mktemp(name)
    model, d = u.hfm.build_hf_model(family, dims, str(out), seed=seed)
    return SimpleNamespace(model=model, dir=d, family=family)


@pytest.fixture(scope="session")
def qwen(tmp_path_factory):
    """Qwen3 with the dims of specs/tiny_qwen3.yaml (hf_models.QWEN3_DIMS)."""
    return _hf(tmp_path_factory, "qwen3_dense", u.hfm.QWEN3_DIMS, 0, "hf_qwen3")


@pytest.fixture(scope="session")
def dsv3(tmp_path_factory):
    """DeepSeek-V3, 2 layers: a dense first layer then MLA + MoE (hf_models.DSV3_DIMS)."""
    return _hf(tmp_path_factory, "deepseek_v3", u.hfm.DSV3_DIMS, 1, "hf_dsv3")


@pytest.fixture(scope="session")
def tiny_dsv3(tmp_path_factory):
    """DeepSeek-V3 with the dims of specs/tiny_deepseek_v3.yaml (3 layers, grouped routing)."""
    dims = dataclasses.asdict(load_spec(u.TINY_DSV3).dims)
    return _hf(tmp_path_factory, "deepseek_v3", dims, 2, "hf_tiny_dsv3")


@pytest.fixture(scope="session")
def imported(tmp_path_factory, qwen, dsv3):
    """family -> (spec path written by `graphgen import-hf`, the HF model it was imported from)."""
    out = tmp_path_factory.mktemp("imported")
    specs = {}
    for hf, name in ((qwen, "e2e_qwen3"), (dsv3, "e2e_dsv3")):
        path = out / f"{name}.yaml"
        res = u.cli("import-hf", hf.dir, "--out", path, "--name", name)
        assert res.returncode == 0, res.stderr
        assert path.exists() and load_spec(path).family == hf.family
        specs[hf.family] = SimpleNamespace(spec=path, hf=hf)
    return specs
