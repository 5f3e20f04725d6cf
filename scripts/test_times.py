#!/usr/bin/env python3
"""Where the test suite's time goes: a pytest JUnit XML file summed by folder and by marker.

    .venv/bin/python -m pytest --junitxml=/tmp/junit.xml ...
    python3 scripts/test_times.py /tmp/junit.xml [--top 25]

A test's time is JUnit's (setup + call + teardown, so a module or session fixture counts in the test
that first asked for it). The folder is the one under ``tests/`` (``.`` for a file at its top). The
markers come from the ``markers`` property ``tests/conftest.py`` records on every test (the suite's
registered markers the test carries; "unmarked" when none), so ``slow`` and ``not slow`` are the
suite's two lanes (docs/testing.md). Standard library only: it runs without the venv.
"""
from __future__ import annotations

import argparse
import collections
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass

__all__ = ["Case", "read_cases", "summarize", "main"]


@dataclass(frozen=True)
class Case:
    """One test item of the XML: its folder under tests/, its id, its seconds, its markers."""
    folder: str
    name: str
    seconds: float
    markers: tuple[str, ...]
    outcome: str


def _folder(classname: str) -> str:
    """``tests.parallel.test_x.TestY`` -> ``parallel``; ``tests.test_x`` -> ``.``."""
    parts = classname.split(".")
    if parts and parts[0] == "tests":
        parts = parts[1:]
    return parts[0] if len(parts) > 1 and not parts[0].startswith("test_") else "."


def _outcome(case: ET.Element) -> str:
    for kind in ("failure", "error", "skipped"):
        if case.find(kind) is not None:
            return kind
    return "passed"


def read_cases(path: str) -> list[Case]:
    out = []
    for case in ET.parse(path).iter("testcase"):
        props = {p.get("name"): p.get("value", "") for p in case.iter("property")}
        markers = tuple(m for m in props.get("markers", "").split(",") if m)
        classname = case.get("classname", "")
        out.append(Case(_folder(classname), f"{classname}::{case.get('name', '')}", float(case.get("time", 0) or 0),
                        markers, _outcome(case)))
    return out


def _table(title: str, groups: dict[str, list[Case]], total: float) -> list[str]:
    rows = [f"| {title} | items | seconds | share |", "|---|---|---|---|"]
    for key, cases in sorted(groups.items(), key=lambda kv: -sum(c.seconds for c in kv[1])):
        s = sum(c.seconds for c in cases)
        rows.append(f"| {key} | {len(cases)} | {s:.1f} | {100 * s / total if total else 0:.0f} % |")
    return rows


def summarize(cases: list[Case], top: int = 25) -> str:
    """Markdown: by folder, by marker (each marker, and the ``not slow`` lane), the slowest ``top``."""
    total = sum(c.seconds for c in cases)
    by_folder: dict[str, list[Case]] = collections.defaultdict(list)
    by_marker: dict[str, list[Case]] = collections.defaultdict(list)
    for c in cases:
        by_folder[c.folder].append(c)
        for m in c.markers or ("unmarked",):
            by_marker[m].append(c)
        if "slow" not in c.markers:
            by_marker["not slow"].append(c)
    outcomes = collections.Counter(c.outcome for c in cases)
    lines = [f"{len(cases)} items, {total:.1f} s of test time ("
             + ", ".join(f"{n} {k}" for k, n in sorted(outcomes.items())) + ")", ""]
    lines += _table("folder", by_folder, total) + [""] + _table("marker", by_marker, total)
    if top > 0:
        lines += ["", f"slowest {min(top, len(cases))}:"]
        lines += [f"{c.seconds:8.1f} s  {c.name}" for c in sorted(cases, key=lambda c: -c.seconds)[:top]]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("junit_xml")
    ap.add_argument("--top", type=int, default=25, help="how many of the slowest tests to list (default 25; 0: none)")
    a = ap.parse_args(argv)
    try:
        cases = read_cases(a.junit_xml)
    except (OSError, ET.ParseError) as e:
        print(f"test_times: cannot read {a.junit_xml}: {e}", file=sys.stderr)
        return 2
    print(summarize(cases, a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
