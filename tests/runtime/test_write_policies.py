"""Pool write policies (issue 17 item 5, ``pool.policy``): each proven by "evict, replay, prefix
restored" — fill, force the device blocks out (filler prompts reuse every device block), replay the
prompt: its prefix comes from the pool and its tokens are the cold run's. Plus: selective saves
nothing before ``min_uses`` computations; write-back saves nothing while the blocks are on the
device, and a block leaving with its write-back save in flight is not reusable before its commit."""
from __future__ import annotations

import dataclasses
import threading

import pytest

from graphgen.runtime import open_engine
from graphgen.runtime.core.faults import Faults
from test_continuous_batching import BS, SPEC, ckpt, prompts  # noqa: F401  (fixture)

NUM_BLOCKS = 12
P = prompts(1, seed=41, lo=4 * BS + 1, hi=4 * BS + 2)[0]  # 4 full blocks (the last token computed)
FILLERS = prompts(4, seed=42, lo=2 * BS + 1, hi=2 * BS + 2)


def _engine(ckpt, policy: str, write: str = "sync", min_uses: int = 2, **kw):
    pool = dataclasses.replace(SPEC.pool, write=write, policy=policy, min_uses=min_uses)
    return open_engine(dataclasses.replace(SPEC, pool=pool), ckpt, num_blocks=NUM_BLOCKS, **kw)


def _evict(e) -> None:
    """Every device block rewritten by other prompts (2 x 4 x 3 blocks through a 12-block cache)."""
    for _ in range(2):
        e.generate(FILLERS, 2, batch=True)
    e.drain()


@pytest.fixture(scope="module")
def cold(ckpt):
    with open_engine(dataclasses.replace(SPEC, pool=dataclasses.replace(SPEC.pool, write="off")), ckpt) as e:
        return e.generate([P], 6)[0].tokens


@pytest.mark.parametrize("policy,write", [("write_through", "sync"), ("write_through_selective", "async"),
                                          ("write_back", "sync"), ("write_back", "async")])
def test_evict_replay_prefix_restored(ckpt, cold, policy, write):
    uses = 2 if policy == "write_through_selective" else 1  # selective: saved by its second computation
    with _engine(ckpt, policy, write, min_uses=uses) as e:
        for _ in range(uses):
            first = e.generate([P], 6)[0]
        e.drain()
        _evict(e)
        again = e.generate([P], 6)[0]
        assert e.alloc.num_free == e.alloc.num_blocks
    assert first.hit_tokens == 0 and again.hit_tokens == 4 * BS     # the whole prefix from the pool
    assert first.tokens == again.tokens == cold


def test_selective_saves_nothing_before_min_uses(ckpt, cold):
    with _engine(ckpt, "write_through_selective", min_uses=3) as e:
        got = []
        for _ in range(4):
            r = e.generate([P], 6)[0]
            got.append((e.stats["puts"], r.hit_tokens, r.tokens == cold))
    # computed twice without a save, saved by the third computation, hit by the fourth
    assert got == [(0, 0, True), (0, 0, True), (4, 0, True), (4, 4 * BS, True)]


def test_write_back_saves_when_the_blocks_leave_the_device_not_when_filled(ckpt):
    with _engine(ckpt, "write_back") as e:
        llm = e.core
        llm.add_request("p", P, max_tokens=6)
        for _ in range(3):
            llm.step()                      # prefill and decodes: its blocks are filled, on the device
        assert e.stats["puts"] == 0 and llm.scheduler.running
        while llm.has_work():
            llm.step()
        assert e.stats["puts"] == 4         # freed by its last holder: written back
    with _engine(ckpt, "write_through") as e:   # control: write-through saved them with the prefill
        e.core.add_request("p", P, max_tokens=6)
        e.core.step()
        assert e.stats["puts"] == 4


@pytest.mark.parametrize("pinned", [True, False])
def test_a_written_back_block_is_not_reusable_before_its_commit(ckpt, pinned):
    gate = threading.Event()
    with _engine(ckpt, "write_back", "async", faults=Faults(put_gate=gate)) as e:
        if not pinned:  # negative control: the connector's pins do nothing
            e.connector.alloc = type("NoPins", (), {"pin": lambda s, ids: None, "unpin": lambda s, ids: None})()
        e.generate([P], 6)
        held = e.alloc.num_blocks - e.alloc.num_free
        gate.set()
        e.drain()
        assert e.alloc.num_free == e.alloc.num_blocks
    assert held == (4 if pinned else 0)
