"""Pool block keys: one structured type, rendered to a string in one function.

A key names the KV of one full block *and everything before it* (a hash chain over the token ids),
for one model, one cache layout and one KV shard:

    {model}@{layout}@{shard}@{chain}[@ad{adapter}][@la{lookahead}]

* ``model``: the spec's name; ``layout``: the cache layout fingerprint (dtype, component shapes,
  version: `graphgen.runtime.core.kvcache.layout_version`), so a cache of another shape never
  reads a foreign value;
* ``shard``: which part of the layer's KV this block holds (`KVShard`: ``r{index}of{count}``, ``index``
  the lowest of the ``count`` ranks holding that same KV: `graphgen.families.parallel.kv_shard_owner`).
  Ranks holding the same KV share its keys: the MLA latent is ``r0of{count}`` on every rank, KV heads
  replicated because tp exceeds them ``r0of4`` on ranks 0,1 and ``r2of4`` on ranks 2,3 (2 KV heads, tp=4);
* ``chain``: sha256 over the parent's digest and this block's token ids (little-endian int64),
  from a versioned root, so two prompts share key i only if they agree on blocks 0..i; stable across
  processes and ``PYTHONHASHSEED`` (never Python ``hash()``);
* ``adapter``: the LoRA adapter the KV was computed under (a content digest of its weights:
  `graphgen.runtime.lora.peft.Adapter.digest`), rendered ``ad<first 16 hex>``; the chain itself is seeded
  with it too (tagged and length-framed), so a block computed under one adapter is never a hit for another
  or for the base model, and the same adapter file on two servers gives the same keys (docs/lora.md);
* ``lookahead``: the token after the block, for a KV that depends on it (an MTP draft layer's KV at
  position i reads token i+1: `mtp_block_keys`, the keys of an engine that decodes speculatively);
  absent otherwise.

Later features add fields here (a KV-head shard, a context-parallel shard, a P/D handoff lease), never a
second format: `BlockKey.render` is the only place a key string is made.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

__all__ = ["KEY_SEP", "BlockKey", "KVShard", "block_keys", "chain_digests", "mtp_block_keys", "successor_keys"]

KEY_SEP = "@"
# root of every hash chain; versioned so a change of the hashing scheme never matches old keys
_CHAIN_ROOT = hashlib.sha256(b"graphgen.block_keys.v1").digest()


@dataclass(frozen=True)
class KVShard:
    """The KV shard held by rank ``index`` of ``count`` (and by every rank whose shard owner it is:
    `graphgen.families.parallel.kv_shard_owner`); ``KVShard()``: the whole KV, one rank."""

    index: int = 0
    count: int = 1

    def __post_init__(self):
        if not (isinstance(self.index, int) and isinstance(self.count, int) and self.count >= 1
                and 0 <= self.index < self.count):
            raise ValueError(f"need 0 <= rank < world, got rank={self.index!r} world={self.count!r}")

    def render(self) -> str:
        return f"r{self.index}of{self.count}"


@dataclass(frozen=True)
class BlockKey:
    model: str
    layout: str
    shard: KVShard
    chain: str  # hex digest of the block's hash chain
    lookahead: Optional[int] = None  # the token after the block, for a KV that depends on it
    adapter: str = ""  # the LoRA adapter's digest ("" : the base model)

    def __post_init__(self):
        for what, s in (("model", self.model), ("layout", self.layout)):
            if not isinstance(s, str) or not s or KEY_SEP in s:
                raise ValueError(f"{what} must be a non-empty str without {KEY_SEP!r}, got {s!r}")

    def render(self) -> str:
        """The pool key string (the one function that makes one)."""
        key = KEY_SEP.join((self.model, self.layout, self.shard.render(), self.chain))
        if self.adapter:
            key = f"{key}{KEY_SEP}ad{self.adapter[:16]}"
        return key if self.lookahead is None else f"{key}{KEY_SEP}la{int(self.lookahead)}"


def _root(salt: str) -> bytes:
    """The chain's root: the versioned root, or for KV computed under a LoRA adapter that root hashed with
    the tagged, length-framed adapter digest (never a raw concatenation another field could collide with)."""
    if not salt:
        return _CHAIN_ROOT
    tagged = b"lora\0" + len(salt).to_bytes(4, "little") + salt.encode("ascii")
    return hashlib.sha256(_CHAIN_ROOT + tagged).digest()


def chain_digests(token_ids: Iterable[int], block_size: int, salt: str = "") -> list[str]:
    """The hash chain's hex digest of every FULL block of ``token_ids`` (a trailing partial block has none);
    ``salt``: the LoRA adapter's digest the KV is computed under ("" : the base model)."""
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise ValueError(f"block_size must be an int > 0, got {block_size!r}")
    if hasattr(token_ids, "tolist"):          # torch / numpy without importing either
        token_ids = token_ids.tolist()
    ids = [int(t) for t in token_ids]
    pack = struct.Struct(f"<{block_size}q").pack   # raises struct.error outside int64
    out, parent = [], _root(salt)
    for b in range(len(ids) // block_size):
        parent = hashlib.sha256(parent + pack(*ids[b * block_size:(b + 1) * block_size])).digest()
        out.append(parent.hex())
    return out


def block_keys(token_ids: Iterable[int], block_size: int, *, model: str, layout: str,
               shard: KVShard = KVShard(), salt: str = "") -> list[str]:
    """One rendered pool key per FULL block of ``token_ids``. Which blocks to save or look up (e.g.
    at most ``(len - 1) // block_size``, so the last token is always recomputed) is the caller's
    choice: slice the result."""
    BlockKey(model, layout, shard, "0")  # validate model/layout once, even for a prompt without a full block
    return [BlockKey(model, layout, shard, d, adapter=salt).render() for d in chain_digests(token_ids, block_size, salt)]


def mtp_block_keys(tokens: Sequence[int], num_blocks: int, block_size: int, *, model: str, layout: str,
                   shard: KVShard = KVShard(), salt: str = "") -> list[str]:
    """Pool keys of the first ``num_blocks`` full blocks of ``tokens`` for a cache with MTP layers:
    the hash chain plus the block's successor token (``BlockKey.lookahead``), which the MTP layer's KV
    at the block's last position depends on. Every such successor must be in ``tokens``."""
    if num_blocks * block_size >= len(tokens) and num_blocks:
        raise ValueError(f"block {num_blocks - 1}'s successor (position {num_blocks * block_size}) is not among "
                         f"the {len(tokens)} tokens")
    chain = chain_digests(tokens, block_size, salt)[:num_blocks]
    return [BlockKey(model, layout, shard, d, lookahead=int(tokens[(b + 1) * block_size]), adapter=salt).render()
            for b, d in enumerate(chain)]


def successor_keys(naming, seq: Sequence[int], num_blocks: int, salt: str = "") -> list[str]:
    """`mtp_block_keys` of ``seq``'s first ``num_blocks`` blocks named as ``naming`` names them (its
    ``model``, ``shard`` and ``cache.block_size``/``cache.layout``: the engine's `KVLoader`): what a
    speculative engine looks up and saves (the scheduler and the drafter both)."""
    return mtp_block_keys(seq, num_blocks, naming.cache.block_size, model=naming.model,
                          layout=naming.cache.layout, shard=naming.shard, salt=salt)
