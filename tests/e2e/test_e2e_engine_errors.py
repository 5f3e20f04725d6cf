"""Engine behaviour on bad input, through the Python API (the CLI side is in test_e2e_cli.py)."""

from __future__ import annotations

import pytest

try:
    from . import e2e_util as u
except ImportError:
    import e2e_util as u

from graphgen.runtime.engine import Engine
from graphgen.runtime.kvcache import OutOfBlocks


def test_out_of_blocks_in_a_batch_does_not_leak_blocks(qwen):
    # 4 blocks: each 9-token prompt needs 3, so the batch's second prompt cannot be placed. The
    # first prompt's blocks must go back to the allocator, or the engine is short of blocks for good.
    a, b = [1] * 9, [2] * 9
    with Engine.from_spec(u.TINY_QWEN3, qwen.dir, write="off") as fresh:
        want = fresh.generate([a], 2)[0].tokens
    with Engine.from_spec(u.TINY_QWEN3, qwen.dir, write="off", num_blocks=4) as eng:
        with pytest.raises(OutOfBlocks):
            eng.generate([a, b], 2, batch=True)
        assert eng.alloc.num_free == 4
        assert eng.generate([a], 2)[0].tokens == want


def test_weights_of_another_family_are_refused_before_running(dsv3):
    # DSV3_DIMS shares layers/hidden/vocab with tiny_qwen3: only the family tells them apart
    with pytest.raises(ValueError, match="family deepseek_v3, the spec is qwen3_dense"):
        Engine.from_spec(u.TINY_QWEN3, dsv3.dir)
