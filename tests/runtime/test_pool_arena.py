"""HostPool's arena: values of the block size in slots, a run of them lent as one buffer (a pool
hit's load staging read in place), and the rule that makes that safe: a lent or read slot is
neither evicted nor overwritten while anything made from the lent buffer is alive."""
from __future__ import annotations

import numpy
import pytest
import torch

from graphgen.runtime.pool import HostPool, PoolBackend

SIZE = 64


def value(i: int) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(SIZE))


def pool_of(slots: int, n: int = 0) -> HostPool:
    p = HostPool(slots * SIZE)
    for i in range(n):
        assert p.put(f"k{i}", value(i))
    return p


def test_values_put_in_order_are_lent_as_one_buffer():
    p = pool_of(8, 5)
    n, buf = p.lend([f"k{i}" for i in range(5)])
    assert n == 5 and bytes(memoryview(buf)) == b"".join(value(i) for i in range(5))
    assert p.stats()["get_hits"] == 5 and p.stats()["lends"] == 1   # each lent value is a get
    assert p.keys()[-5:] == [f"k{i}" for i in range(5)]              # and refreshes its recency
    n, buf = p.lend(["k1", "k2", "absent", "k3"])                    # the leading present run
    assert n == 2 and bytes(memoryview(buf)) == value(1) + value(2)
    assert p.lend(["absent", "k0"]) is None and p.lend([]) is None
    assert p.put("odd", b"x" * (SIZE + 1)) and p.lend(["odd"]) is None   # another size: bytes, not lent
    assert p.get("odd") == b"x" * (SIZE + 1) and p.get("k3") == value(3)
    assert PoolBackend.lend(p, ["k0"]) is None                       # the contract's default lends nothing


def test_a_run_breaks_where_eviction_left_scattered_slots():
    p = pool_of(4, 4)
    p.get("k0"), p.get("k2")                   # LRU now k1, k3, k0, k2: the next two puts take k1's, k3's slots
    assert p.put("a", value(10)) and p.put("b", value(11))
    assert p.keys() == ["k0", "k2", "a", "b"]
    n, buf = p.lend(["a", "b"])
    assert n == 1 and bytes(memoryview(buf)) == value(10)   # b's slot is not after a's: lent apart
    assert p.get("b") == value(11)


@pytest.mark.parametrize("made_from", ["memoryview slice", "numpy", "torch view"])
def test_a_lent_value_is_neither_evicted_nor_overwritten_while_anything_reads_it(made_from):
    def run(book_lends: bool):
        p = pool_of(3, 3)
        if not book_lends:   # the negative control: lends not booked (eviction sees no reader)
            p._arena.busy = lambda: set()
        n, buf = p.lend(["k0", "k1"])
        reader = {"memoryview slice": lambda: memoryview(buf)[SIZE:],
                  "numpy": lambda: numpy.frombuffer(buf, dtype=numpy.uint8)[SIZE:],
                  "torch view": lambda: torch.frombuffer(buf, dtype=torch.uint8)[SIZE:]}[made_from]()
        del buf                                 # only what was made from the lent buffer reads it now
        # three puts, each evicting the least recent value it may: with k0, k1 lent, k2 then c then d
        assert p.put("c", value(20)) and p.put("d", value(21)) and p.put("e", value(22))
        kept = [k for k in ("k0", "k1", "k2", "c", "d", "e") if p.get(k) is not None]
        return p, bytes(memoryview(reader) if made_from != "torch view" else reader.numpy()), kept, reader

    p, read, kept, reader = run(book_lends=True)
    assert read == value(1) and kept == ["k0", "k1", "e"]
    del reader                                  # nothing reads the run now: its slots can go
    assert p.put("g", value(24)) and p.put("h", value(25)) and p.get("k0") is None
    assert p.stats()["live_lends"] == 0

    _, read, kept, _ = run(book_lends=False)
    assert read == value(22) and kept == ["c", "d", "e"]   # the control: e was written over k1 under the reader


def test_bookings_of_lends_nobody_reads_are_dropped_without_eviction():
    # a server whose pool never fills still lends on every hit: the bookings must not pile up
    p = pool_of(8, 4)
    for _ in range(50):
        n, buf = p.lend(["k0", "k1"])
        del buf
    kept = p.lend(["k2", "k3"])
    assert len(p._arena._lent) <= 2 and p.stats()["live_lends"] == 1 and kept[0] == 2


def test_values_are_refused_when_only_lent_ones_could_make_room():
    p = pool_of(2, 2)
    n, buf = p.lend(["k0", "k1"])
    assert n == 2 and p.put("c", value(9)) is False and p.stats()["put_refused"] == 1
    del buf
    assert p.put("c", value(9)) and p.get("c") == value(9)


def test_get_into_holds_a_slot_until_its_handover_is_over():
    # a destination may run while the commit thread puts (here: it puts itself, evicting): the
    # value it is handed must not be overwritten under it
    def run(hold: bool):
        p = pool_of(2, 2)
        if not hold:   # the negative control
            p._arena.hold = p._arena.unhold = lambda slots: None
        seen = []

        def dest(mv):
            assert p.put("c", value(30)) and p.put("d", value(31))   # k1, then c evicted (k0 is held)
            seen.append(bytes(mv))
        assert p.get_into(["k0"], [dest]) == [True]
        return seen[0], p

    got, p = run(hold=True)
    assert got == value(0) and p.get("k0") == value(0) and p.get("c") is None
    got, _ = run(hold=False)
    assert got != value(0)


def test_slots_are_reused_and_the_map_never_outgrows_the_capacity():
    p = pool_of(4)
    for i in range(40):
        assert p.put(f"v{i}", value(i))
    s = p.stats()
    assert s["slots_mapped"] == 4 and s["arena_bytes"] == 4 * SIZE and s["evictions"] == 36
    assert [p.get(f"v{i}") for i in range(36, 40)] == [value(i) for i in range(36, 40)]
    n, _ = p.lend([f"v{i}" for i in range(36, 40)])
    assert n == 4   # evicted oldest-first, refilled in order: the newest run is back to back again
