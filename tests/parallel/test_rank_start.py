"""How the launcher starts rank processes (`graphgen/runtime/parallel/launcher.py`, process start):
forked from a forkserver that preloaded torch and the rank modules, each rank with this process's
environment and working directory of the launch -- not the forkserver's, which started earlier.
That is what makes a rank read the ``ASCEND_RT_VISIBLE_DEVICES`` (NPU ranks), ``GLOO_SOCKET_IFNAME``
or ``GRAPHGEN_*`` its launcher had. Speed: benchmarks/bench_rank_start.py."""
from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

from graphgen.runtime import open_engine
import graphgen.runtime.parallel.launcher as launcher
from support.paths import REPO

SPEC = REPO / "specs/tiny_qwen3_tp2.yaml"


def _seen(rank_engine) -> dict:  # probe, in each rank
    import torch

    parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    return {"parent": parent, "visible": os.environ.get("ASCEND_RT_VISIBLE_DEVICES"),
            "probe": os.environ.get("GRAPHGEN_TEST_PROBE"), "cwd": os.getcwd(),
            "threads": torch.get_num_threads()}


def test_ranks_fork_from_the_warm_server_with_the_launch_environment(qwen, monkeypatch, tmp_path):
    from multiprocessing import forkserver

    launcher._process_context()
    forkserver.ensure_running()   # the server exists before the variables below are set
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "3,1")
    monkeypatch.setenv("GRAPHGEN_TEST_PROBE", "launch-time")
    monkeypatch.chdir(tmp_path)
    with open_engine(SPEC, qwen.dir, num_blocks=16, timeout=60) as eng:
        seen = eng.on_ranks(_seen)
        assert eng.generate([[1, 2, 3, 4, 5]], 2)[0].tokens   # the ranks work
    for s in seen:
        assert "multiprocessing.forkserver" in s["parent"], s   # forked from the server, not spawned
        assert (s["visible"], s["probe"], s["cwd"]) == ("3,1", "launch-time", str(tmp_path)), s
        assert s["threads"] == max(1, (os.cpu_count() or 1) // 2)   # the launcher's per-rank share


def test_a_variable_read_at_import_that_changed_makes_the_launch_spawn(monkeypatch):
    """The forkserver's modules read ``GRAPHGEN_CPU_MATMUL`` when it started; a launch under another
    value spawns fresh interpreters (which read the new one), the same value forks again."""
    launcher._process_context()   # the forkserver's values are recorded
    before = os.environ.get("GRAPHGEN_CPU_MATMUL")
    monkeypatch.setenv("GRAPHGEN_CPU_MATMUL", "mkl" if before != "mkl" else "onednn")
    assert launcher._process_context() is mp.get_context("spawn")
    if before is None:
        monkeypatch.delenv("GRAPHGEN_CPU_MATMUL")
    else:
        monkeypatch.setenv("GRAPHGEN_CPU_MATMUL", before)
    assert launcher._process_context() is mp.get_context("forkserver")
