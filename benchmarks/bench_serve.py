"""Serving benchmark: TTFT / inter-token latency / throughput of ``graphgen serve`` under concurrency,
with the KV save off / sync / async (and with the save made slow on purpose), over HTTP.

One server subprocess per configuration (all started up front, on free 127.0.0.1 ports), driven by
closed-loop streaming clients (stdlib HTTP + SSE): 1, 8 and 32 concurrent clients, each sending
requests back to back until the round's request budget is spent (bounded count and time).
Configurations are interleaved: every round runs each concurrency on every configuration, the
order of configurations rotated per round. Prompt mix: half cold (fresh random ids), half sharing
one of a few prefixes (``--prefix-blocks`` full blocks) with a fresh tail — the shared half hits
the pool once its prefix was committed.

TTFT is measured by the client: request sent -> first SSE token chunk. Inter-token latency: gaps
between later chunks. Reported: p50/p90/p99 TTFT, median ITL, output tokens/s, and per
concurrency the async/sync and async/off ratios of TTFT p50 (and p90).

The server batches continuously (``--max-num-seqs``) with async scheduling on (its default). At the
end each server's ``/metrics`` gives the mean forward time of a step and the mean save latency
(forward start -> the step's KV staged), so the cost of the slow save is shown next to the forward.

Usage (repo root):
    .venv/bin/python benchmarks/bench_serve.py --quick        # smoke: < 2 min on 2 cores
    .venv/bin/python benchmarks/bench_serve.py --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import os
import random
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


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    write: str
    faults: str = ""


def _configs(save_delay: float) -> list[Config]:
    slow = f"save_delay={save_delay}"
    return [Config("off", "off"), Config("sync", "sync"), Config("async", "async"),
            Config("off+slow", "off", slow), Config("sync+slow", "sync", slow), Config("async+slow", "async", slow)]


class ServerRefused(RuntimeError):
    """The server exited before it listened; ``sentence`` is its ``graphgen serve: error: ...`` line
    (a layout or flag the server refuses), or the last line of its stderr."""

    def __init__(self, name: str, sentence: str, is_refusal: bool = True):
        super().__init__(f"server {name} did not start: {sentence}")
        self.sentence, self.is_refusal = sentence, is_refusal


def refusal_sentence(stderr_text: str) -> tuple[str, bool]:
    """(the ``graphgen serve: error: ...`` sentence of a server's stderr, True), else (its last non-empty
    line, False): a refusal names what it refuses; anything else is a failure to start."""
    lines = [ln.strip() for ln in stderr_text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ": error: " in ln:
            return ln.split(": error: ", 1)[1], True
    return (lines[-1] if lines else "(no output)"), False


class ServerProc:
    def __init__(self, cfg: Config, spec: str, ckpt: str, extra: list[str], startup_s: float = 180,
                 granularity: str = "layer"):
        args = [sys.executable, "-m", "graphgen.serve", "--spec", spec, "--weights", ckpt, "--port", "0",
                "--write", cfg.write, "--granularity", granularity, "--torch-threads", "1", *extra]
        if cfg.faults:
            args += ["--faults", cfg.faults]
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        self.cfg = cfg
        self.argv = args
        self._stderr = tempfile.TemporaryFile(mode="w+")  # read back when it does not start
        self.proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=self._stderr,
                                     text=True)
        deadline, line = time.monotonic() + startup_s, ""
        while time.monotonic() < deadline and "listening on" not in line and self.proc.poll() is None:
            line = self.proc.stdout.readline()
        if "listening on" not in line:
            self.proc.kill()
            self.proc.wait()
            self._stderr.seek(0)
            raise ServerRefused(cfg.name, *refusal_sentence(self._stderr.read()))
        self.port = int(line.strip().rsplit(":", 1)[-1])
        # keep the pipe drained: a server printing more than a pipe holds must never block
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()

    def scrape(self) -> dict:
        """{sample name: value} of the server's /metrics (label-free samples only)."""
        from prometheus_client.parser import text_string_to_metric_families

        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
        finally:
            conn.close()
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9


def one_request(port: int, prompt: list[int], max_tokens: int, timeout: float) -> tuple[float, list[float], int]:
    """(ttft_s, inter-token gaps, tokens) of one streamed greedy completion."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}),
            headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
        stamps = []
        while True:
            line = r.readline()
            if not line:
                break
            if line.startswith(b"data: "):
                if line.strip() == b"data: [DONE]":
                    break
                n = len(json.loads(line[6:])["choices"][0]["token_ids"])
                stamps.extend([time.perf_counter()] * n)
    finally:
        conn.close()
    if not stamps:
        raise RuntimeError("no tokens")
    return stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:])], len(stamps)


def run_load(port: int, prompts: list[list[int]], concurrency: int, max_tokens: int, budget_s: float,
             request=one_request) -> dict:
    """Closed loop: ``concurrency`` clients take prompts from a shared list until it is empty or
    ``budget_s`` passed. ``request(port, prompt, max_tokens, timeout)`` -> (ttft_s, gaps, tokens):
    `one_request` (stdlib HTTP + SSE) or another client's."""
    lock, results, errors = threading.Lock(), [], []
    todo = list(prompts)
    deadline = time.perf_counter() + budget_s

    def client():
        while time.perf_counter() < deadline:
            with lock:
                if not todo:
                    return
                p = todo.pop()
            try:
                res = request(port, p, max_tokens, timeout=max(5.0, deadline - time.perf_counter() + 30))
            except Exception as e:  # counted, reported
                with lock:
                    errors.append(str(e))
                continue
            with lock:
                results.append(res)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(budget_s + 60)
    wall = time.perf_counter() - t0
    return {"results": results, "errors": errors, "wall_s": wall}


def _pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def make_prompts(rng: random.Random, n: int, vocab: int, prompt_len: int, prefixes: list[list[int]]) -> list[list[int]]:
    out = []
    for i in range(n):
        if i % 2 == 0:
            out.append([rng.randrange(vocab) for _ in range(prompt_len)])  # cold
        else:
            pre = prefixes[(i // 2) % len(prefixes)]
            out.append(pre + [rng.randrange(vocab) for _ in range(max(1, prompt_len - len(pre)))])
    rng.shuffle(out)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default=str(REPO / "specs" / "tiny_qwen3.yaml"))
    ap.add_argument("--weights", default=None, help="checkpoint folder (default: a random one in a temp dir)")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests", type=int, default=64, help="requests per (round, concurrency, config)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=33)
    ap.add_argument("--prefix-blocks", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--save-delay", type=float, default=0.01, help="seconds per layer save in the +slow configs")
    ap.add_argument("--configs", default="", help="comma-separated subset of names (default: all)")
    ap.add_argument("--budget-s", type=float, default=120.0, help="time bound per load run")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--no-async-scheduling", action="store_true", help="serve without async scheduling")
    ap.add_argument("--quick", action="store_true", help="smoke: concurrency 1,8, few requests, 4 configs, 1 round")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.concurrency, args.requests, args.rounds, args.budget_s = "1,8", 8, 1, 60.0
        args.configs = args.configs or "off,sync+slow,async+slow,off+slow"
    conc = [int(c) for c in args.concurrency.split(",")]
    configs = [c for c in _configs(args.save_delay) if not args.configs or c.name in args.configs.split(",")]

    from graphgen.modelspec.loader import load_spec

    spec = load_spec(args.spec)
    tmp = None
    ckpt = args.weights
    if ckpt is None:
        from graphgen.runtime.checkpoint.hf import write_random_hf_checkpoint

        tmp = tempfile.TemporaryDirectory(prefix="bench_serve_")
        ckpt = write_random_hf_checkpoint(tmp.name, spec.family, dataclasses.asdict(spec.dims), seed=0)
    bs, vocab = spec.kv_cache.block_size, spec.dims.vocab_size
    rng = random.Random(0)
    prefixes = [[rng.randrange(vocab) for _ in range(args.prefix_blocks * bs)] for _ in range(4)]
    print(f"[bench_serve] {spec.name}: {len(configs)} configs x concurrency {conc} x {args.rounds} rounds, "
          f"{args.requests} requests each, prompt {args.prompt_len} tokens, {args.max_tokens} new", file=sys.stderr)
    servers = {}
    try:
        for c in configs:
            servers[c.name] = ServerProc(c, args.spec, str(ckpt), ["--max-num-seqs", str(args.max_num_seqs)]
                                         + (["--no-async-scheduling"] if args.no_async_scheduling else []))
        agg = {(c.name, k): {"ttft": [], "itl": [], "tokens": 0, "wall": 0.0, "errors": 0} for c in configs for k in conc}
        for rnd in range(args.rounds):
            for k in conc:
                prompts = make_prompts(rng, args.requests, vocab, args.prompt_len, prefixes)
                order = configs[rnd % len(configs):] + configs[:rnd % len(configs)]
                for c in order:  # every config gets the same prompts in a round
                    r = run_load(servers[c.name].port, prompts, k, args.max_tokens, args.budget_s)
                    a = agg[(c.name, k)]
                    a["ttft"] += [x[0] for x in r["results"]]
                    a["itl"] += [g for x in r["results"] for g in x[1]]
                    a["tokens"] += sum(x[2] for x in r["results"])
                    a["wall"] += r["wall_s"]
                    a["errors"] += len(r["errors"])
        costs = {}
        for n, srv in servers.items():
            m = srv.scrape()

            def mean(h):
                return 1e3 * m.get(h + "_sum", 0.0) / m[h + "_count"] if m.get(h + "_count") else float("nan")
            costs[n] = {"forward_ms": mean("graphgen_forward_latency_seconds"),
                        "save_ms": mean("graphgen_kv_save_latency_seconds"),
                        "commit_ms": mean("graphgen_kv_commit_latency_seconds"),
                        "steps": m.get("graphgen_engine_steps_total", 0), "preemptions": m.get("graphgen_preemptions_total", 0),
                        "hit_tokens": m.get("graphgen_prefix_cache_hit_tokens_total", 0)}
    finally:
        rcs = {n: s.stop() for n, s in servers.items()}
        if tmp is not None:
            tmp.cleanup()
    rows = []
    for (name, k), a in agg.items():
        rows.append({"config": name, "concurrency": k, "requests": len(a["ttft"]), "errors": a["errors"],
                     "ttft_p50_ms": _pct(a["ttft"], 50) * 1e3, "ttft_p90_ms": _pct(a["ttft"], 90) * 1e3,
                     "ttft_p99_ms": _pct(a["ttft"], 99) * 1e3,
                     "itl_p50_ms": (statistics.median(a["itl"]) * 1e3) if a["itl"] else float("nan"),
                     "tok_per_s": a["tokens"] / a["wall"] if a["wall"] else 0.0})
    print(f"\n{'config':12s} {'conc':>4s} {'reqs':>5s} {'err':>4s} {'TTFT p50':>9s} {'p90':>8s} {'p99':>8s} "
          f"{'ITL p50':>8s} {'tok/s':>8s}")
    for r in rows:
        print(f"{r['config']:12s} {r['concurrency']:4d} {r['requests']:5d} {r['errors']:4d} {r['ttft_p50_ms']:9.1f} "
              f"{r['ttft_p90_ms']:8.1f} {r['ttft_p99_ms']:8.1f} {r['itl_p50_ms']:8.1f} {r['tok_per_s']:8.1f}")
    by = {(r["config"], r["concurrency"]): r for r in rows}
    ratios = []
    print("\nTTFT ratios (p50 / p90):")
    for suffix in ("", "+slow"):
        for k in conc:
            a, s, o = (by.get((m + suffix, k)) for m in ("async", "sync", "off"))
            if not a:
                continue
            line = {"save": "slow" if suffix else "real", "concurrency": k}
            for other, lbl in ((s, "async/sync"), (o, "async/off")):
                if other:
                    line[lbl] = [a["ttft_p50_ms"] / other["ttft_p50_ms"], a["ttft_p90_ms"] / other["ttft_p90_ms"]]
            ratios.append(line)
            print("  " + ", ".join(f"{key}={v[0]:.3f}/{v[1]:.3f}" if isinstance(v, list) else f"{key}={v}"
                                   for key, v in line.items()))
    print("\nper server (means over the whole run): forward per step, save (forward start -> staged), commit")
    for n, c in costs.items():
        print(f"  {n:12s} forward {c['forward_ms']:.2f} ms, save {c['save_ms']:.2f} ms, commit {c['commit_ms']:.2f} ms, "
              f"{int(c['steps'])} steps, {int(c['preemptions'])} preemptions, {int(c['hit_tokens'])} hit tokens")
    print(f"\nserver exit codes: {rcs}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "ratios": ratios, "exit_codes": rcs, "costs": costs,
                                               "args": vars(args)}, indent=2) + "\n")
    bad = any(r["errors"] for r in rows) or any(rc != 0 for rc in rcs.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
