"""A pytest plugin (loaded by tests/conftest.py): under CI (``CI`` set) or ``GRAPHGEN_NO_SKIPS=1``,
a skipped test fails the run unless its reason is in ``ALLOWED``. ``./dev test`` installs every
extra the tests import, so a skip there means a test silently did not run.

``ALLOWED`` (substrings of the skip reason), each a skip that is right on some machine:

- the CPU stand-in tests step aside on a host with the real ``torch_npu`` (an Ascend machine).
"""
from __future__ import annotations

import os

ALLOWED = (
    "real torch_npu installed; stand-in not used",
    "torch_npu is installed here",
)

_skipped: list[tuple[str, str]] = []


def _strict() -> bool:
    return bool(os.environ.get("CI")) or os.environ.get("GRAPHGEN_NO_SKIPS") == "1"


def _reason(report) -> str:
    lr = report.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:
        return str(lr[2]).removeprefix("Skipped: ")
    return str(lr)


def _note(report) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = _reason(report)
        if not any(a in reason for a in ALLOWED):
            _skipped.append((report.nodeid, reason))


def pytest_runtest_logreport(report) -> None:
    _note(report)


def pytest_collectreport(report) -> None:
    _note(report)


def pytest_sessionfinish(session, exitstatus) -> None:
    if not (_strict() and _skipped):
        return
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [f"{len(_skipped)} unexpected skip(s) (CI / GRAPHGEN_NO_SKIPS=1; allowed: tests/support/skips.py):"]
    lines += [f"  {nodeid}: {reason}" for nodeid, reason in _skipped]
    if tr is not None:
        tr.write_line("\n".join(lines), red=True)
    if session.exitstatus == 0:
        session.exitstatus = 1
