"""A type checker on the build path, and a ratchet on the runtime's type errors (mypy, pinned in
constraints.txt; its settings are pyproject.toml's ``[tool.mypy]``).

- ``mypy --strict`` over the build path (spec -> generated/: ``BUILD_PATH``) reports nothing;
- ``mypy`` at its default level over ``graphgen/runtime`` reports exactly the errors of
  ``tests/mypy_runtime_baseline.txt`` per (file, error code), never more; when some are fixed the
  baseline must go down with them (``python tests/test_types.py --update-baseline``, then commit it).

The two runs go in parallel, each with a cache of its own under ``.mypy_cache/`` (a cold run reads
torch's and numpy's annotations: ~25 s of CPU; a warm one ~2 s). A run that checks nothing, or a
mypy that is missing or crashes, fails: the counts of checked files are compared with the sources.
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BASELINE = REPO / "tests" / "mypy_runtime_baseline.txt"
BUILD_PATH = ("graphgen/ir", "graphgen/families", "graphgen/modelspec", "graphgen/passes", "graphgen/lower",
              "graphgen/generate.py", "graphgen/cli/build.py")
# build-path files not under --strict, and why
NOT_STRICT = {
    "graphgen/lower/npu_helpers.py": "torch_npu code the NPU lowering copies verbatim into generated modules (it "
                                     "reads it as text, never imports it); torch_npu cannot be installed here, and "
                                     "annotating the helpers would change every generated NPU module",
}
RUNTIME = "graphgen/runtime"

_ERROR = re.compile(r"^(?P<file>[^:\s]+\.py):(?P<line>\d+): error: (?P<message>.*?)(?:  \[(?P<code>[a-z-]+)\])?$")
_SUMMARY = re.compile(r"^(?:Success: no issues found|Found (?P<errors>\d+) errors? in \d+ files?) "
                      r"(?:in (?P<ok_files>\d+) source files?|\(checked (?P<files>\d+) source files?\))$")


def sources(*paths: str) -> list[str]:
    """The .py files under ``paths`` (a folder or a file, relative to the repository)."""
    out: list[str] = []
    for p in paths:
        path = REPO / p
        out += [f.relative_to(REPO).as_posix() for f in sorted(path.rglob("*.py"))] if path.is_dir() else [p]
    return out


def strict_files() -> list[str]:
    return [f for f in sources(*BUILD_PATH) if f not in NOT_STRICT]


def _mypy(args: list[str], cache: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "mypy", "--cache-dir", str(REPO / ".mypy_cache" / cache), *args],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def run_both() -> dict[str, tuple[int, str]]:
    """Both runs at once: name -> (exit status, output)."""
    procs = {"strict": _mypy(["--strict", *strict_files()], "strict"), "runtime": _mypy([RUNTIME], "runtime")}
    outs = {name: p.communicate(timeout=600)[0] for name, p in procs.items()}
    return {name: (p.returncode, outs[name]) for name, p in procs.items()}


def checked(output: str) -> tuple[int, int]:
    """(errors, files checked) from mypy's last line; AssertionError when it has none (mypy crashed
    or is missing)."""
    last = output.strip().splitlines()[-1] if output.strip() else ""
    m = _SUMMARY.match(last)
    assert m, f"mypy gave no summary line (not installed, or it crashed):\n{output[-3000:]}"
    return int(m["errors"] or 0), int(m["files"] or m["ok_files"])


def error_counts(output: str) -> collections.Counter[tuple[str, str]]:
    """(file, error code) -> how many errors mypy reported there."""
    found: collections.Counter[tuple[str, str]] = collections.Counter()
    for line in output.splitlines():
        m = _ERROR.match(line)
        if m:
            found[(m["file"], m["code"] or "-")] += 1
    return found


def read_baseline(text: str) -> collections.Counter[tuple[str, str]]:
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            file, code, n = line.split()
            counts[(file, code)] = int(n)
    return counts


def baseline_text(counts: collections.Counter[tuple[str, str]]) -> str:
    head = ("# mypy's errors in graphgen/runtime at its default level, per file and error code (tests/test_types.py):\n"
            "# the test fails when a count grows, or shrinks without this file following it down.\n")
    return head + "".join(f"{file} {code} {n}\n" for (file, code), n in sorted(counts.items()))


def compare(now: collections.Counter[tuple[str, str]], base: collections.Counter[tuple[str, str]],
            output: str) -> list[str]:
    """What differs from the baseline, as sentences (empty: the same errors)."""
    problems = []
    for key in sorted(set(now) | set(base)):
        file, code = key
        if now[key] > base[key]:
            lines = [ln for ln in output.splitlines() if ln.startswith(f"{file}:") and ln.endswith(f"[{code}]")]
            problems.append(f"{file}: {now[key]} [{code}] errors, the baseline allows {base[key]}:\n    "
                            + "\n    ".join(lines))
        elif now[key] < base[key]:
            problems.append(f"{file}: {now[key]} [{code}] errors, fewer than the baseline's {base[key]}: run "
                            f"'python tests/test_types.py --update-baseline' and commit the lower baseline")
    return problems


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[int, str]]:
    return run_both()


@pytest.mark.slow  # two mypy processes (the build path strict, the runtime at default), ~25 s
def test_build_path_passes_mypy_strict(runs):
    rc, out = runs["strict"]
    errors, files = checked(out)
    assert rc == 0 and errors == 0, f"mypy --strict on the build path:\n{out}"
    assert files == len(strict_files()) >= 45


@pytest.mark.slow  # the same mypy runs (the `runs` fixture)
def test_runtime_type_errors_match_the_baseline(runs):
    rc, out = runs["runtime"]
    errors, files = checked(out)
    assert rc in (0, 1) and files == len(sources(RUNTIME)) >= 50, out[-3000:]
    now = error_counts(out)
    assert sum(now.values()) == errors  # every error line was read
    problems = compare(now, read_baseline(BASELINE.read_text()), out)
    assert not problems, "graphgen/runtime against tests/mypy_runtime_baseline.txt:\n" + "\n".join(problems)


@pytest.mark.slow  # the same mypy runs (the `runs` fixture) and one more
def test_strict_mode_reports_an_untyped_function(tmp_path, runs):
    """Negative control: the same --strict run (this project's settings) on a module with an
    unannotated function and a wrong return type reports both."""
    bad = tmp_path / "untyped_module.py"
    bad.write_text("def f(x):\n    return x\n\n\ndef g() -> int:\n    return 'one'\n")
    proc = _mypy(["--strict", "--config-file", str(REPO / "pyproject.toml"), str(bad)], "strict")
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 1 and checked(out) == (2, 1), out
    assert {code for _, code in error_counts(out.replace(str(bad), "untyped_module.py"))} == {"no-untyped-def",
                                                                                            "return-value"}


def test_baseline_comparison_names_growth_and_slack():
    """Negative control of the ratchet on synthetic mypy output: one more error in a bucket and one
    fewer are both reported, each naming its file and code; the same errors pass."""
    out = ("graphgen/runtime/a.py:3: error: Item \"None\" has no attribute \"x\"  [union-attr]\n"
           "graphgen/runtime/a.py:9: error: Item \"None\" has no attribute \"y\"  [union-attr]\n"
           "graphgen/runtime/b.py:1: error: Need type annotation for \"z\"  [var-annotated]\n"
           "Found 3 errors in 2 files (checked 7 source files)\n")
    now = error_counts(out)
    assert checked(out) == (3, 7) and sum(now.values()) == 3
    same = read_baseline(baseline_text(now))
    assert compare(now, same, out) == []
    base = read_baseline("graphgen/runtime/a.py union-attr 1\ngraphgen/runtime/b.py var-annotated 2\n")
    grew, shrank = compare(now, base, out)
    assert grew.startswith("graphgen/runtime/a.py: 2 [union-attr] errors, the baseline allows 1") and ":9:" in grew
    assert shrank.startswith("graphgen/runtime/b.py: 1 [var-annotated] errors, fewer than the baseline's 2")


if __name__ == "__main__":
    if sys.argv[1:] != ["--update-baseline"]:
        raise SystemExit("usage: python tests/test_types.py --update-baseline")
    out = _mypy([RUNTIME], "runtime").communicate(timeout=600)[0]
    checked(out)
    BASELINE.write_text(baseline_text(error_counts(out)))
    print(f"wrote {BASELINE.relative_to(REPO)}: {sum(error_counts(out).values())} errors")
