"""Block allocator with pins, paged KV cache, and pool (de)serialisation of one block."""
import os
import threading

import pytest
import torch

from graphgen.runtime.core import ops

from graphgen.runtime.core.kvcache import (
    BlockAllocator, OutOfBlocks, PackedStaging, PagedKVCache, layout_version, make_staging, pack_block,
    slot_mapping, unpack_block_into,
)
from graphgen.runtime.core.block_copy import block_id_runs, copy_from_blocks, copy_into_blocks
from graphgen.runtime.pool import HostPool, block_keys

BS = 4
QWEN = {"k": (BS, 2, 8), "v": (BS, 2, 8)}                # [block_size, Hkv, D]
DSV3 = {"ckv": (BS, 32), "kpe": (BS, 8)}                 # [block_size, kv_lora_rank], [.., rope]


# -------------------------------------------------------------------------------------- allocator

def test_alloc_free_and_out_of_blocks():
    a = BlockAllocator(4)
    ids = a.alloc(3)
    assert sorted(ids) == [0, 1, 2] and a.num_free == 1
    with pytest.raises(OutOfBlocks, match="requested 2, free 1.*total 4") as ei:
        a.alloc(2)
    assert (ei.value.requested, ei.value.free, ei.value.total) == (2, 1, 4)
    assert a.num_free == 1                               # a failed alloc takes nothing
    a.free(ids)
    assert a.num_free == 4
    with pytest.raises(ValueError, match="double free"):
        a.free([ids[0]])
    with pytest.raises(ValueError, match="out of range"):
        a.free([9])


def test_pinned_block_never_reused_even_after_free():
    a = BlockAllocator(3)
    ids = a.alloc(3)
    a.pin([ids[1]])                                      # its save is in flight
    a.free(ids)                                          # request finished: free without waiting
    assert a.num_free == 2 and a.num_unheld == 3
    assert a.alloc(1) == [ids[0]]                        # reuse in the order of the frees
    with pytest.raises(OutOfBlocks, match="freed but pinned by an in-flight save 1"):
        a.alloc(1)                                       # ids[1] is next: never skipped while pinned
    assert a.num_unheld == 2                             # a failed alloc takes nothing
    a.unpin([ids[1]])                                    # save done: now reusable
    assert a.alloc(2) == [ids[1], ids[2]]


def test_reuse_order_does_not_depend_on_when_a_save_lands():
    """Tensor-parallel ranks commit asynchronously at their own pace: the ids a later alloc gets must
    be the same whether a freed block's save landed before or after other blocks were freed (the
    ranks' plan check compares block tables). Negative control: returning a block to the free list
    at its unpin (the old rule) gives [2, 3, 0, 1] for one order and [0, 1, 2, 3] for the other."""
    def run(save_lands_early: bool) -> list[int]:
        a = BlockAllocator(4)
        x = a.alloc(2)
        a.pin(x)                                         # a decode-time save of a finishing request
        a.free(x)
        if save_lands_early:
            a.unpin(x)
        y = a.alloc(2)
        a.free(y)
        if not save_lands_early:
            a.unpin(x)
        return a.alloc(4)

    assert run(True) == run(False) == [0, 1, 2, 3]


def test_pin_counts_and_refcounts():
    a = BlockAllocator(2)
    (b,) = a.alloc(1)
    a.pin([b])
    a.pin([b])                                           # two saves of the same block in flight
    a.share([b])                                         # a second sequence shares it
    a.free([b])
    a.free([b])
    a.unpin([b])
    assert a.is_pinned(b) and a.num_free == 1
    a.unpin([b])
    assert not a.is_pinned(b) and a.num_free == 2 and a.refcount(b) == 0
    with pytest.raises(ValueError, match="not pinned"):
        a.unpin([b])
    with pytest.raises(ValueError, match="not allocated"):
        a.pin([b])                                       # pinning a free block protects nothing


def test_free_validates_before_applying():
    a = BlockAllocator(3)
    x, y = a.alloc(2)
    with pytest.raises(ValueError):
        a.free([x, x])                                   # x has one reference only
    assert a.refcount(x) == 1 and a.num_free == 1        # nothing half-applied


def test_allocator_threads_never_double_hand_out():
    a = BlockAllocator(16)
    busy: set[int] = set()          # blocks owned or pinned by some worker right now
    lock = threading.Lock()
    errors = []

    def worker():
        for _ in range(200):
            try:
                ids = a.alloc(3)
            except OutOfBlocks:
                continue
            with lock:
                if busy & set(ids):
                    errors.append(("handed out twice", sorted(busy & set(ids))))
                busy.update(ids)
            a.pin(ids[:1])                               # first block: save in flight
            with lock:
                busy.difference_update(ids[1:])          # give up ownership before freeing
            a.free(ids)
            with lock:
                busy.discard(ids[0])
            a.unpin(ids[:1])                             # only now may it be reused

    ts = [threading.Thread(target=worker) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    assert not errors
    assert a.stats() == dict(total=16, free=16, allocated=0, pinned=0, pinned_released=0)


# ------------------------------------------------------------------------------------------ cache

def test_cache_shapes_and_block_bytes():
    c = PagedKVCache(3, QWEN, num_blocks=5, dtype=torch.float16)
    assert len(c) == 3 and c.component_names == ("k", "v") and c.block_size == BS
    k, v = c.layer(2)
    assert k.shape == (5, BS, 2, 8) and v.dtype == torch.float16
    assert c[1][0] is c.layer(1)[0]
    assert c.block_bytes() == 3 * 2 * (BS * 2 * 8) * 2
    d = PagedKVCache(2, DSV3, num_blocks=5)
    assert [t.shape for t in d[0]] == [(5, BS, 32), (5, BS, 8)]
    assert d.block_bytes() == 2 * BS * (32 + 8) * 4


def test_component_shapes_validated():
    with pytest.raises(ValueError, match="block_size"):
        PagedKVCache(1, {"k": (4, 2), "v": (8, 2)}, 2)
    with pytest.raises(ValueError):
        PagedKVCache(1, {}, 2)


def test_slot_mapping():
    table = [7, 2, 5]
    sm = slot_mapping(table, 2, 9, BS)
    expect = [7 * 4 + 2, 7 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 5 * 4 + 0]
    assert sm.dtype == torch.long and sm.tolist() == expect
    assert slot_mapping(torch.tensor(table), 2, 9, BS).tolist() == expect
    assert slot_mapping(table, 3, 3, BS).tolist() == []
    with pytest.raises(ValueError, match="block table has 3"):
        slot_mapping(table, 0, 13, BS)


def test_layout_version_distinguishes_layouts():
    base = layout_version(QWEN, 2, torch.float32)
    assert base == "kv1:float32:L2:k=4x2x8:v=4x2x8"
    others = {
        layout_version(QWEN, 2, torch.bfloat16),
        layout_version(QWEN, 3, torch.float32),
        layout_version({"v": QWEN["v"], "k": QWEN["k"]}, 2, torch.float32),   # order matters
        layout_version({"k": (4, 1, 16), "v": (4, 1, 16)}, 2, torch.float32),  # same bytes
    }
    assert base not in others and len(others) == 4
    assert PagedKVCache(2, QWEN, 1).layout == base
    assert "@" not in base


# -------------------------------------------------------------------------------- serialisation

def _bits(t):
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _fill(layers, gen):
    # random BIT patterns (NaN payloads, denormals, -0 included): a lossy copy path shows up
    for layer in layers:
        for t in layer:
            bits = _bits(t)
            info = torch.iinfo(bits.dtype)
            bits.copy_(torch.randint(info.min, info.max, bits.shape, generator=gen,
                                     dtype=torch.int64).to(bits.dtype))


@pytest.mark.parametrize("shapes", [QWEN, DSV3], ids=["qwen", "deepseek"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pack_unpack_roundtrip_bit_exact(shapes, dtype):
    g = torch.Generator().manual_seed(0)
    src = PagedKVCache(3, shapes, num_blocks=6, dtype=dtype)
    _fill(src, g)
    data = pack_block(src, 4)
    assert isinstance(data, bytes) and len(data) == src.block_bytes()
    dst = PagedKVCache(3, shapes, num_blocks=6, dtype=dtype)
    before = [[t.clone() for t in layer] for layer in dst]
    unpack_block_into(dst, 1, data)
    for li in range(3):
        for ci in range(2):
            s, d = src[li][ci], dst[li][ci]
            assert torch.equal(_bits(d[1]), _bits(s[4]))    # bit-exact, not value-equal
            others = [b for b in range(6) if b != 1]
            # only block 1 was written
            assert torch.equal(_bits(d[others]), _bits(before[li][ci][others]))


@pytest.mark.parametrize("shapes", [QWEN, DSV3], ids=["qwen", "deepseek"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared", [False, True], ids=["torch-memory", "memfd"])
def test_staging_block_packs_like_cache_block(shapes, dtype, shared):
    # engine path: kv_save copies cache blocks into staging; block j of staging -> pool -> new block.
    # The host staging is packed (a block's value is one row); the cache packs per component: the
    # two layouts must give the same bytes both ways. ``shared``: the connector's memfd staging,
    # whose rows are read (os.pread) and written (os.pwrite) through the descriptor, not the views.
    g = torch.Generator().manual_seed(1)
    cache = PagedKVCache(2, shapes, num_blocks=8, dtype=dtype)
    _fill(cache, g)
    saved = [5, 2, 7]
    staging = make_staging(shapes, 2, len(saved), dtype, shared_memory=shared)
    assert isinstance(staging, PackedStaging)
    assert (staging.fd is not None) == (shared and hasattr(os, "memfd_create"))
    assert [t.shape[0] for t in staging[0]] == [3, 3]
    for li in range(2):
        for ci, t in enumerate(cache[li]):
            staging[li][ci][:len(saved)] = t[saved]          # what kv_save does
    assert cache.make_staging(3)[1][1].shape == staging[1][1].shape
    for j, b in enumerate(saved):
        assert pack_block(staging, j) == pack_block(cache, b)
    dst = PagedKVCache(2, shapes, num_blocks=8, dtype=dtype)
    unpack_block_into(dst, 0, pack_block(staging, 2))
    loads = make_staging(shapes, 2, 2, dtype, shared_memory=shared)  # the load path's staging, packed too
    unpack_block_into(loads, 1, pack_block(cache, 7))
    for li in range(2):
        for ci in range(2):
            assert torch.equal(_bits(dst[li][ci][0]), _bits(cache[li][ci][7]))
            assert torch.equal(_bits(loads[li][ci][1]), _bits(cache[li][ci][7]))
            assert not _bits(loads[li][ci][0]).any()         # only row 1 was written


@pytest.mark.parametrize("shapes", [QWEN, DSV3], ids=["qwen", "deepseek"])
@pytest.mark.parametrize("ids", [[3, 4, 5, 6, 7], [9, 2, 6, 0, 4], [10, 11, 12, 1, 7, 8, 5, 2, 3, 4]],
                         ids=["consecutive", "scattered", "mixed"])
def test_loaded_blocks_land_in_their_cache_blocks(shapes, ids):
    # the graph's kv_load: staging row j (a strided view of a packed load staging, as KVLoader fills
    # it) -> cache block ids[j]; runs of consecutive ids are slice copies, the rest one index_copy_.
    # Reference: one block at a time. Every row differs, so a row copied to a wrong offset shows.
    g = torch.Generator().manual_seed(3)
    staging = make_staging(shapes, 2, len(ids), torch.float32)
    staging.packed.copy_(torch.randint(0, 256, staging.packed.shape, generator=g))  # random bits, as pool values
    cache = PagedKVCache(2, shapes, num_blocks=13)
    _fill(cache, g)
    expected = [[t.clone() for t in layer] for layer in cache]
    for layer, rows in zip(expected, staging):
        for t, s in zip(layer, rows):
            for j, b in enumerate(ids):
                t[b] = s[j]

    def matches(got) -> bool:
        return all(torch.equal(_bits(a), _bits(b)) for la, lb in zip(got, expected) for a, b in zip(la, lb))

    assert len({pack_block(staging, j) for j in range(len(ids))}) == len(ids)
    shifted = [[t.clone() for t in layer] for layer in cache]   # negative control: one run off by a row
    runs, _ = block_id_runs(ids)
    for layer, rows in zip(shifted, staging):
        copy_into_blocks(layer, rows, torch.tensor(ids))
        for t, s in zip(layer, rows):
            at, first, length = runs[0] if runs else (0, ids[0], 1)
            t[first:first + length] = s.roll(1, 0)[at:at + length]
    assert not matches(shifted)
    for layer, rows in zip(cache, staging):
        ops.kv_load(layer, rows, torch.tensor(ids, dtype=torch.int32))
    assert matches(cache)


@pytest.mark.parametrize("shapes", [QWEN, DSV3], ids=["qwen", "deepseek"])
@pytest.mark.parametrize("ids", [[3, 4, 5, 6, 7], [9, 2, 6, 0, 4], [10, 11, 12, 1, 7, 8, 5, 2, 3, 4]],
                         ids=["consecutive", "scattered", "mixed"])
def test_saved_blocks_land_in_their_staging_rows(shapes, ids):
    # the graph's kv_save: cache block ids[j] -> row j of a packed save staging (its pool value);
    # runs of consecutive ids are slice copies, the rest gathered once. Reference: pack_block of the
    # cache block. Every block differs, so a row taken from a wrong block shows.
    g = torch.Generator().manual_seed(4)
    cache = PagedKVCache(2, shapes, num_blocks=13)
    _fill(cache, g)
    staging = make_staging(shapes, 2, len(ids) + 1, torch.float32)
    for layer, rows in zip(cache, staging):
        ops.kv_save(layer, torch.tensor(ids, dtype=torch.int32), rows)
    assert [pack_block(staging, j) for j in range(len(ids))] == [pack_block(cache, b) for b in ids]
    runs, _ = block_id_runs(ids)
    shifted = make_staging(shapes, 2, len(ids) + 1, torch.float32)  # negative control: one run off by a block
    for layer, rows in zip(cache, shifted):
        copy_from_blocks(rows, layer, torch.tensor(ids))
        at, _, length = runs[0] if runs else (0, ids[0], 2)
        for s in rows:
            s[at:at + length] = s[at:at + length].roll(1, 0)
    assert [pack_block(shifted, j) for j in range(len(ids))] != [pack_block(cache, b) for b in ids]


def test_block_id_runs():
    assert block_id_runs([3, 4, 5, 9, 1, 2, 7]) == ([(0, 3, 3), (4, 1, 2)], [3, 6])
    assert block_id_runs([5, 3, 1]) == ([], [0, 1, 2]) and block_id_runs([]) == ([], [])
    assert block_id_runs([2, 3]) == ([(0, 2, 2)], [])


def test_distinct_blocks_pack_differently():
    c = PagedKVCache(1, QWEN, 3)
    c[0][0][1] = 1.0
    assert pack_block(c, 0) != pack_block(c, 1)
    c2 = PagedKVCache(1, QWEN, 3)
    c2[0][1][1] = 1.0                                    # same values in v instead of k
    assert pack_block(c, 1) != pack_block(c2, 1)


def test_unpack_rejects_wrong_size():
    c = PagedKVCache(2, QWEN, 3)
    other = PagedKVCache(3, QWEN, 3)
    with pytest.raises(ValueError, match=r"has \d+ bytes.*needs \d+.*layout kv1:float32:L2"):
        unpack_block_into(c, 0, pack_block(other, 0))
    with pytest.raises(ValueError):
        unpack_block_into(c, 0, pack_block(c, 0) + b"\0")
    with pytest.raises(IndexError):
        pack_block(c, 3)
    with pytest.raises(IndexError):
        unpack_block_into(c, 3, pack_block(c, 0))


def test_through_pool_end_to_end():
    # cache -> pack -> HostPool under a layout-qualified key -> unpack into another block
    g = torch.Generator().manual_seed(2)
    c = PagedKVCache(2, DSV3, 4)
    _fill(c, g)
    pool = HostPool(10 * c.block_bytes())
    keys = block_keys(list(range(2 * BS + 1)), BS, model="dsv3-tiny", layout=c.layout)
    assert len(keys) == 2
    for key, b in zip(keys, [3, 1]):
        assert pool.put(key, pack_block(c, b))
    assert pool.leading_run(keys) == 2
    unpack_block_into(c, 0, pool.get(keys[0]))
    assert all(torch.equal(_bits(c[li][ci][0]), _bits(c[li][ci][3]))
               for li in range(2) for ci in range(2))
    # a cache with another layout looks up other keys: no stale read possible
    c16 = PagedKVCache(2, DSV3, 4, dtype=torch.float16)
    k16 = block_keys(list(range(2 * BS)), BS, model="dsv3-tiny", layout=c16.layout)
    assert pool.leading_run(k16) == 0
