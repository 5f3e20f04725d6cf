"""The tp=2 Qwen3 engines the rank tests share (`support.engines`: one per spec for the session, for
the tests that only read their own requests' tokens, logits and counters)."""
from __future__ import annotations

import pytest

from support.paths import REPO

SHARED_OPTIONS = {"collect_logits": True, "num_blocks": 32, "timeout": 60}


@pytest.fixture
def qwen_tp2(rank_engines, qwen):
    """``qwen_tp2(spec)``: the session's engine of a tp=2 Qwen3 spec (``specs/tiny_qwen3_tp2.yaml`` or
    ``_tp2_sp.yaml``) on the ``qwen`` checkpoint, with ``SHARED_OPTIONS``."""
    return lambda spec: rank_engines.get(REPO / spec, qwen.dir, **SHARED_OPTIONS)
