"""The self-checking form of a pool value kept in a shared store: ``header + payload``.

A store shared by processes (Mooncake) can hand back a value written by another build, another
model, a writer that died, or bytes damaged on the way. The 48-byte header lets a reader reject
all of these instead of loading wrong KV: magic ``GGKV``, format version, header length, payload
length, a 16-byte layout fingerprint (the caller's layout text plus the key's ``model@layout@rank``
part), 8 bytes of SHA-256 of the key (a value stored under another key), a CRC-32 of the payload,
and a CRC-32 of the header itself. Torch-free.
"""
from __future__ import annotations

import hashlib
import struct
import zlib

from .pool import KEY_SEP

__all__ = ["HEADER", "MAGIC", "FORMAT_VERSION", "parse_size", "fingerprint_of", "encode_header",
           "encode_value", "check_value", "decode_value"]

MAGIC = b"GGKV"
FORMAT_VERSION = 1
# magic, format version, header length, payload length, fingerprint, key digest, payload crc,
# header crc (over everything before it)
HEADER = struct.Struct("<4sHHQ16s8sII")
assert HEADER.size == 48


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


# ------------------------------------------------------------------------------- value header

def fingerprint_of(key: str, layout: str = "") -> bytes:
    """16 bytes naming the cache layout a value belongs to: ``layout`` plus the key's
    ``model@layout@rank`` part (everything before the last ``@``)."""
    prefix = key.rsplit(KEY_SEP, 1)[0] if KEY_SEP in key else ""
    return hashlib.sha256(f"{layout}|{prefix}".encode()).digest()[:16]


def _key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()[:8]


def encode_header(key: str, payload: bytes | memoryview, layout: str = "") -> bytes:
    head = HEADER.pack(MAGIC, FORMAT_VERSION, HEADER.size, len(payload),
                       fingerprint_of(key, layout), _key_digest(key), zlib.crc32(payload), 0)
    return head[:-4] + struct.pack("<I", zlib.crc32(head[:-4]))


def encode_value(key: str, payload: bytes, layout: str = "") -> bytes:
    return encode_header(key, payload, layout) + payload


def check_value(key: str, value: bytes | memoryview, layout: str = "") -> str | None:
    """None when ``value`` is a complete, intact value of ``key`` in this layout, else the reason
    (``magic``, ``version``, ``truncated``, ``fingerprint``, ``key``, ``checksum``)."""
    if len(value) < HEADER.size:
        return "truncated"
    magic, version, hlen, plen, fp, kd, crc, hcrc = HEADER.unpack_from(value)
    if magic != MAGIC:
        return "magic"
    if zlib.crc32(bytes(value[:HEADER.size - 4])) != hcrc:
        return "checksum"
    if version != FORMAT_VERSION or hlen != HEADER.size:
        return "version"
    if len(value) != HEADER.size + plen:
        return "truncated"
    if fp != fingerprint_of(key, layout):
        return "fingerprint"
    if kd != _key_digest(key):
        return "key"
    if zlib.crc32(value[HEADER.size:]) != crc:
        return "checksum"
    return None


def decode_value(key: str, value: bytes | memoryview, layout: str = "") -> bytes:
    """The payload of a value; ValueError naming the reason when it is rejected."""
    reason = check_value(key, value, layout)
    if reason is not None:
        raise ValueError(f"pool value of {key!r} rejected: {reason}")
    return bytes(value[HEADER.size:])
