"""The acceptance check: ``graphgen serve`` answers the ``openai`` client with the tokens
``graphgen run`` prints (``--json``) for the same greedy prompts — both real subprocesses of the CLI,
the server with continuous batching and async scheduling (its defaults) and the prompts sent
concurrently, ``run`` one prompt at a time. And ``graphgen run --trace`` writes a Chrome trace
whose save copies overlap the forward (the point of the async save)."""
from __future__ import annotations

import json

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


def test_graphgen_run_trace_shows_the_save_overlapping_the_forward(ckpt, tmp_path):
    trace = tmp_path / "run.trace.json"
    res = cli_inproc(*_run_args(ckpt, "--write", "async", "--granularity", "layer", "--batch",
                               "--async-scheduling", "--faults", "save_delay=0.01", "--trace", str(trace)))
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads(trace.read_text())
    tracks = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    spans = [(tracks[e["tid"]], e["name"], e["ts"], e["ts"] + e["dur"]) for e in doc["traceEvents"] if e["ph"] == "X"]
    by = {t: [s for s in spans if s[0] == t] for t in ("scheduler", "forward", "save", "host")}
    assert all(by.values()), {t: len(v) for t, v in by.items()}
    assert {n.split(":")[0] for _, n, _, _ in by["forward"]} == {"forward"}
    # every prompt's full blocks were saved and committed: one commit span per step that saved
    assert sum(a for a in (e["args"].get("puts", 0) for e in doc["traceEvents"] if e["name"] == "commit")) > 0
    # a layer's save copy runs while the forward computes later layers: the spans overlap
    overlap = [(f, s) for f in by["forward"] for s in by["save"] if s[2] < f[3] and s[3] > f[2] and s[2] > f[2]]
    assert overlap, "no save copy overlaps a forward span"
