"""Engine behaviour on bad input, through the Python API (the CLI side is in test_e2e_cli.py)."""

from __future__ import annotations

import pytest

import e2e_util as u

from graphgen.runtime import Engine, open_engine
from graphgen.runtime.core.kvcache import OutOfBlocks


def test_a_batch_larger_than_the_cache_waits_and_one_that_never_fits_does_not_leak(qwen):
    # 4 blocks: each 9-token prompt needs 3, so the batch's second prompt cannot be placed while the
    # first runs: it waits for the first one's blocks (continuous batching), then runs. A prompt
    # that needs more blocks than the cache has fails with OutOfBlocks, and every block taken goes
    # back to the allocator, or the engine is short of blocks for good.
    a, b, huge = [1] * 9, [2] * 9, [3] * 17
    with open_engine(u.TINY_QWEN3, qwen.dir, write="off") as fresh:
        want = [r.tokens for r in fresh.generate([a, b], 2)]
    with open_engine(u.TINY_QWEN3, qwen.dir, write="off", num_blocks=4) as eng:
        assert [r.tokens for r in eng.generate([a, b], 2, batch=True)] == want
        assert eng.alloc.num_free == 4
        with pytest.raises(OutOfBlocks):
            eng.generate([a, huge], 2, batch=True)
        assert eng.alloc.num_free == 4
        assert eng.generate([a], 2)[0].tokens == want[0]


def test_weights_of_another_family_are_refused_before_running(dsv3):
    # DSV3_DIMS shares layers/hidden/vocab with tiny_qwen3: only the family tells them apart
    with pytest.raises(ValueError, match="family deepseek_v3, the spec is qwen3_dense"):
        open_engine(u.TINY_QWEN3, dsv3.dir)
