"""The start phases' deadlines and progress lines (graphgen.runtime.progress; issue 27 item 5), on an
injected clock: a load slowed past the 120 s step deadline is not late, a hung one is, by its phase's
deadline; progress lines carry bytes / GB/s and graphs i/N with an ETA. No real time passes here; the
rank processes' side is tests/parallel/test_rank_deadlines.py."""
from __future__ import annotations

import io

import pytest

from graphgen.runtime.progress import STEP, Board, Deadlines, Progress, RankPhases


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_deadlines_parse_one_number_or_per_phase_and_refuse_nonsense():
    assert Deadlines.parse("900") == Deadlines(900, 900, 900)
    assert Deadlines.parse("load=7200, warmup=14400") == Deadlines(load=7200, warmup=14400)
    for bad in ("", "0", "load=-1", "compile=60", "load=x"):
        with pytest.raises(ValueError, match="--rank-timeout"):
            Deadlines.parse(bad)


def test_a_load_past_the_step_deadline_is_not_late_a_hung_one_is_reported_by_its_deadline():
    clock = Clock()
    phases = RankPhases(2, Deadlines(start=60, load=600, warmup=1200), step_timeout=120, clock=clock)
    clock.t += 30
    phases.report(0, {"phase": "load", "done": 0, "total": 10**9, "note": ""})
    phases.report(1, {"phase": "load", "done": 0, "total": 10**9, "note": ""})
    clock.t += 500  # past the 120 s step deadline: loading, not late
    assert phases.late([0, 1]) == []
    phases.report(0, {"phase": "load", "done": 4 * 10**8, "total": 10**9, "note": ""})
    phases.report(0, {"phase": "warmup", "done": 0, "total": 28, "note": ""})  # rank 0 moved on
    clock.t += 101  # rank 1 is 601 s into its load
    assert phases.late([0, 1]) == [1]
    msg = phases.describe([1], "start")
    assert "rank(s) [1] did not load its weights (load phase) within 600 s" in msg and "--rank-timeout" in msg
    # negative control: the old rule (one step deadline for the whole start) had failed both ranks long before
    old = RankPhases(2, Deadlines(120, 120, 120), step_timeout=120, clock=clock)
    clock.t += 121
    assert old.late([0, 1]) == [0, 1]


def test_a_rank_compiling_mid_command_has_the_warmup_deadline_then_the_step_deadline_again():
    clock = Clock()
    phases = RankPhases(1, Deadlines(), step_timeout=120, clock=clock)
    phases.command()
    phases.report(0, {"phase": "warmup", "done": 1, "total": None, "note": "decode"})  # first-use compile
    clock.t += 1000
    assert phases.late([0]) == []
    phases.report(0, {"phase": STEP, "done": 0, "total": None, "note": ""})
    clock.t += 121
    assert phases.late([0]) == [0]
    assert phases.describe([0], "generate") == "rank(s) [0] did not answer generate within 120 s"


def test_progress_emits_phase_changes_and_throttles_advances():
    clock, events = Clock(), []
    p = Progress(events.append, clock=clock, min_interval_s=0.5)
    p.phase("load", total=100)
    for _ in range(10):
        p.advance(5)  # no time passes: throttled
    clock.t += 1
    p.advance(5)
    p.phase("load", total=200)  # already loading (a loader inside the rank's load phase): the total only
    p.advance(145)  # reaches the total: sent
    assert [(e["phase"], e["done"], e["total"]) for e in events] == [("load", 0, 100), ("load", 55, 100),
                                                                     ("load", 200, 200)]


def test_board_prints_bytes_rate_and_graphs_with_an_eta_only_for_a_phase_longer_than_its_interval():
    clock, out = Clock(), io.StringIO()
    board = Board(2, out, clock=clock, interval_s=5, tty=False)
    board.update(0, {"phase": "load", "done": 0, "total": 61 * 10**9, "note": ""})
    clock.t += 1
    board.tick()
    assert out.getvalue() == ""  # a second into the phase: nothing yet
    clock.t += 9
    board.update(0, {"phase": "load", "done": 8 * 10**9, "total": 61 * 10**9, "note": ""})
    board.update(1, {"phase": "warmup", "done": 0, "total": 28, "note": ""})
    clock.t += 10
    board.update(1, {"phase": "warmup", "done": 7, "total": 28, "note": "decode"})
    line = out.getvalue().splitlines()[-1]
    assert "rank 0 load 8.0/61.0 GB 0.40 GB/s" in line and "rank 1 warmup 7/28 graphs eta 30s" in line
    board.finish()
    assert out.getvalue().splitlines()[-1] == "started in 20s"
    quiet = io.StringIO()
    Board(1, quiet, clock=clock, interval_s=5, tty=False).finish()
    assert quiet.getvalue() == ""


def test_board_draws_a_bar_in_place_on_a_terminal():
    clock, out = Clock(), io.StringIO()
    board = Board(1, out, clock=clock, interval_s=5, tty=True)
    board.update(0, {"phase": "warmup", "done": 0, "total": 4, "note": ""})
    clock.t += 6
    board.update(0, {"phase": "warmup", "done": 2, "total": 4, "note": ""})
    assert out.getvalue().startswith("\r") and "[##########..........]" in out.getvalue()
    assert "\n" not in out.getvalue()


def test_the_default_board_writes_to_stderr_as_it_is_now_and_a_closed_stream_costs_nothing(monkeypatch):
    clock = Clock()
    board = Board(1, clock=clock, interval_s=5)  # no stream given: sys.stderr at print time
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr("sys.stderr", first)
    first.close()  # e.g. a test's capture replaced and closed
    board.update(0, {"phase": "load", "done": 0, "total": 10, "note": ""})
    clock.t += 6
    board.update(0, {"phase": "load", "done": 5, "total": 10, "note": ""})  # no error, nothing printed
    monkeypatch.setattr("sys.stderr", second)
    clock.t += 6
    board.update(0, {"phase": "load", "done": 6, "total": 10, "note": ""})
    assert "rank 0 load" in second.getvalue()


def test_each_start_has_a_board_of_its_own_and_nothing_prints_outside_one():
    """A process that starts engines one after another (a server's tests, a Python user) prints each
    start's own phase and bytes: a process-wide board carried the first start's 'load' phase and its
    bytes into every later load, and printed them from loads outside any start."""
    import io

    from graphgen.runtime.progress import current_progress, starting

    outside = current_progress()
    outside.phase("load", 10)
    outside.advance(10)
    assert current_progress() is not outside  # nothing kept between loads outside a start
    for _ in range(2):
        out = io.StringIO()
        with starting(out=out) as report:
            assert report is current_progress() and report.done == 0 and report.phase_name is None
            report.phase("load", 100)
            report.advance(40)
            assert report.done == 40
        assert out.getvalue() == ""  # a quick start prints nothing
    assert current_progress() is not report
