"""A pool client process driven by JSON lines on stdin (tests only; replies are ``@@{json}`` lines on
stdout, anything else there is Mooncake's own output). Values are derived from (seed, key), so
large values never cross the pipe: a reply carries their SHA-256."""
from __future__ import annotations

import base64
import hashlib
import random
import time

from graphgen.runtime.pool.mooncake import MooncakeOptions, MooncakePool
from support.jsonl import commands, reply


def value_of(seed: int, key: str, size: int) -> bytes:
    rnd = random.Random(int.from_bytes(hashlib.sha256(f"{seed}|{key}".encode()).digest()[:8], "little"))
    return rnd.randbytes(size)


def sha(b):
    return None if b is None else hashlib.sha256(b).hexdigest()


def kv_cache(blocks: int, seed: int):
    import torch
    from graphgen.runtime.core.kvcache import PagedKVCache
    cache = PagedKVCache(2, {"k": (16, 2, 16), "v": (16, 2, 16)}, blocks, torch.float32)
    g = torch.Generator().manual_seed(seed)
    for layer in cache:
        for t in layer:
            t.copy_(torch.randn(t.shape, generator=g))
    return cache


def main():
    pool = None
    for op, cmd in commands():
        t0 = time.monotonic()
        if op == "open":
            pool = MooncakePool(cmd["master"], MooncakeOptions(**cmd.get("opts", {})))
            reply(ok=True)
        elif op == "put":
            vals = [value_of(cmd["seed"], k, cmd["size"]) for k in cmd["keys"]]
            if cmd.get("many"):
                ok = pool.put_many(list(zip(cmd["keys"], vals)))
            else:
                ok = []
                for k, v in zip(cmd["keys"], vals):
                    ok.append(pool.put(k, v))
                    if cmd.get("progress"):
                        reply(progress=len(ok))
            reply(ok=ok, sha=[sha(v) for v in vals], dt=time.monotonic() - t0)
        elif op == "put_kv":
            from graphgen.runtime.core.kvcache import pack_block
            cache = kv_cache(len(cmd["keys"]), cmd["seed"])
            vals = [pack_block(cache, i) for i in range(len(cmd["keys"]))]
            reply(ok=[pool.put(k, v) for k, v in zip(cmd["keys"], vals)], sha=[sha(v) for v in vals])
        elif op == "get_kv":
            import torch
            from graphgen.runtime.core.kvcache import pack_block, unpack_block_into
            cache = kv_cache(len(cmd["keys"]), 0)
            for layer in cache:
                for t in layer:
                    t.zero_()
            if cmd.get("into"):     # unpacked straight from the registered buffer, no bytes
                def unpack_to(i):
                    return lambda payload: unpack_block_into(cache, i, payload)
                ok = pool.get_into(cmd["keys"], [unpack_to(i) for i in range(len(cmd["keys"]))])
                reply(sha=[sha(pack_block(cache, i)) if o else None for i, o in enumerate(ok)])
                continue
            vals = pool.get_many(cmd["keys"])
            out = []
            for i, v in enumerate(vals):
                if v is None:
                    out.append(None)
                else:
                    unpack_block_into(cache, i, v)
                    out.append(sha(pack_block(cache, i)))
            reply(sha=out)
        elif op == "get":
            vals = pool.get_many(cmd["keys"]) if cmd.get("many") else [pool.get(k) for k in cmd["keys"]]
            reply(sha=[sha(v) for v in vals], dt=time.monotonic() - t0)
        elif op == "get_into":     # into caller-owned buffers of cmd["size"] bytes
            dests = [bytearray(cmd["size"]) for _ in cmd["keys"]]
            ok = pool.get_into(cmd["keys"], dests)
            reply(ok=ok, sha=[sha(bytes(d)) if o else None for d, o in zip(dests, ok)])
        elif op == "fill":
            # fill the segment: per size (largest first), put batches until the store refuses one;
            # every stored value is read back at once (a read takes a lease, which blocks eviction)
            stored, failed, n = 0, 0, 0
            for size in cmd["sizes"]:
                for _ in range(200):
                    ks = [f"fill@{n + j}" for j in range(16)]
                    n += 16
                    ok = pool.put_many([(k, value_of(0, k, size)) for k in ks])
                    pool.get_many([k for k, o in zip(ks, ok) if o])
                    stored += ok.count(True)
                    if not all(ok):
                        failed += ok.count(False)
                        break
            reply(stored=stored, failed=failed, stats=pool.stats())
        elif op == "leading_run":
            reply(n=pool.leading_run(cmd["keys"]), dt=time.monotonic() - t0)
        elif op == "raw_put":
            # bypasses the header: what a foreign writer, a bug or a damaged transfer could leave
            rc = pool._store.put(cmd["key"], base64.b64decode(cmd["b64"]))
            reply(rc=rc)
        elif op == "corrupt":
            # one payload byte flipped in place (upsert overwrites; put would keep the old value):
            # a value damaged in the store, which the reader's checksum must catch
            raw = bytearray(pool._store.get(cmd["key"]))
            raw[-1] ^= 0xFF
            reply(rc=pool._store.upsert(cmd["key"], bytes(raw)), size=len(raw))
        elif op == "stats":
            reply(stats=pool.stats())
        else:
            reply(error=f"unknown op {op}")


if __name__ == "__main__":
    main()
