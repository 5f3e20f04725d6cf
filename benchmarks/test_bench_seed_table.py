"""Smoke test of ``benchmarks/bench_seed_table.py`` (issue 39): ``--quick --rows 1`` runs the seed's first
row (DeepSeek-V3.1 accuracy, 64 concurrent + CP/SP, sync write) end to end and prints it in the seed's
layout. The benchmark's entry point is what is checked, so it runs as a process (it starts its own
servers). It costs ~32 s here, over the 20 s issue 39 allows the suite, so it lives beside the benchmark,
outside pyproject's ``testpaths`` (``./dev test`` never collects it); run it by hand:
``.venv/bin/python -m pytest benchmarks/test_bench_seed_table.py -q``. Not a timed test: no speed is asserted, only that the row is printed
with the seed's figure and ours — the seed's layout either refused with the server's own sentence or
measured — and that the accuracy figure is a measurement (positions compared, counts within bounds)."""

from __future__ import annotations

import json
import subprocess
import sys

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_quick_row_1_prints_the_seeds_figure_and_ours(tmp_path):
    out = tmp_path / "seed.json"
    p = subprocess.run([sys.executable, "benchmarks/bench_seed_table.py", "--quick", "--rows", "1", "--acc-prompts",
                        "4", "--acc-len", "256", "--acc-tokens", "4", "--json", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [ln for ln in p.stdout.splitlines() if ln.startswith("| 1 |")]
    assert len(rows) == 1, p.stdout
    assert "DeepSeek V3.1" in rows[0] and "68.18%" in rows[0] and "CP/SP" in rows[0]
    res = json.loads(out.read_text())["results"]["ds_cpsp"]
    assert set(res) >= {"layout", "refused", "nearest"}
    if res["refused"]:  # the seed's layout refused today: the sentence is the server's own, in the table
        assert res["refused"].split("**: ", 1)[1] in p.stdout
        assert "nearest runnable, not the seed's configuration" in p.stdout
    acc = res.get("accuracy")
    assert acc is not None, res.get("failed") or res.get("nearest_refused")
    assert acc["prompts"] == 4 and 0 <= acc["identical"] <= 4
    assert acc["positions"] > 0 and acc["max_logprob_diff"] >= 0
    assert f"**{acc['identical']}/4** greedy sequences identical" in p.stdout
    assert not [ln for ln in p.stdout.splitlines() if ln.startswith("| 2 |")]  # --rows 1: row 1 only
