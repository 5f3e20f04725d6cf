"""The self-checking form of a pool value kept in a shared store: ``header + payload``.

A store shared by processes (Mooncake) can hand back a value written by another build, another
model, a writer that died, or bytes damaged on the way. The 56-byte header lets a reader reject
all of these instead of loading wrong KV: magic ``GGKV``, format version, header length, payload
length, a 16-byte layout fingerprint (the caller's layout text plus the key's ``model@layout@rank``
part), 8 bytes of SHA-256 of the key (a value stored under another key), a 64-bit checksum of the
whole payload (`payload_checksum`), 4 reserved bytes (zero; they keep the payload 8-byte aligned)
and a CRC-32 of the header itself. Torch-free.

Format 2 replaced format 1's CRC-32 of the payload (48-byte header): ``zlib.crc32`` runs at
2.5–4 GB/s here, the same order as a loopback Mooncake transfer, so it cost the pool a third of its
bandwidth in each direction; `payload_checksum` runs at ~11–13 GB/s. A format-1 value is rejected
(``version``) and recomputed.
"""
from __future__ import annotations

import hashlib
import struct
import threading
import zlib

import numpy as np

from .pool import KEY_SEP

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

_weights = np.zeros(0, dtype=np.uint64)
_weights_lock = threading.Lock()


def _weights_for(nwords: int) -> np.ndarray:
    """Odd 64-bit weights ``splitmix64(i) | 1`` for word positions ``0..nwords-1`` (grown by
    doubling, shared read-only; at most the largest value's size in words)."""
    global _weights
    w = _weights
    if len(w) >= nwords:
        return w[:nwords]
    with _weights_lock:
        if len(_weights) < nwords:
            n = max(nwords, 2 * len(_weights), 1024)
            with np.errstate(over="ignore"):
                z = np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
                z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
                z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
                z = z ^ (z >> np.uint64(31))
            z |= np.uint64(1)
            z.setflags(write=False)
            _weights = z
        return _weights[:nwords]


def payload_checksum(payload) -> int:
    """64-bit checksum of a whole payload: ``sum(word[i] * weight[i]) mod 2**64`` over its
    little-endian 64-bit words (the last one zero-padded), ``weight[i]`` odd and pseudo-random
    (splitmix64 of i). One ``numpy.dot`` pass, ~4x cheaper than ``zlib.crc32`` here.

    What it detects: any change confined to one 8-byte word (an odd weight is invertible mod
    2**64), words swapped or shifted (positional weights), and random damage except with
    probability ~2**-64. Its blind spot, unlike a CRC: changes whose deltas are all multiples of
    2**k cancel with probability ~2**-(64-k) — e.g. the top bit of an even number of words flipped
    together always cancels. Truncation and extension are caught by the header's length first."""
    mv = memoryview(payload).cast("B")
    n = len(mv)
    full = n // 8
    acc = 0
    if full:
        words = np.frombuffer(mv, dtype="<u8", count=full)
        acc = int(np.dot(words, _weights_for(full + 1)[:full]))
    if n % 8:
        tail = int.from_bytes(bytes(mv[full * 8:]), "little")
        acc += tail * int(_weights_for(full + 1)[full])
    return acc & 0xFFFFFFFFFFFFFFFF


_CHUNK = 256 << 10          # copy + checksum chunk: the checksum reads what was just copied, in L2


def copy_with_checksum(dst, src) -> int:
    """Copy ``src`` into ``dst`` (same length) and return ``payload_checksum(src)``, in chunks so
    the checksum reads each chunk from cache right after copying it (one pass over DRAM)."""
    dst, src = memoryview(dst).cast("B"), memoryview(src).cast("B")
    if len(dst) != len(src):
        raise ValueError(f"copy of {len(src)} bytes into {len(dst)}")
    n = len(src)
    full = n // 8
    weights = _weights_for(full + 1)
    acc = 0
    for start in range(0, full * 8, _CHUNK):
        end = min(start + _CHUNK, full * 8)
        dst[start:end] = src[start:end]
        acc += int(np.dot(np.frombuffer(dst[start:end], dtype="<u8"),
                          weights[start // 8:end // 8]))
    if n % 8:
        dst[full * 8:] = src[full * 8:]
        acc += int.from_bytes(bytes(src[full * 8:]), "little") * int(weights[full])
    return acc & 0xFFFFFFFFFFFFFFFF


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
