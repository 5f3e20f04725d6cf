"""The largest inter-token gap of an unrelated stream while a server's first grammar compiles.

Per trial, a fresh ``graphgen serve`` (``specs/tiny_qwen3_chat.yaml``, a random checkpoint from
``graphgen checkpoint``, one torch thread) and two clients: a greedy completion stream S
(``ignore_eos``, ``--tokens`` tokens) and, once S has its 5th token, the server's first
grammar-constrained request G (``tool_choice: required``: a forced call, compiled with the
tokenizer). Reported per trial: S's largest gap between two tokens while G was in flight, S's
largest gap in a control stream on the same (now warm) server with no G, and G's latency.

``--tree DIR`` runs the server of another checkout (``PYTHONPATH=DIR``, its own ``graphgen`` code),
so the same script measures a commit before and after a change:

    git archive fa9437a | tar -x -C /tmp/base
    .venv/bin/python benchmarks/bench_grammar_stall.py --tree /tmp/base
    .venv/bin/python benchmarks/bench_grammar_stall.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SPEC = "specs/tiny_qwen3_chat.yaml"
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]


def _server(tree: Path, ckpt: str):
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, "-m", "graphgen.serve", "--spec", str(tree / SPEC), "--weights", ckpt,
                          "--port", "0", "--torch-threads", "1"], cwd=tree, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if "listening on" in line:
            return p, line.strip().rsplit(" ", 1)[-1]
        if p.poll() is not None:
            break
    p.kill()
    raise SystemExit("the server did not start")


def _stream(client, tokens: int, on_token=None) -> list[float]:
    times = []
    for chunk in client.completions.create(model="tiny_qwen3_chat", prompt="hello", max_tokens=tokens,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True}):
        times.append(time.perf_counter())
        if on_token is not None:
            on_token(len(times))
    return times


def _gap(times: list[float], start: float = float("-inf"), end: float = float("inf")) -> float:
    gaps = [b - a for a, b in zip(times, times[1:]) if b > start and a < end]
    return max(gaps) if gaps else 0.0


def trial(tree: Path, ckpt: str, tokens: int) -> dict:
    import openai

    p, base = _server(tree, ckpt)
    try:
        c = openai.OpenAI(base_url=base + "/v1", api_key="-", timeout=600, max_retries=0)
        g = {}

        def grammar():
            g["start"] = time.perf_counter()
            c.chat.completions.create(model="tiny_qwen3_chat", messages=[{"role": "user", "content": "hi"}],
                                      tools=TOOLS, tool_choice="required", max_tokens=20, temperature=0)
            g["end"] = time.perf_counter()

        t = threading.Thread(target=grammar)
        times = _stream(c, tokens, lambda n: n == 5 and t.start())
        t.join()
        control = _stream(c, tokens)
        return {"gap_during_first_grammar_s": round(_gap(times, g["start"], g["end"]), 3),
                "gap_control_s": round(_gap(control), 3), "grammar_request_s": round(g["end"] - g["start"], 3)}
    finally:
        p.terminate()
        p.wait(60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", type=Path, default=REPO, help="the checkout whose server runs (default: this one)")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=60)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        ckpt = str(Path(d) / "ckpt")
        subprocess.run([sys.executable, "-m", "graphgen", "checkpoint", "--spec", SPEC, "--out", ckpt], cwd=REPO,
                       check=True, capture_output=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
        rows = []
        for i in range(args.trials):
            rows.append(trial(args.tree.resolve(), ckpt, args.tokens))
            print(f"trial {i}: {rows[-1]}", flush=True)
    summary = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(json.dumps({"tree": str(args.tree), "median": summary, "trials": rows}))
    if args.json:
        Path(args.json).write_text(json.dumps({"median": summary, "trials": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
