"""``n`` / ``best_of`` as forks (issue 16 item 2): one prefill of the prompt, the children share its
full blocks (refcounts), each computes only the tail of its prompt and decodes on its own.

Reference: the same requests added independently (each its own prefill), with the same seeds: a
fork changes which blocks a child reads its prompt's KV from, never its tokens. Leak checks: the
allocator is back to full after forks finish, after the parent's abort, after a child's preemption."""
from __future__ import annotations

import pytest

from graphgen.runtime import SamplingParams
from test_continuous_batching import BS, SPEC_PATH, ckpt, drive, engine, prompts  # noqa: F401  (fixtures)

PROMPT = prompts(1, seed=21, lo=3 * BS + 2, hi=3 * BS + 3)[0]  # 3 full blocks shared, a 2-token tail
SHARED, TAIL = 3, 2


def _params(j: int, max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=7 + j)


def _independent(ckpt, n: int, max_tokens: int = 6) -> dict:
    with engine(ckpt) as e:
        for j in range(n):
            e.core.add_request(j, PROMPT, _params(j, max_tokens))
        got = drive(e.core)
        assert e.core.stats()["prefills"] == n and e.core.stats()["forks"] == 0
    return {k: v[0] for k, v in got.items()}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_n4_runs_one_prefill_shares_the_prompt_blocks_and_gives_the_independent_tokens(ckpt, async_scheduling):
    want = _independent(ckpt, 4)
    with engine(ckpt, async_scheduling=async_scheduling) as e:
        llm, alloc = e.core, e.alloc
        llm.add_request(0, PROMPT, _params(0))
        for j in range(1, 4):
            llm.add_request(j, PROMPT, _params(j), fork_of=0)
        shared_refs, got = [], {}
        while llm.has_work():
            for o in llm.step():
                got.setdefault(o.req_id, []).extend(o.new_token_ids)
            tables = [r.table for r in llm.scheduler.running]
            if len(tables) == 4:
                shared_refs.append([alloc.refcount(b) for b in tables[0][:SHARED]])
        s = llm.stats()
        assert alloc.num_free == alloc.num_blocks                  # every reference dropped
    assert got == want
    assert s["prefills"] == 1 and s["forks"] == 3
    assert s["prefill_tokens"] == len(PROMPT) + 3 * TAIL   # the prompt once, 3 tails
    assert shared_refs and shared_refs[0] == [4, 4, 4]            # one block, four holders


def test_abort_of_the_parent_aborts_every_child_held_or_forked_and_frees_everything(ckpt):
    with engine(ckpt) as e:
        llm, alloc = e.core, e.alloc
        for when in ("held", "forked"):
            llm.add_request("p", PROMPT, _params(0, 20))
            for j in range(1, 4):
                llm.add_request(f"c{j}", PROMPT, _params(j, 20), fork_of="p")
            if when == "forked":
                while len(llm.scheduler.running) < 4:
                    llm.step()
                assert alloc.refcount(llm.scheduler.running[0].table[0]) == 4
            else:
                assert len(llm.scheduler.held) == 3
            llm.abort("p")
            assert not llm.has_work() and alloc.num_free == alloc.num_blocks, when


def test_a_parent_cut_alone_before_its_prefill_leaves_its_children_running_alone(ckpt):
    """``abort(parent, forks=False)`` (a server cutting choice 0 at a stop string): held children
    become ordinary requests with their own prefills and the tokens they get independently."""
    want = _independent(ckpt, 3)
    with engine(ckpt) as e:
        llm = e.core
        llm.add_request(0, PROMPT, _params(0))
        for j in (1, 2):
            llm.add_request(j, PROMPT, _params(j), fork_of=0)
        llm.abort(0, forks=False)
        got = {k: v[0] for k, v in drive(llm).items()}
        assert llm.stats()["forks"] == 0 and e.alloc.num_free == e.alloc.num_blocks
    assert got == {1: want[1], 2: want[2]}


def test_a_preempted_child_drops_its_shared_blocks_and_is_recomputed_with_the_same_tokens(ckpt):
    want = _independent(ckpt, 4, max_tokens=3 * BS)
    # together at the end: 3 shared + 4 x 3 own blocks; 9 forces preemptions during decode
    with engine(ckpt, num_blocks=9) as e:
        llm, alloc = e.core, e.alloc
        llm.add_request(0, PROMPT, _params(0, 3 * BS))
        for j in range(1, 4):
            llm.add_request(j, PROMPT, _params(j, 3 * BS), fork_of=0)
        got = {k: v[0] for k, v in drive(llm).items()}
        s = llm.stats()
        assert alloc.num_free == alloc.num_blocks
    assert s["forks"] == 3 and s["preemptions"] > 0
    assert got == want


def test_a_fork_whose_prompt_differs_is_refused(ckpt):
    with engine(ckpt) as e:
        e.core.add_request(0, PROMPT, _params(0))
        with pytest.raises(ValueError, match="must have its prompt"):
            e.core.add_request(1, PROMPT[:-1], _params(1), fork_of=0)
