"""Fault injection: parsing, deterministic put failures, FaultyPool visibility."""
import pickle
import threading

import pytest

import graphgen.runtime.core.faults as faults_mod
from graphgen.runtime.core.faults import Faults, FileGate
from graphgen.runtime.pool.faulty import FaultyPool, wrap_pool
from graphgen.runtime.pool import HostPool


def test_parse_cli_string():
    f = Faults.parse("save_delay=0.05,put_fail=0.5,forward_delay=0.01,put_delay=0.02,seed=1")
    assert f == Faults(save_delay_s=0.05, forward_delay_s=0.01, put_delay_s=0.02, put_fail=0.5,
                       seed=1)
    assert Faults.parse(" save_delay_s = 0.1 , ") == Faults(save_delay_s=0.1)
    assert Faults.parse("") == Faults() and not Faults().active
    assert f.active
    assert Faults.parse(f.format()) == f


@pytest.mark.parametrize("text, match", [
    ("save_dealy=0.1", r"unknown fault 'save_dealy'.*known names.*save_delay"),
    ("save_delay", "expected name=value"),
    ("save_delay=", "expected name=value"),
    ("put_fail=lots", "not a number"),
    ("seed=1.5", "not an int"),
    ("put_fail=1.5", r"probability in \[0, 1\]"),
    ("save_delay=-1", ">= 0"),
    ("seed=1,seed=2", "given twice"),
])
def test_parse_errors(text, match):
    with pytest.raises(ValueError, match=match):
        Faults.parse(text)


def test_put_fail_is_deterministic_with_seed():
    keys = [f"k{i}" for i in range(400)]
    a = [Faults(put_fail=0.5, seed=1).put_fails(k) for k in keys]
    b = [Faults(put_fail=0.5, seed=1).put_fails(k) for k in reversed(keys)][::-1]
    c = [Faults(put_fail=0.5, seed=2).put_fails(k) for k in keys]
    assert a == b                                        # independent of call order
    assert a != c                                        # the seed matters
    assert 150 < sum(a) < 250                            # roughly the requested probability
    assert not any(Faults(put_fail=0.0).put_fails(k) for k in keys)
    assert all(Faults(put_fail=1.0).put_fails(k) for k in keys)
    # a retry of the same key is a fresh draw
    f = Faults(put_fail=0.5, seed=3)
    assert len({tuple(f.put_fails(k, n) for n in range(8)) for k in keys[:20]}) > 1
    assert any(len({f.put_fails(k, n) for n in range(8)}) == 2 for k in keys[:20])


def test_faulty_pool_failure_is_deterministic_and_leaves_nothing_visible():
    keys = [f"blk{i}" for i in range(60)]

    def run():
        pool = FaultyPool(HostPool(10_000), Faults(put_fail=0.5, seed=7))
        return pool, [pool.put(k, k.encode()) for k in keys]

    (p1, r1), (p2, r2) = run(), run()
    assert r1 == r2 and 0 < sum(r1) < len(keys)
    expect = [Faults(put_fail=0.5, seed=7).put_fails(k) for k in keys]
    assert r1 == [not e for e in expect]
    for k, ok in zip(keys, r1):
        assert p1.contains(k) == ok and p1.inner.contains(k) == ok
        assert p1.get(k) == (k.encode() if ok else None)
    assert p1.stats()["injected_put_failures"] == len(keys) - sum(r1)
    assert p1.stats()["used_bytes"] == sum(len(k) for k, ok in zip(keys, r1) if ok)
    # leading_run passes through: it stops at the first failed put
    assert p1.leading_run(keys) == r1.index(False)


def test_callable_put_fail():
    pool = FaultyPool(HostPool(100), Faults(put_fail=lambda k: k.endswith("x")))
    assert pool.put("a", b"1") and not pool.put("bx", b"2")
    assert pool.contains("a") and not pool.contains("bx")


class _AllAtOnce:
    """A put gate that opens once ``n`` puts wait on it together: it breaks (BrokenBarrierError)
    when the puts are serialised, so no timing bound is needed to see concurrency."""

    def __init__(self, n: int, timeout_s: float):
        self.barrier, self.timeout_s = threading.Barrier(n), timeout_s

    def wait(self):
        self.barrier.wait(timeout=self.timeout_s)


def _four_puts(pool) -> list:
    errors = []

    def put(i):
        try:
            pool.put(f"k{i}", b"v")
        except threading.BrokenBarrierError as e:
            errors.append(e)

    ts = [threading.Thread(target=put, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    return errors


def test_put_delay_applies_and_is_concurrent(monkeypatch):
    slept = []
    monkeypatch.setattr(faults_mod.time, "sleep", lambda s: slept.append(s))
    pool = FaultyPool(HostPool(100), Faults(put_delay_s=0.05, put_gate=_AllAtOnce(4, timeout_s=20)))
    assert _four_puts(pool) == []                        # all four waited at once: not serialised under a lock
    assert slept == [0.05] * 4                           # and each slept its delay
    assert len(pool.inner) == 4


def test_put_concurrency_check_sees_serialised_puts():
    """Negative control for the test above: puts serialised under one lock break the gate."""
    lock = threading.Lock()

    class Serialised(FaultyPool):
        def put(self, key, value):
            with lock:
                return super().put(key, value)

    pool = Serialised(HostPool(100), Faults(put_gate=_AllAtOnce(4, timeout_s=0.5)))
    assert _four_puts(pool)


def test_sleep_hooks(monkeypatch):
    slept = []
    monkeypatch.setattr(faults_mod.time, "sleep", lambda s: slept.append(s))
    f = Faults(save_delay_s=0.03, forward_delay_s=0.02, load_delay_s=0.01)
    f.save_sleep()
    f.forward_sleep()
    f.load_sleep()
    assert slept == [0.03, 0.02, 0.01]                   # once per call, its own delay
    Faults().save_sleep()
    Faults().forward_sleep()
    Faults().load_sleep()
    assert slept == [0.03, 0.02, 0.01]                   # no delay set: no sleep at all


def test_save_gate_holds_the_save_until_it_opens():
    gate = threading.Event()
    f = Faults(save_gate=gate)
    done = threading.Event()
    t = threading.Thread(target=lambda: (f.save_sleep(), done.set()))
    t.start()
    assert not done.wait(0.05)                           # held (a closed gate is never passed)
    gate.set()
    assert done.wait(10)
    t.join(10)
    assert f.active and not Faults().active
    with pytest.raises(ValueError, match="no text form"):
        f.format()
    with pytest.raises(ValueError, match="wait"):
        Faults(put_gate=object())


def test_file_gate_opens_on_the_file(tmp_path):
    g = FileGate(tmp_path / "open", timeout_s=0.05)
    with pytest.raises(TimeoutError):
        g.wait()
    g.open()
    g.wait()                                             # returns: the file exists
    assert pickle.loads(pickle.dumps(g)).path == g.path  # crosses to a rank process


def test_wrap_pool_only_when_needed():
    base = HostPool(10)
    assert wrap_pool(base, Faults(save_delay_s=1)) is base
    assert isinstance(wrap_pool(base, Faults(put_fail=0.1)), FaultyPool)
    assert isinstance(wrap_pool(base, Faults(put_delay_s=0.1)), FaultyPool)
    assert isinstance(wrap_pool(base, Faults(put_gate=threading.Event())), FaultyPool)
