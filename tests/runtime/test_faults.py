"""Fault injection: parsing, deterministic put failures, FaultyPool visibility."""
import threading
import time

import pytest

from graphgen.runtime.core.faults import Faults
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


def test_put_delay_applies_and_is_concurrent():
    pool = FaultyPool(HostPool(100), Faults(put_delay_s=0.05))
    t0 = time.monotonic()
    ts = [threading.Thread(target=pool.put, args=(f"k{i}", b"v")) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(5)
    dt = time.monotonic() - t0
    assert 0.045 <= dt < 0.2                             # slept, but not serialised under a lock
    assert len(pool.inner) == 4


def test_sleep_hooks():
    f = Faults(save_delay_s=0.03, forward_delay_s=0.02)
    t0 = time.monotonic()
    f.save_sleep()
    t1 = time.monotonic()
    f.forward_sleep()
    t2 = time.monotonic()
    assert t1 - t0 >= 0.025 and t2 - t1 >= 0.015
    t3 = time.monotonic()
    Faults().save_sleep()
    Faults().forward_sleep()
    assert time.monotonic() - t3 < 0.01


def test_wrap_pool_only_when_needed():
    base = HostPool(10)
    assert wrap_pool(base, Faults(save_delay_s=1)) is base
    assert isinstance(wrap_pool(base, Faults(put_fail=0.1)), FaultyPool)
    assert isinstance(wrap_pool(base, Faults(put_delay_s=0.1)), FaultyPool)
