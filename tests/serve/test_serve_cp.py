"""``graphgen serve --cp 2`` (context parallel over two CPU ranks, tiny_qwen3 with the override), driven by
the ``openai`` client on 127.0.0.1: concurrent greedy completions (continuous batching, so decode rows
and chunked prompts share split prefill steps on both ranks) give a cp=1 engine's tokens, and so does a
repeated prompt (its blocks saved by CP rank 0 by then; the hit counts per rank are checked in tests/parallel). The logits at cp=2 are tests/parallel/test_context_parallel.py's."""
from __future__ import annotations

from graphgen.runtime import open_engine
from serve_util import ROOT
from support.hf import ATOL
from support.tokens import assert_tokens_agree

SPEC = ROOT / "specs" / "tiny_qwen3.yaml"
PROMPTS = [[5, 17, 33, 2, 9, 100, 41], list(range(1, 14)), [255, 0, 128]]
N_NEW = 6


def test_serve_cp2_greedy_equals_cp1(servers, ckpt):
    s = servers.get(ckpt, "--cp", "2", "--write", "async", "--num-blocks", "64", "--max-num-batched-tokens", "8",
                    spec=SPEC)  # (its exit 0 on SIGTERM: the factory's)
    with open_engine(SPEC, ckpt, num_blocks=64, collect_logits=True) as one:
        want = one.generate(PROMPTS, N_NEW)
    # cp=2 splits the attention's reductions: the tokens equal cp=1's up to its first near tie (support.tokens;
    # the server returns no per-token logits)
    for i, got in enumerate(s.greedy(PROMPTS, N_NEW, "tiny_qwen3")):
        assert_tokens_agree(want[i].tokens, want[i].step_logits, got, 2 * ATOL, where=f"serve cp=2 prompt {i}")
    (again,) = s.greedy(PROMPTS[1:2], N_NEW, "tiny_qwen3")  # its blocks now come from the pool on both ranks
    assert_tokens_agree(want[1].tokens, want[1].step_logits, again, 2 * ATOL, where="serve cp=2, a pool hit")
