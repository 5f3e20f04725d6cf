"""The end-to-end tests run on one torch thread; their checkpoints (``qwen``, ``dsv3``,
``tiny_dsv3``, ``imported``) are the session fixtures of tests/conftest.py."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The models are tiny: a second intra-op thread buys nothing, and on a shared machine an
    oversubscribed OpenMP pool makes each small op ~100x slower. Restored for other tests."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
