"""The self-checking form of a pool value kept in a shared store: ``header + payload``.

A store shared by processes (Mooncake) can hand back a value written by another build, another
model, a writer that died, or bytes damaged on the way. The 56-byte header lets a reader reject
all of these instead of loading wrong KV: magic ``GGKV``, format version, header length, payload
length, a 16-byte layout fingerprint (the caller's layout text plus the key's ``model@layout@rank``
part), 8 bytes of SHA-256 of the key (a value stored under another key), the XXH3-64 hash of the
whole payload (`payload_checksum`), 4 reserved bytes (zero; they keep the payload 8-byte aligned)
and a CRC-32 of the header itself. Torch-free.

Format 2 replaced format 1's CRC-32 of the payload (48-byte header): ``zlib.crc32`` runs at
1.7–4 GB/s here, the same order as a loopback Mooncake transfer, so it cost the pool a third of its
bandwidth in each direction; XXH3-64 runs at ~9 GB/s. A format-1 value is rejected (``version``)
and recomputed.
"""
from __future__ import annotations

import hashlib
import struct
import zlib

import xxhash

from .keys import KEY_SEP

__all__ = ["HEADER", "MAGIC", "FORMAT_VERSION", "parse_size", "fingerprint_of", "payload_checksum",
           "copy_with_checksum",
           "encode_header", "write_header", "encode_value", "check_value", "decode_value"]

MAGIC = b"GGKV"
FORMAT_VERSION = 2
# magic, format version, header length, payload length, fingerprint, key digest, payload checksum,
# reserved (0), header crc (over everything before it)
HEADER = struct.Struct("<4sHHQ16s8sQII")
assert HEADER.size == 56 and HEADER.size % 8 == 0
_HCRC = struct.Struct("<I")


def parse_size(text: str | int) -> int:
    """``"64MiB"``, ``"1GB"``, ``"4096"`` -> bytes (binary units either way)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    s = str(text).strip().upper().replace(" ", "")
    for suffix, mult in (("GIB", 1 << 30), ("MIB", 1 << 20), ("KIB", 1 << 10), ("GB", 1 << 30),
                         ("MB", 1 << 20), ("KB", 1 << 10), ("G", 1 << 30), ("M", 1 << 20),
                         ("K", 1 << 10), ("B", 1)):
        if s.endswith(suffix):
            s, m = s[: -len(suffix)], mult
            break
    else:
        m = 1
    try:
        n = int(float(s) * m)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (e.g. 4096, 64MiB, 1GiB)") from None
    if n < 0:
        raise ValueError(f"size must be >= 0, got {text!r}")
    return n


# ------------------------------------------------------------------------------ payload checksum
# XXH3-64 (the xxhash package, a well-kept binding of the reference C code): a real 64-bit hash
# with full avalanche over every byte, ~9 GB/s here against ~1.7 GB/s for zlib.crc32 -- the CRC
# cost as much as the loopback transfer itself (BENCHMARKS.md, bench_pool).


def payload_checksum(payload) -> int:
    """XXH3-64 of the whole payload. Truncation and extension are caught first by the header's
    length; any other change to the payload changes the digest except with probability ~2**-64."""
    return xxhash.xxh3_64_intdigest(memoryview(payload).cast("B"))


_CHUNK = 256 << 10          # copy + hash chunk: the hash reads what was just copied, in L2


def copy_with_checksum(dst, src) -> int:
    """Copy ``src`` into ``dst`` (same length) and return ``payload_checksum(src)``, in chunks so
    the hash reads each chunk from cache right after copying it (one pass over DRAM)."""
    dst, src = memoryview(dst).cast("B"), memoryview(src).cast("B")
    if len(dst) != len(src):
        raise ValueError(f"copy of {len(src)} bytes into {len(dst)}")
    h = xxhash.xxh3_64()
    for start in range(0, len(src), _CHUNK):
        end = min(start + _CHUNK, len(src))
        dst[start:end] = src[start:end]
        h.update(dst[start:end])
    return h.intdigest()


# ------------------------------------------------------------------------------- value header

def fingerprint_of(key: str, layout: str = "") -> bytes:
    """16 bytes naming the cache layout a value belongs to: ``layout`` plus the key's
    ``model@layout@rank`` part (everything before the last ``@``)."""
    prefix = key.rsplit(KEY_SEP, 1)[0] if KEY_SEP in key else ""
    return hashlib.sha256(f"{layout}|{prefix}".encode()).digest()[:16]


def _key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()[:8]


def write_header(buf, offset: int, key: str, payload_len: int, checksum: int,
                 layout: str = "") -> None:
    """Pack the header of a value in place at ``buf[offset:offset + HEADER.size]`` (the payload
    follows it there; ``checksum`` is its `payload_checksum`)."""
    HEADER.pack_into(buf, offset, MAGIC, FORMAT_VERSION, HEADER.size, payload_len,
                     fingerprint_of(key, layout), _key_digest(key), checksum, 0, 0)
    end = offset + HEADER.size - 4
    _HCRC.pack_into(buf, end, zlib.crc32(memoryview(buf)[offset:end]))


def encode_header(key: str, payload, layout: str = "") -> bytes:
    head = bytearray(HEADER.size)
    write_header(head, 0, key, len(memoryview(payload).cast("B")), payload_checksum(payload),
                 layout)
    return bytes(head)


def encode_value(key: str, payload: bytes, layout: str = "") -> bytes:
    return encode_header(key, payload, layout) + bytes(payload)


def check_value(key: str, value, layout: str = "") -> str | None:
    """None when ``value`` (any bytes-like; read in place, not copied) is a complete, intact value
    of ``key`` in this layout, else the reason (``magic``, ``version``, ``truncated``,
    ``fingerprint``, ``key``, ``checksum``)."""
    value = memoryview(value).cast("B")
    if len(value) < 8:
        return "truncated"
    if bytes(value[:4]) != MAGIC:
        return "magic"
    version, hlen = struct.unpack_from("<HH", value, 4)
    if version != FORMAT_VERSION or hlen != HEADER.size:
        return "version"
    if len(value) < HEADER.size:
        return "truncated"
    magic, version, hlen, plen, fp, kd, csum, _reserved, hcrc = HEADER.unpack_from(value)
    if zlib.crc32(value[:HEADER.size - 4]) != hcrc:
        return "checksum"
    if len(value) != HEADER.size + plen:
        return "truncated"
    if fp != fingerprint_of(key, layout):
        return "fingerprint"
    if kd != _key_digest(key):
        return "key"
    if payload_checksum(value[HEADER.size:]) != csum:
        return "checksum"
    return None


def decode_value(key: str, value, layout: str = "") -> bytes:
    """The payload of a value; ValueError naming the reason when it is rejected."""
    reason = check_value(key, value, layout)
    if reason is not None:
        raise ValueError(f"pool value of {key!r} rejected: {reason}")
    return bytes(memoryview(value).cast("B")[HEADER.size:])
