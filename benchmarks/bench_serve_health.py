"""``/health`` latency of ``graphgen serve`` while the server refuses a 10 MB body and while it
tokenizes a large text prompt (parsing and tokenization run off the event loop, so ``/health``
should not wait for either).

One server (tiny_qwen3, a random checkpoint with its byte-level tokenizer, the default 8 MiB body
limit). Three phases, each ``--probes`` GETs of ``/health`` one after another, timed by the client:

- idle: nothing else in flight;
- 10 MB body: a client thread keeps POSTing a 10 MB body (refused with a 413) in a loop;
- tokenizing: a client thread keeps POSTing a ~7 MB text prompt (read, parsed and tokenized, then
  refused with a 400 for its length) in a loop.

Reported: p50 / p90 / max of the probes per phase, and how many big requests ran meanwhile.

Usage (repo root):
    .venv/bin/python benchmarks/bench_serve_health.py [--probes 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SPEC = REPO / "specs" / "tiny_qwen3.yaml"


def _start(ckpt: str):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, "-m", "graphgen.serve", "--spec", str(SPEC), "--weights", ckpt,
                          "--port", "0", "--torch-threads", "1", "--write", "off"], cwd=REPO, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if "listening on" in line:
            return p, int(line.strip().rsplit(":", 1)[-1])
        if p.poll() is not None:
            break
    p.kill()
    raise RuntimeError("server did not start")


def _health_ms(port: int) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    t0 = time.perf_counter()
    conn.request("GET", "/health")
    r = conn.getresponse()
    r.read()
    dt = (time.perf_counter() - t0) * 1e3
    conn.close()
    assert r.status == 200, r.status
    return dt


def _big_post(port: int, body: bytes) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
        return r.status
    except OSError:  # the 413 closes the connection while the body is still being sent
        return 413
    finally:
        conn.close()


@dataclasses.dataclass
class Phase:
    name: str
    probes_ms: list
    big_requests: int
    big_statuses: list

    def summary(self) -> dict:
        q = sorted(self.probes_ms)
        return {"phase": self.name, "probes": len(q), "p50_ms": round(statistics.median(q), 2),
                "p90_ms": round(q[int(0.9 * (len(q) - 1))], 2), "max_ms": round(q[-1], 2),
                "big_requests": self.big_requests, "big_statuses": sorted(set(self.big_statuses))}


def _phase(name: str, port: int, probes: int, body: bytes | None) -> Phase:
    stop = threading.Event()
    statuses = []

    def hammer():
        while not stop.is_set():
            statuses.append(_big_post(port, body))

    t = None
    if body is not None:
        t = threading.Thread(target=hammer, daemon=True)
        t.start()
        time.sleep(0.2)  # the first big request is in flight
    out = []
    for _ in range(probes):
        out.append(_health_ms(port))
        time.sleep(0.005)
    stop.set()
    if t is not None:
        t.join(120)
    return Phase(name, out, len(statuses), statuses)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--probes", type=int, default=200)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import dataclasses as dc

    from graphgen.modelspec.loader import load_spec
    from graphgen.runtime.checkpoint.hf import write_random_hf_checkpoint

    spec = load_spec(str(SPEC))
    with tempfile.TemporaryDirectory() as d:
        write_random_hf_checkpoint(d, spec.family, dc.asdict(spec.dims), seed=0)
        proc, port = _start(d)
        try:
            ten_mb = json.dumps({"prompt": "x" * (10 * 1000 * 1000)}).encode()
            seven_mb = json.dumps({"prompt": "graphgen " * (7 * 1000 * 1000 // 9), "max_tokens": 4}).encode()
            phases = [_phase("idle", port, args.probes, None),
                      _phase("10 MB body refused (413)", port, args.probes, ten_mb),
                      _phase("7 MB prompt tokenized (then 400)", port, args.probes, seven_mb)]
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    rows = [p.summary() for p in phases]
    print(f"{'phase':36s} {'probes':>6s} {'p50 ms':>8s} {'p90 ms':>8s} {'max ms':>8s}  big requests (statuses)")
    for r in rows:
        print(f"{r['phase']:36s} {r['probes']:6d} {r['p50_ms']:8.2f} {r['p90_ms']:8.2f} {r['max_ms']:8.2f}  "
              f"{r['big_requests']} {r['big_statuses']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
