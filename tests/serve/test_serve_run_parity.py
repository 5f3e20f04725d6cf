"""The acceptance check: ``graphgen serve`` answers the ``openai`` client with the tokens
``graphgen run`` prints (``--json``) for the same greedy prompts — both real subprocesses of the CLI,
the server with continuous batching and async scheduling (its defaults) and the prompts sent
concurrently, ``run`` one prompt at a time. And ``graphgen run --trace`` writes a Chrome trace
whose save copies outlive the forward they started in (the point of the async save; proven by order with
a held save, not by wall-clock spans that happen to intersect)."""
from __future__ import annotations

import dataclasses
import json
import threading

from serve_util import SPEC
from support.cli import run_args, run_tokens  # run_tokens: `graphgen run` as a real subprocess (the entry point)
from support.inproc import cli_inproc

PROMPTS = [[5, 17, 33, 2, 9, 100, 41], list(range(1, 14)), list(range(1, 9)) + [40, 41, 42],
           [200, 3, 5, 7, 11, 13, 17, 19, 23, 29], [255, 0, 128]]
N_NEW = 8


def _run_args(ckpt, *extra):
    return run_args(SPEC, ckpt, PROMPTS, N_NEW, *extra)


def test_graphgen_run_tokens_equal_the_servers(servers, ckpt):
    s = servers.get(ckpt, "--write", "async", cli=True)  # (its exit 0 on SIGTERM: the factory's)
    want = run_tokens(SPEC, ckpt, PROMPTS, N_NEW, "--write", "async")
    assert len(want) == len(PROMPTS)
    assert s.greedy(PROMPTS, N_NEW, "tiny_qwen3") == want


class _SaveHeldUntilAForwardEnds:
    """A save gate (``Faults.save_gate``): every save op waits until a forward has returned (the runner
    reported its span: `StepObserver.forward`). An async save is held while its forward runs to the end,
    whatever the scheduler does; a synchronous save runs inside the forward, so no forward can end while it
    waits: it gives up after ``timeout_s`` (recorded, the run goes on) and the trace shows the save ending
    before the forward."""

    def __init__(self, timeout_s: float):
        self.timeout_s, self.forward_ended, self.gave_up = timeout_s, threading.Event(), False

    def wait(self) -> None:
        if not self.forward_ended.wait(self.timeout_s):
            self.gave_up = True


def _run_with_held_save(ckpt, tmp_path, monkeypatch, write: str, timeout_s: float):
    """`graphgen run --trace` (in this process) with every save op held by `_SaveHeldUntilAForwardEnds`;
    (the trace's spans per track, the gate)."""
    from graphgen.runtime import Faults
    from graphgen.trace import StepObserver

    gate = _SaveHeldUntilAForwardEnds(timeout_s)
    parse, forward = Faults.parse.__func__, StepObserver.forward

    def observed_forward(self, *a, **kw):
        forward(self, *a, **kw)
        gate.forward_ended.set()

    monkeypatch.setattr(Faults, "parse", classmethod(lambda cls, text: dataclasses.replace(parse(cls, text),
                                                                                        save_gate=gate)))
    monkeypatch.setattr(StepObserver, "forward", observed_forward)
    trace = tmp_path / f"run-{write}.trace.json"
    res = cli_inproc(*_run_args(ckpt, "--write", write, "--granularity", "layer", "--batch",
                               "--async-scheduling", "--faults", "seed=0", "--trace", str(trace)))
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads(trace.read_text())
    tracks = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    spans = [(tracks[e["tid"]], e["name"], e["ts"], e["ts"] + e["dur"]) for e in doc["traceEvents"] if e["ph"] == "X"]
    by = {t: [s for s in spans if s[0] == t] for t in ("scheduler", "forward", "save", "host")}
    return by, doc, gate


def _first_save_and_forward(by):
    """(the first forward, the first save copy): the run's first step (``--batch``: every prompt's prefill)
    saves full blocks, so the first save copy is that forward's."""
    return min(by["forward"], key=lambda f: f[2]), min(by["save"], key=lambda s: s[2])


def test_graphgen_run_trace_shows_the_save_overlapping_the_forward(ckpt, tmp_path, monkeypatch):
    """The save runs while the forward computes, shown by order, not by clocks: every save copy is held until
    a forward has returned, so with ``--write async`` the first forward ends while its save copies still wait
    (the recorded order: that forward's end, then its saves' ends), on any scheduler; a sync save cannot."""
    by, doc, gate = _run_with_held_save(ckpt, tmp_path, monkeypatch, "async", timeout_s=120.0)
    assert all(by.values()), {t: len(v) for t, v in by.items()}
    assert {n.split(":")[0] for _, n, _, _ in by["forward"]} == {"forward"}
    # every prompt's full blocks were saved and committed: one commit span per step that saved
    assert sum(a for a in (e["args"].get("puts", 0) for e in doc["traceEvents"] if e["name"] == "commit")) > 0
    assert not gate.gave_up, "a save op waited for a forward that never ended: the save ran inside the forward"
    forward, save = _first_save_and_forward(by)
    assert save[2] >= forward[2] and save[3] > forward[3], ("the first save copy did not outlive its forward", forward, save)


def test_a_synchronous_save_fails_the_overlap_check(ckpt, tmp_path, monkeypatch):
    """The negative control: ``--write sync`` saves inside the forward, so the held save gives up (after 0.3 s,
    once) and the first save copy ends inside its forward."""
    by, _, gate = _run_with_held_save(ckpt, tmp_path, monkeypatch, "sync", timeout_s=0.3)
    assert by["forward"] and by["save"]
    assert gate.gave_up
    forward, save = _first_save_and_forward(by)
    assert forward[2] <= save[2] and save[3] <= forward[3], (forward, save)  # inside its forward: the check fails
