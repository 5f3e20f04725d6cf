"""Events with generations, streams, jobs (prior-art defects 2 and 3 are tested here)."""
import threading
import time

import pytest

from graphgen.runtime.core.streams import Event, EventAborted, EventSet, EventTimeout, Job, JobTimeout, Stream


def recorded(event, gen: int) -> bool:
    """Whether generation ``gen`` of ``event`` is recorded: a wait that must not block."""
    try:
        event.wait(gen, timeout=0)
        return True
    except EventTimeout:
        return False


@pytest.fixture
def stream():
    s = Stream("kv_save")
    yield s
    s.close(timeout=2)


# ----------------------------------------------------------------------------------------- events

def test_wait_returns_after_record_of_same_or_later_generation():
    e = Event("ev.L00.kv_write")
    assert not recorded(e, 0)
    e.record(0)
    e.wait(0, timeout=0)          # already recorded: no blocking
    assert recorded(e, 0) and not recorded(e, 1)
    e.record(3)                   # a later record also satisfies earlier generations
    e.wait(2, timeout=0)
    assert recorded(e, 3) and not recorded(e, 4)


def test_stale_record_does_not_release_newer_wait():
    e = Event("ev")
    e.record(4)                   # step 4 done
    released = threading.Event()

    def waiter():
        e.wait(5, timeout=2)      # step 5's wait
        released.set()

    t = threading.Thread(target=waiter)
    t.start()
    e.record(4)                   # repeated record of the previous step: must not release
    assert not released.wait(0.1)
    e.record(5)
    assert released.wait(2)
    t.join(2)


def test_wait_timeout_raises_naming_event_and_generation():
    e = Event("ev.save_done")
    e.record(1)
    t0 = time.monotonic()
    with pytest.raises(EventTimeout,
                       match=r"'ev.save_done'.*generation 2.*last recorded generation: 1"):
        e.wait(2, timeout=0.05)
    assert time.monotonic() - t0 >= 0.04
    assert isinstance(EventTimeout("x"), TimeoutError)


def test_generations_must_not_go_backwards_and_must_be_valid():
    e = Event("ev")
    e.record(2)
    with pytest.raises(ValueError, match="backwards"):
        e.record(1)
    for bad in (-1, 1.0, True, "1"):
        with pytest.raises(ValueError):
            e.wait(bad, timeout=0)


def test_abort_releases_only_aborted_generations():
    e = Event("ev")
    errors = []

    def waiter(gen):
        try:
            e.wait(gen, timeout=2)
            errors.append((gen, "ok"))
        except EventAborted:
            errors.append((gen, "aborted"))

    t = threading.Thread(target=waiter, args=(0,))
    t.start()
    e.abort(0, "forward failed")
    t.join(2)
    assert errors == [(0, "aborted")]
    with pytest.raises(EventTimeout):      # the next step is unaffected by the abort
        e.wait(1, timeout=0.02)
    e.record(1)
    e.wait(1, timeout=0)


def test_event_set_bind_and_unknown_names():
    evs = EventSet(["ev.kv_ready.L00", "ev.kv_ready.L01"], default_timeout=0.05)
    ev = evs.bind(7)
    ev["ev.kv_ready.L00"].record()
    ev["ev.kv_ready.L00"].wait()
    assert recorded(evs["ev.kv_ready.L00"], 7)
    assert not recorded(evs["ev.kv_ready.L01"], 7)
    with pytest.raises(EventTimeout):      # default_timeout applies to bound waits
        ev["ev.kv_ready.L01"].wait()
    with pytest.raises(KeyError,
                       match=r"ev.kv_ready.L0\b.*known events.*ev.kv_ready.L00.*ev.kv_ready.L01"):
        ev["ev.kv_ready.L0"]
    with pytest.raises(KeyError, match="known events"):
        evs["ev.kv_raedy.L00"]            # a misspelt name must fail loudly (prior-art defect 1)
    assert sorted(ev) == ["ev.kv_ready.L00", "ev.kv_ready.L01"] and len(evs) == 2


def test_event_set_bound_to_next_step_is_not_satisfied_by_previous_step():
    evs = EventSet(["ev.a"])
    evs.bind(0)["ev.a"].record()
    with pytest.raises(EventTimeout):
        evs.bind(1)["ev.a"].wait(timeout=0.02)
    assert not recorded(evs["ev.a"], 1)


def test_event_set_rejects_duplicate_names():
    with pytest.raises(ValueError, match="duplicate.*ev.a"):
        EventSet(["ev.a", "ev.b", "ev.a"])


def test_event_sets_are_independent():
    # two graphs with the same event names must not share state (prior-art defect 3)
    a, b = EventSet(["ev.x"]), EventSet(["ev.x"])
    a.bind(0)["ev.x"].record()
    assert not recorded(b["ev.x"], 0)


def test_cross_thread_record_wait_pipeline(stream):
    # the save stream waits per layer; main records per layer: every save sees its layer's data
    layers = 4
    evs = EventSet([f"ev.kv_ready.L{i:02d}" for i in range(layers)])
    data = [None] * layers
    seen = []
    for gen in range(3):
        ev = evs.bind(gen)

        def save(ev=ev, gen=gen):
            for i in range(layers):
                ev[f"ev.kv_ready.L{i:02d}"].wait(timeout=2)
                seen.append(data[i])

        job = stream.launch(save)        # launched first, like queued device work
        for i in range(layers):
            time.sleep(0.005)
            data[i] = (gen, i)
            ev[f"ev.kv_ready.L{i:02d}"].record()
        job.result(timeout=2)
    assert seen == [(g, i) for g in range(3) for i in range(layers)]


# ------------------------------------------------------------------------------------ jobs/streams

def test_job_queued_behind_slow_job_is_not_done(stream):
    gate = threading.Event()
    slow = stream.launch(gate.wait, 2)
    queued = stream.launch(lambda: 42)
    # defect 2: completion is tracked from enqueue, not from pick-up by the worker
    assert not queued.done() and queued.state == "queued"
    with pytest.raises(JobTimeout):
        queued.wait(timeout=0.02)
    assert not slow.done()
    gate.set()
    assert queued.result(timeout=2) == 42
    assert slow.done() and queued.done()


def test_fifo_order(stream):
    out = []
    jobs = [stream.launch(out.append, i) for i in range(50)]
    jobs[-1].wait(timeout=2)
    assert out == list(range(50))
    assert all(j.done() for j in jobs)


def test_exception_propagates_and_stream_survives(stream):
    def boom():
        raise KeyError("bad block")

    j = stream.launch(boom)
    ok = stream.launch(lambda x: x * 2, 21)
    with pytest.raises(KeyError, match="bad block"):
        j.result(timeout=2)
    assert isinstance(j.exception(), KeyError)
    assert ok.result(timeout=2) == 42                  # the worker kept running


def test_jobs_run_on_the_worker_thread(stream):
    assert stream.launch(threading.current_thread).result(2) is not threading.current_thread()


def test_close_drains_then_refuses():
    s = Stream("x")
    out = []
    for i in range(5):
        s.launch(out.append, i)
    s.close(timeout=2)
    assert out == list(range(5)) and s.closed
    assert not s._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        s.launch(print)
    s.close()   # idempotent


def test_worker_thread_is_daemon(stream):
    assert stream._thread.daemon


def test_launch_rejects_non_callable(stream):
    with pytest.raises(TypeError):
        stream.launch(3)
    assert isinstance(stream.launch(int).result(2), int)
    assert isinstance(stream.launch(int), Job)
