"""Pool leases (the P/D handoff's pin): a leased key is never evicted, released or expired leases
stop protecting, and the wrappers (FaultyPool) pass them through. The Mooncake lease (renewal of
the master's read lease) runs in tests/serve/test_pd.py against a real master."""
import time

import pytest

from graphgen.runtime.core.faults import Faults
from graphgen.runtime.pool import HostPool
from graphgen.runtime.pool.base import LeaseBook, LeaseKeeper
from graphgen.runtime.pool.faulty import FaultyPool

V = b"x" * 10


def test_eviction_skips_leased_keys_and_refuses_when_only_leased_remain():
    p = HostPool(30)
    lease = p.pin(["a", "b"], 30)  # before their puts, as P does before its prefill
    for k in "abc":
        assert p.put(k, V)
    assert p.put("d", V) and p.keys() == ["a", "b", "d"]  # c (unleased) went, not a
    p.get("a")
    assert p.put("e", V) and p.keys() == ["b", "a", "e"]  # d, though a was used after it
    full = HostPool(20)
    full.pin(["a", "b"], 30)
    assert full.put("a", V) and full.put("b", V)
    assert not full.put("c", V) and full.keys() == ["a", "b"]  # nothing evictable: refused
    assert full.stats()["put_refused"] == 1 and full.stats()["leases"] == 1
    assert p.release(lease.lease_id) and not p.release(lease.lease_id)  # once only
    assert p.leases() == 0
    assert p.put("f", V) and "b" not in p.keys()  # unprotected again: LRU as before


def test_negative_control_without_a_lease_the_same_puts_evict():
    p = HostPool(30)
    for k in "abcd":
        assert p.put(k, V)
    assert "a" not in p.keys()


def test_a_lease_expires_at_its_timeout_and_overlapping_leases_count_per_key():
    now = [1000.0]
    book = LeaseBook(clock=lambda: now[0])
    one, two = book.pin(["a", "b"], 5), book.pin(["b"], 10)
    assert one.expires_ms == 1_005_000 and book.held() == {"a", "b"}
    now[0] += 6
    assert book.held() == {"b"} and book.stats()["expired"] == 1
    assert not book.release(one.lease_id)  # expired: not releasable
    assert book.release(two.lease_id) and book.held() == set()
    with pytest.raises(ValueError):
        book.pin(["a"], 0)


def test_faulty_pool_passes_leases_to_its_backend():
    inner = HostPool(20)
    p = FaultyPool(inner, Faults(put_delay_s=0.0))
    lease = p.pin(["a"], 30)
    assert inner.leases() == 1 and p.leases() == 1
    assert p.release(lease.lease_id) and inner.leases() == 0


def test_keeper_renews_the_leased_keys_until_released():
    book, seen = LeaseBook(), []
    keeper = LeaseKeeper(book, seen.append, 0.02)
    lease = keeper.pin(["k1", "k2"], 30)
    assert seen == [["k1", "k2"]]  # at once
    time.sleep(0.1)
    assert len(seen) >= 3 and all(s == ["k1", "k2"] for s in seen)
    book.release(lease.lease_id)
    time.sleep(0.05)
    n = len(seen)
    time.sleep(0.1)
    keeper.stop()
    assert len(seen) == n  # nothing leased: nothing renewed
