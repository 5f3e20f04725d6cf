"""scripts/test_times.py sums a JUnit XML by folder and by marker: checked on a hand-written file
(the sums are known) and on the XML of a real child pytest run of two tiny tests (a ``slow`` one and
an unmarked one), which also shows tests/conftest.py records the markers the script reads."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

from support.paths import REPO, TESTS

XML = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.parallel.test_a" name="test_one" time="10.5">
  <properties><property name="markers" value="slow" /></properties></testcase>
<testcase classname="tests.parallel.test_a" name="test_two" time="2.0">
  <properties><property name="markers" value="slow,xdist_group" /></properties></testcase>
<testcase classname="tests.ir.test_b.TestC" name="test_three" time="1.25">
  <properties><property name="markers" value="" /></properties><failure message="x"/></testcase>
<testcase classname="tests.test_top" name="test_four" time="0.25" />
</testsuite></testsuites>
"""


def _script():
    spec = importlib.util.spec_from_file_location("test_times", REPO / "scripts" / "test_times.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["test_times"] = mod   # its dataclass looks its module up
    spec.loader.exec_module(mod)
    return mod


def test_sums_by_folder_and_marker(tmp_path):
    tt = _script()
    path = tmp_path / "junit.xml"
    path.write_text(XML)
    cases = tt.read_cases(str(path))
    assert [(c.folder, c.seconds, c.markers, c.outcome) for c in cases] == [
        ("parallel", 10.5, ("slow",), "passed"), ("parallel", 2.0, ("slow", "xdist_group"), "passed"),
        ("ir", 1.25, (), "failure"), (".", 0.25, (), "passed")]
    text = tt.summarize(cases, top=2)
    assert text.splitlines()[0] == "4 items, 14.0 s of test time (1 failure, 3 passed)"
    for row in ("| parallel | 2 | 12.5 | 89 % |", "| ir | 1 | 1.2 | 9 % |", "| . | 1 | 0.2 | 2 % |",
                "| slow | 2 | 12.5 | 89 % |", "| xdist_group | 1 | 2.0 | 14 % |", "| unmarked | 2 | 1.5 | 11 % |",
                "| not slow | 2 | 1.5 | 11 % |"):
        assert row in text.splitlines(), (row, text)
    assert text.splitlines()[-2:] == ["    10.5 s  tests.parallel.test_a::test_one",
                                      "     2.0 s  tests.parallel.test_a::test_two"]


def test_a_real_run_and_the_command_line(tmp_path):
    """A child pytest (the suite's conftest, so its marker property) of two tests, then the script as
    a command on its XML; an unreadable file is exit 2 in one sentence."""
    (tmp_path / "test_pair.py").write_text(
        "import pytest\n@pytest.mark.slow\ndef test_marked():\n    pass\ndef test_plain():\n    pass\n")
    xml = tmp_path / "junit.xml"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(REPO),
                          "-c", str(REPO / "pyproject.toml"), "--confcutdir", str(TESTS), "-p", "conftest",
                          f"--junitxml={xml}", str(tmp_path / "test_pair.py")],
                         cwd=TESTS, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "test_times.py"), str(xml)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("2 items, ") and lines[0].endswith("s of test time (2 passed)")
    assert any(line.startswith("| slow | 1 | ") for line in lines) and any(
        line.startswith("| not slow | 1 | ") for line in lines), res.stdout
    bad = subprocess.run([sys.executable, str(REPO / "scripts" / "test_times.py"), str(tmp_path / "none.xml")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("test_times: cannot read ") and not bad.stdout
