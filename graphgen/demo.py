"""The README's main job after `graphgen generate`: a short end-to-end run on the embedded pool.

A tiny random Qwen3 checkpoint is written locally (no downloads), then one engine per write mode
runs a cold prompt, the same prompt again (it hits the pool), and a prompt sharing a prefix.
The three write modes must give the same tokens. Then a slow save (fault injection) shows why
the save is asynchronous: async TTFT stays near write-off TTFT while sync TTFT pays the save.
Finally, when Mooncake is available, two separate `graphgen run` processes share a prefix through
a Mooncake master started in a private network namespace (else one line says why it is skipped).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

SPEC = Path("specs/tiny_qwen3.yaml")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m graphgen.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default=str(SPEC))
    ap.add_argument("--workdir", default=".cache/demo", help="where the tiny checkpoint is written")
    ap.add_argument("--save-delay", type=float, default=0.03, help="seconds added to each layer's save")
    ap.add_argument("--mooncake-inner", metavar="CKPT", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not Path(args.spec).is_file():  # the default is the repository's spec, relative to its root
        ap.error(f"{args.spec}: no such spec; run the demo in a source checkout's root or pass --spec FILE")
    if args.mooncake_inner:
        return _mooncake_inner(args.spec, args.mooncake_inner)

    from .runtime import open_engine
    from .runtime.core.faults import Faults
    from .runtime.checkpoint.hf import write_random_hf_checkpoint
    from .modelspec.loader import load_spec

    spec = load_spec(args.spec)
    ckpt = Path(args.workdir) / spec.name
    write_random_hf_checkpoint(ckpt, spec.family, dataclasses.asdict(spec.dims), seed=0)
    print(f"[demo] tiny {spec.family} checkpoint with random weights: {ckpt}")

    bs = spec.kv_cache.block_size
    cold = list(range(3, 3 + 4 * bs + 1))  # 4 full blocks + 1 token
    prompts = [cold, cold, cold[: 2 * bs] + [200, 201, 202]]
    labels = ["cold prompt", "same prompt again", "shares 2 blocks"]
    tokens_by_mode = {}
    for write in ("off", "sync", "async"):
        with open_engine(args.spec, ckpt, write=write) as eng:
            res = eng.generate(prompts, max_new_tokens=6)
            eng.drain()
            tokens_by_mode[write] = [r.tokens for r in res]
            print(f"\n[demo] write={write}")
            for label, r in zip(labels, res):
                print(f"  {label:18s} hit {r.hit_tokens:2d} tokens via {r.variant:16s} -> {r.tokens}")
            print(f"  pool: {eng.stats['puts']} blocks committed, {eng.stats['hit_blocks']} blocks hit")
    same = len({str(v) for v in tokens_by_mode.values()}) == 1
    print(f"\n[demo] off / sync / async give the same tokens: {'yes' if same else 'NO'}")

    print(f"\n[demo] slow save ({args.save_delay * 1e3:.0f} ms per layer save): median TTFT of 5 cold prompts")
    ttft = {}
    for write in ("off", "sync", "async"):
        faults = Faults(save_delay_s=args.save_delay)
        with open_engine(args.spec, ckpt, write=write, faults=faults, granularity="layer") as eng:
            runs = [eng.generate([[7 + i] * (4 * bs + 1)], max_new_tokens=1)[0].ttft_ms for i in range(5)]
            eng.drain()
        ttft[write] = statistics.median(runs)
        print(f"  write={write:5s} TTFT {ttft[write]:7.1f} ms")
    print(f"  async/off = {ttft['async'] / ttft['off']:.2f}, sync/off = {ttft['sync'] / ttft['off']:.2f} "
          f"(benchmarks/ has the full comparison)")
    ok_mc = _mooncake_section(args.spec, ckpt)
    return 0 if same and ok_mc else 1


def _mooncake_unavailable() -> str | None:
    """Why the Mooncake section cannot run here, or None."""
    import importlib.util

    if importlib.util.find_spec("mooncake") is None:
        return "the mooncake extra is not installed (./dev setup installs it)"
    from .runtime.pool.mooncake_server import find_master_binary

    try:
        find_master_binary()
    except FileNotFoundError as e:
        return str(e)
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return "it runs Mooncake in a private network namespace (unshare -n), which needs root"
    return None


def _mooncake_section(spec: str, ckpt: Path) -> bool:
    why = _mooncake_unavailable()
    if why is not None:
        print(f"\n[demo] Mooncake section skipped: {why}")
        return True
    print("\n[demo] two engine processes share a prefix through Mooncake Store "
          "(a master on loopback in a private network namespace)")
    inner = f"ip link set lo up && exec {sys.executable} -m graphgen.demo --spec {spec} --mooncake-inner {ckpt}"
    return subprocess.run(["unshare", "-n", "--", "sh", "-c", inner], timeout=300).returncode == 0


def _mooncake_inner(spec_path: str, ckpt: str) -> int:
    """Inside the namespace: a master + segment, then `graphgen run --pool mooncake://...` twice."""
    import json

    from .modelspec.loader import load_spec
    from .netutil import free_port

    bs = load_spec(spec_path).kv_cache.block_size
    shared = list(range(3, 3 + 4 * bs + 1))
    other = shared[: 2 * bs] + [200, 201, 202]
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "graphgen.runtime.pool.mooncake_server", "serve", "--port", str(port),
                               "--segment", "64MiB"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = server.stdout.readline().strip()
        if not line.startswith("ready"):
            print(f"  mooncake_server did not start: {line!r}")
            return 1
        url = f"mooncake://127.0.0.1:{port}"
        print(f"  master: {url}")
        tokens = {}
        for name, prompts in (("A", [shared]), ("B", [shared, other])):
            argv = [sys.executable, "-m", "graphgen", "run", "--spec", spec_path, "--weights", ckpt, "--pool", url,
                    "--json", "--max-new-tokens", "6"]
            for p in prompts:
                argv += ["--prompt-ids", ",".join(map(str, p))]
            res = subprocess.run(argv, capture_output=True, text=True, timeout=120)
            if res.returncode != 0:
                print(f"  process {name} failed ({res.returncode}): {res.stderr.strip().splitlines()[-1:]}")
                return 1
            for label, out in zip(("same prompt", "shares 2 blocks"), map(json.loads, res.stdout.splitlines())):
                print(f"  process {name}: {label:16s} hit {out['hit_tokens']:2d} tokens via {out['variant']:16s} "
                      f"-> {out['tokens']}")
                tokens.setdefault(label, []).append(out["tokens"])
        same = len({str(t) for t in tokens["same prompt"]}) == 1
        print(f"  B loaded A's blocks and got A's tokens: {'yes' if same else 'NO'}")
        return 0 if same else 1
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    sys.exit(main())
