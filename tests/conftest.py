"""Fixtures shared by every test folder: the tiny Hugging Face checkpoints, built once per test run
(session scope) and only by the tests that ask for them. torch and transformers are imported inside
the fixtures, so the torch-free folders (``ir``, ``spec``, ``passes``) stay torch-free.

- ``qwen``, ``dsv3``, ``tiny_dsv3``: random float32 HF models written with ``save_pretrained``
  (weights re-drawn at O(1) scale so logits are not flat; `support.hf`), each as
  ``SimpleNamespace(model, dir, family)``;
- ``imported``: specs made from ``qwen`` and ``dsv3`` by ``graphgen import-hf`` (the CLI's ``main``, in-process);
- ``ckpt``: a checkpoint of ``specs/tiny_qwen3.yaml`` written by graphgen's own writer, with its
  tokenizer (what ``graphgen serve`` loads);
- ``rank_engines``: multi-rank engines shared by the session's tests (`support.engines`).
- ``fake_world``: ``init(size)`` joins torch's fake process group as rank 0 (process groups without peers).

Under CI (or ``GRAPHGEN_NO_SKIPS=1``) an unexpected skip fails the run (`support.skips`).

``slow`` marks the rank, server and Mooncake folders and the stand-in compile loops
(``SLOW_FOLDERS``, ``SLOW_FILES``): ``./dev test -m "not slow"`` is the fast inner loop, ``./dev test``
still runs everything.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from types import SimpleNamespace

import pytest

from support.collected import COLLECTED
from support.paths import TINY_DSV3, TINY_QWEN3

pytest_plugins = ["support.skips"]

# One intra-op torch thread for the whole run, in this process and every child (set before torch is
# imported: OpenMP reads it when it loads). The models are tiny: a second thread buys nothing, and on
# a shared 2-core machine an oversubscribed OpenMP pool makes each small op 10-100x slower (an MTP
# test: 69 s with 2 threads under load 10, 3.3 s with one). OMP_NUM_THREADS set by the caller wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
TORCH_THREADS = int(os.environ["OMP_NUM_THREADS"])


@pytest.fixture(scope="session", autouse=True)
def _torch_threads():
    """``TORCH_THREADS`` also when torch was imported before this file (a plugin): torch-free runs stay so."""
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(TORCH_THREADS)
    yield

SLOW_FOLDERS = ("parallel", "serve", "mooncake")       # rank processes, server subprocesses, Mooncake
SLOW_FILES = ("npu/test_compile_steps_cli.py",         # torch.compile through the stand-in, step by step
              "npu/test_npu_ranks.py")                 # NPU rank processes through the stand-in


@pytest.hookimpl(tryfirst=True)  # before -m/-k deselect: every test this run collected
def pytest_collection_modifyitems(config, items):
    from support.paths import TESTS

    config.stash[COLLECTED] = frozenset(item.nodeid for item in items)  # tests/test_composition.py reads it

    registered = {line.split(":")[0].strip() for line in config.getini("markers")}
    for item in items:
        rel = item.path.relative_to(TESTS).as_posix() if item.path.is_relative_to(TESTS) else ""
        if rel.split("/")[0] in SLOW_FOLDERS or rel in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
        # the suite's markers this test carries, as a JUnit property (scripts/test_times.py sums by them)
        marks = sorted({m.name for m in item.iter_markers()} & registered)
        item.user_properties.append(("markers", ",".join(marks)))


def _hf(tmp_path_factory, family: str, dims: dict, seed: int, name: str) -> SimpleNamespace:
    from support.hf import build_hf_model

    out = tmp_path_factory.mktemp(name)
    model, d = build_hf_model(family, dims, str(out), seed=seed)
    return SimpleNamespace(model=model, dir=d, family=family)


@pytest.fixture(scope="session")
def qwen(tmp_path_factory):
    """Qwen3 with the dims of specs/tiny_qwen3.yaml (support.hf.QWEN3_DIMS)."""
    from support.hf import QWEN3_DIMS

    return _hf(tmp_path_factory, "qwen3_dense", QWEN3_DIMS, 0, "hf_qwen3")


@pytest.fixture(scope="session")
def dsv3(tmp_path_factory):
    """DeepSeek-V3, 2 layers: a dense first layer then MLA + MoE (support.hf.DSV3_DIMS)."""
    from support.hf import DSV3_DIMS

    return _hf(tmp_path_factory, "deepseek_v3", DSV3_DIMS, 1, "hf_dsv3")


@pytest.fixture(scope="session")
def tiny_dsv3(tmp_path_factory):
    """DeepSeek-V3 with the dims of specs/tiny_deepseek_v3.yaml (3 layers, grouped routing)."""
    from graphgen.modelspec.loader import load_spec

    dims = dataclasses.asdict(load_spec(TINY_DSV3).dims)
    return _hf(tmp_path_factory, "deepseek_v3", dims, 2, "hf_tiny_dsv3")


@pytest.fixture(scope="session")
def imported(tmp_path_factory, qwen, dsv3):
    """family -> (spec path written by `graphgen import-hf`, the HF model it was imported from)."""
    from graphgen.modelspec.loader import load_spec
    from support.cli import cli_inproc as cli

    out = tmp_path_factory.mktemp("imported")
    specs = {}
    for hf, name in ((qwen, "e2e_qwen3"), (dsv3, "e2e_dsv3")):
        path = out / f"{name}.yaml"
        res = cli("import-hf", hf.dir, "--out", path, "--name", name)
        assert res.returncode == 0, res.stderr
        assert path.exists() and load_spec(path).family == hf.family
        specs[hf.family] = SimpleNamespace(spec=path, hf=hf)
    return specs


@pytest.fixture
def fake_world():
    """``init(size)``: this process as rank 0 of torch's fake process group of ``size`` ranks (collectives
    do nothing; groups are made as on a real world), destroyed after the test."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(size: int):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def rank_engines():
    """`support.engines.SharedEngines`: multi-rank engines shared by the tests that only read their own
    requests' tokens and counters (one per spec, checkpoint and options; the rules: support/engines.py)."""
    from support.engines import SharedEngines

    shared = SharedEngines()
    yield shared
    shared.close()


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """specs/tiny_qwen3.yaml's checkpoint by graphgen's writer, with tokenizer.json (for serve)."""
    from graphgen.modelspec.loader import load_spec
    from graphgen.runtime.checkpoint.hf import write_random_hf_checkpoint

    spec = load_spec(TINY_QWEN3)
    d = tmp_path_factory.mktemp("serve_ckpt")
    write_random_hf_checkpoint(str(d), spec.family, dataclasses.asdict(spec.dims), seed=0)
    assert (d / "tokenizer.json").exists()
    return d


@pytest.fixture(scope="session")
def npu_ckpts(tmp_path_factory):
    """spec name -> a bfloat16 checkpoint (graphgen's writer, with tokenizer) of each hardware-shaped
    tiny NPU spec (specs/tiny_qwen3_npu.yaml, specs/tiny_deepseek_v3_npu.yaml); router weight and
    score bias stored float32, as the family declares."""
    import torch

    from graphgen.modelspec.loader import load_spec
    from graphgen.runtime.checkpoint.hf import write_random_hf_checkpoint
    from support.paths import SPECS

    out = {}
    for name in ("tiny_qwen3_npu", "tiny_deepseek_v3_npu"):
        spec = load_spec(SPECS / f"{name}.yaml")
        d = tmp_path_factory.mktemp(f"{name}_bf16")
        write_random_hf_checkpoint(str(d), spec.family, dataclasses.asdict(spec.dims), seed=3, dtype=torch.bfloat16)
        out[name] = d
    return out


@pytest.fixture(scope="session")
def chat_ckpt(tmp_path_factory):
    """family -> a tiny checkpoint of specs/tiny_<family>_chat.yaml trained to answer
    support.chat_ckpt's fixed prompt with a thought and a tool call in the family's format (trained
    on first use, once per run; asserts greedy decoding reproduces the answer)."""
    from support.chat_ckpt import train_chat_checkpoint
    from support.paths import SPECS

    done = {}

    def get(spec_name: str):
        if spec_name not in done:
            out = tmp_path_factory.mktemp(f"chat_{spec_name}")
            done[spec_name] = train_chat_checkpoint(out, SPECS / f"{spec_name}.yaml")
        return done[spec_name]

    return get
