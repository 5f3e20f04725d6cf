"""A start that takes minutes, in real rank processes (issue 27 item 5, audit 3 N1): the start phases
have their own deadlines, the per-step deadline no longer bounds the start, and a hung rank is still
reported by its phase's deadline. The launcher runs on a clock 100x faster than real time (``clock=``),
so "slowed past 120 s" is 1.5 real seconds of an injected load delay (`Faults.weights_delay_s`), and a
hung load is a `FileGate` nobody opens, reported 1 real second (100 s on the clock) into its phase.
The pure deadline and progress logic: tests/runtime/test_progress.py."""
from __future__ import annotations

import io
import time

import pytest

from graphgen.runtime import Deadlines, Faults, open_engine
from graphgen.runtime.core.faults import FileGate
from graphgen.runtime.parallel.launcher import RankFailure
from support.paths import REPO

SPEED = 100.0  # clock seconds per real second
STEP_TIMEOUT = 120.0  # the launcher's default step deadline, on the fast clock: 1.2 real seconds
START = 60000.0  # process start on the fast clock (600 real seconds: a loaded machine imports torch slowly)


def _fast_clock():
    t0 = time.monotonic()
    return lambda: t0 + (time.monotonic() - t0) * SPEED


def test_a_rank_whose_load_is_delayed_past_the_step_deadline_still_starts_and_prints_progress(qwen):
    out = io.StringIO()
    eng = open_engine(REPO / "specs/tiny_qwen3.yaml", qwen.dir, tp=2, num_blocks=32, timeout=STEP_TIMEOUT,
                      clock=_fast_clock(), rank_timeout=Deadlines(start=START), progress_out=out,
                      faults=Faults(weights_delay_s=1.5))  # 150 s on the clock: past the step deadline
    try:
        assert eng.max_model_len > 0  # started, and answered a command within the step deadline
    finally:
        eng.timeout = 60 * SPEED  # closing may take longer than 1.2 real seconds on a busy machine
        eng.close()
    lines = out.getvalue().splitlines()
    loading = [line for line in lines if "rank 0 load" in line and "rank 1 load" in line]
    assert loading and all(" MB " in line and " GB/s" in line for line in loading), lines
    assert lines[-1].startswith("started in ")


def test_a_hung_rank_is_reported_by_its_load_deadline(qwen, tmp_path):
    """One rank process (the launcher with a tp=1 spec: the same deadlines, half the processes to start)."""
    from graphgen.modelspec.loader import load_spec
    from graphgen.runtime import DistributedEngine

    gate = FileGate(tmp_path / "never-opened", timeout_s=120)
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank\(s\) \[0\] did not load its weights \(load phase\) within "
                                          r"100 s \(--rank-timeout load=SECONDS raises it\)"):
        DistributedEngine(load_spec(REPO / "specs/tiny_qwen3.yaml"), str(qwen.dir), num_blocks=32,
                          timeout=STEP_TIMEOUT, clock=_fast_clock(), rank_timeout=Deadlines(start=START, load=100),
                          faults=Faults(weights_gate=gate), progress_out=io.StringIO())
    assert time.monotonic() - t0 < 60  # the load deadline (1 real second in), not the gate's 120 s
