"""The full-size launch table of docs/npu.md ("Full-size launch"): ``graphgen dry-run`` of each shipped
full-size spec over a sparse checkpoint of its published config (``scripts/sparse_checkpoint.py``), one
process per rank under ``/usr/bin/time -v``: device peak (the ledger), host peak (the process's maximum
RSS), load time, CPU time, bytes read, KV blocks and graphs.

    .venv/bin/python benchmarks/bench_dry_run.py [--specs qwen3_32b,deepseek_v3_1,...] [--ranks all|0,31]
        [--work DIR] [--json OUT]

Each rank is measured alone (nothing else of the run in its process), as ``graphgen dry-run --rank R`` runs
it; ``--ranks all`` (default) every rank of the layout. The checkpoints are written once into ``--work``
(default: a temporary folder; a few MiB of disk for 1.3 TB of apparent size). A rank that does not fit
prints its one sentence and is reported as such.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIGS = ROOT / "tests/load/data"  # the published configs (transformers 4 layout), transcribed from the repos
SPECS = {"qwen3_32b": "qwen3_32b", "deepseek_v3_1": "deepseek_v3_1", "deepseek_v3_1_dp_ep": "deepseek_v3_1",
         "deepseek_v3_1_mtp": "deepseek_v3_1"}  # spec -> its published config
GIB = 1 << 30


def _checkpoint(work: Path, config: str) -> Path:
    import importlib.util

    out = work / config
    if not (out / "model.safetensors.index.json").exists():
        spec = importlib.util.spec_from_file_location("sparse_checkpoint", ROOT / "scripts/sparse_checkpoint.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.write_sparse_checkpoint(json.loads((CONFIGS / f"{config}.config.json").read_text()), out)
    return out


def _rank(spec: str, ckpt: Path, rank: int, tmp: Path) -> dict:
    out = tmp / f"{spec}.{rank}.json"
    t0 = time.monotonic()
    r = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-m", "graphgen", "dry-run", "--spec",
                        str(ROOT / "specs" / f"{spec}.yaml"), "--weights", str(ckpt), "--rank", str(rank), "--json",
                        str(out)], capture_output=True, text=True, cwd=ROOT)
    wall = time.monotonic() - t0

    def grab(pattern):
        m = re.search(pattern, r.stderr)
        return float(m[1]) if m else float("nan")

    row = json.loads(out.read_text())["ranks"][0] if out.exists() else {"rank": rank, "error": r.stderr.strip()[-300:]}
    row.update(rss_bytes=int(grab(r"Maximum resident set size \(kbytes\): (\d+)") * 1024), wall_s=round(wall, 1),
               cpu_s=round(grab(r"User time \(seconds\): ([\d.]+)") + grab(r"System time \(seconds\): ([\d.]+)"), 1))
    err = next((l for l in r.stderr.splitlines() if "does not fit" in l), None)
    if err:
        row["error"] = err
    return row


def _line(spec: str, row: dict) -> str:
    if "device_peak_bytes" not in row:
        return f"| {spec} | {row['rank']} | does not fit: {row.get('error', '?')[:160]} |"
    return (f"| {spec} | {row['rank']} | {row['device_peak_bytes'] / GIB:.2f} of {row['budget_bytes'] / GIB:.2f} | "
            f"{row['rss_bytes'] / GIB:.2f} | {row['load_s']:.1f} | {row['cpu_s']:.1f} / {row['wall_s']:.1f} | "
            f"{row['bytes_read'] / GIB:.1f} | {row['kv_blocks']} | {row['graphs']} |"
            + (" does not fit |" if "error" in row else ""))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--specs", default=",".join(SPECS), help="shipped full-size specs (default: all four)")
    p.add_argument("--ranks", default="all", help="all, or a comma list of ranks")
    p.add_argument("--work", default=None, help="folder for the sparse checkpoints (default: a temporary one)")
    p.add_argument("--json", default=None, help="write every row as JSON")
    args = p.parse_args(argv)
    from graphgen.modelspec.loader import load_spec

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        rows = {}
        print(f"load average {os.getloadavg()[0]:.1f}; one process per rank")
        print("| spec | rank | device peak, GiB (of budget) | host peak RSS, GiB | load s | CPU / wall s | read GiB | "
              "KV blocks | graphs |")
        print("|---|---|---|---|---|---|---|---|---|")
        for spec in args.specs.split(","):
            ckpt = _checkpoint(work, SPECS[spec])
            world = load_spec(ROOT / "specs" / f"{spec}.yaml").parallel.world
            ranks = range(world) if args.ranks == "all" else [int(r) for r in args.ranks.split(",") if int(r) < world]
            rows[spec] = []
            for r in ranks:
                rows[spec].append(_rank(spec, ckpt, r, Path(tmp)))
                print(_line(spec, rows[spec][-1]), flush=True)
        print(f"load average {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
