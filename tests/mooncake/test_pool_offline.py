"""MooncakePool parts that need no master: pool URLs, options, the value codec, and a master that
is not there (the pool must not raise, must fail fast after the first probe, and log once)."""
from __future__ import annotations

import logging
import os
import time

import pytest

from graphgen.runtime.pool.mooncake_server import find_master_binary
from graphgen.runtime.pool import HostPool
from graphgen.runtime.pool.codec import (HEADER, check_value, decode_value, encode_value, parse_size,
                                         copy_with_checksum, payload_checksum)
from graphgen.runtime.pool import make_pool
from graphgen.runtime.pool.mooncake import MooncakeOptions, MooncakePool


def test_make_pool_urls():
    assert isinstance(make_pool("host", capacity_bytes=1024), HostPool)
    with pytest.raises(ValueError, match="expected 'host'.*mooncake://HOST:PORT"):
        make_pool("redis://127.0.0.1:6379")
    with pytest.raises(ValueError, match="bad pool URL"):
        make_pool("mooncake://127.0.0.1")
    with pytest.raises(ValueError, match="unknown mooncake pool option 'segmnt'"):
        make_pool("mooncake://127.0.0.1:1?segmnt=1GiB")
    with pytest.raises(ValueError, match=">= 16 MiB"):
        make_pool("mooncake://127.0.0.1:1?segment=1MiB")
    o = MooncakeOptions.from_query("segment=64MiB&buffer=2MiB&protocol=tcp&max_backoff=2")
    assert (o.segment_bytes, o.buffer_bytes, o.max_backoff_s) == (64 << 20, 2 << 20, 2.0)
    assert parse_size("1GiB") == parse_size("1GB") == 1 << 30 and parse_size("4096") == 4096
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")


def test_codec_accepts_only_the_exact_value_of_its_key():
    key = "m@kv1:float32@r0of1@" + "ab" * 32
    payload = os.urandom(1000)
    value = encode_value(key, payload)
    assert len(value) == HEADER.size + len(payload) and decode_value(key, value) == payload
    assert check_value(key.replace("ab", "cd", 1), value) == "key"
    assert check_value(key, value, layout="bf16") == "fingerprint"
    assert check_value(key, value[:-1]) == "truncated"
    assert check_value(key, value[:20]) == "truncated"
    assert check_value(key, b"x" * 100) == "magic"
    for pos in (HEADER.size, len(value) - 1, 10, 30):      # payload and header bit flips
        bad = bytearray(value)
        bad[pos] ^= 0x40
        assert check_value(key, bytes(bad)) is not None, pos


def test_payload_checksum_covers_every_byte_and_position():
    """Every byte of the payload (the low and the top bit of each) and word order count, and the
    chunked copy hashes exactly like the one-shot hash."""
    payload = bytearray(os.urandom(8 * 37 + 5))
    base = payload_checksum(payload)
    assert base == payload_checksum(bytes(payload)) == payload_checksum(memoryview(payload))
    for pos in range(len(payload)):
        for bit in (0, 7):                                  # low and top bit of every byte
            payload[pos] ^= 1 << bit
            assert payload_checksum(payload) != base, (pos, bit)
            payload[pos] ^= 1 << bit
    swapped = payload[8:16] + payload[:8] + payload[16:]    # two words exchanged
    assert payload[:8] != payload[8:16] and payload_checksum(swapped) != base
    assert payload_checksum(payload[:-1]) != base           # the tail counts
    assert payload_checksum(b"") == payload_checksum(bytearray())
    big = os.urandom((1 << 20) + 13)                        # several copy chunks and a tail
    dst = bytearray(len(big))
    assert copy_with_checksum(dst, big) == payload_checksum(big) and dst == big


def test_codec_rejects_format_1_values():
    """A value of the previous format (48-byte header, CRC-32 of the payload) is not read as this
    one: its version field says 1."""
    key = "m@kv1:float32@r0of1@" + "ab" * 32
    value = bytearray(encode_value(key, os.urandom(256)))
    value[4:6] = (1).to_bytes(2, "little")
    value[6:8] = (48).to_bytes(2, "little")
    assert check_value(key, bytes(value)) == "version"


def test_default_get_into_copies_or_hands_over():
    pool = HostPool(1 << 20)
    assert pool.put("a", b"x" * 16) and pool.put("b", b"y" * 8)
    dests = [bytearray(16), bytearray(16), bytearray(16)]
    assert pool.get_into(["a", "b", "gone"], dests) == [True, False, False]   # b: wrong size
    assert bytes(dests[0]) == b"x" * 16 and bytes(dests[1]) == bytes(16)
    seen = []
    assert pool.get_into(["b", "a"], [lambda mv: seen.append(bytes(mv)), lambda mv: False]) \
        == [True, False]
    assert seen == [b"y" * 8]
    assert pool.get_into(["a"], [lambda mv: 1 / 0]) == [False]
    with pytest.raises(ValueError, match="destinations"):
        pool.get_into(["a"], [])


def test_absent_master_costs_misses_not_errors_raised(caplog):
    caplog.set_level(logging.WARNING, logger="graphgen.runtime.pool.mooncake")
    t = time.monotonic()
    pool = make_pool("mooncake://127.0.0.1:1?max_backoff=1")   # nothing listens on port 1
    assert pool.put("k", b"v") is False
    assert pool.get("k") is None
    assert pool.leading_run(["k", "l"]) == 0 and not pool.contains("k")
    assert pool.put_many([("a", b"1"), ("b", b"2")]) == [False, False]
    assert time.monotonic() - t < 5
    s = pool.stats()
    assert s["down"] and s["down_events"] == 1 and s["setups"] == 0
    assert s["put_failures"] == 3 and s["get_failures"] == 1 and s["lookup_failures"] == 2
    warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warnings) == 1                                   # logged once, not per block


def test_value_larger_than_the_buffer_is_refused():
    pool = MooncakePool("127.0.0.1:1", MooncakeOptions(buffer_bytes=1024))
    assert pool.put("k", b"x" * 2000) is False
    assert pool.stats()["too_large"] == 1


def test_master_binary_ships_with_the_wheel():
    path = find_master_binary()
    assert os.access(path, os.X_OK), path


def test_the_rank_launcher_takes_a_mooncake_url_and_refuses_a_pool_object():
    """Ranks on Mooncake (issue 37 item 2): a URL passes the launcher's check (each rank opens its own
    client), a malformed one is one sentence before any rank starts, a pool object cannot cross into a rank."""
    from graphgen.modelspec.loader import load_spec
    from graphgen.runtime.parallel.launcher import _checked
    from support.paths import REPO

    spec = load_spec(os.path.join(str(REPO), "specs", "tiny_deepseek_v3_tp2ep2.yaml"))
    assert _checked(spec, "/w", "mooncake://127.0.0.1:50051?max_backoff=1", "cpu") == ("cpu", "/w")
    assert _checked(spec, "/w", "host", "cpu") == ("cpu", "/w")
    with pytest.raises(ValueError, match="bad pool URL"):
        _checked(spec, "/w", "mooncake://127.0.0.1", "cpu")
    with pytest.raises(ValueError, match="unknown mooncake pool option 'segmnet'"):
        _checked(spec, "/w", "mooncake://127.0.0.1:50051?segmnet=1", "cpu")
    with pytest.raises(ValueError, match="parallel ranks take pool='host'"):
        _checked(spec, "/w", HostPool(1 << 20), "cpu")
