"""Speculative decoding with DeepSeek-V3's MTP layer on the CPU target (docs/mtp.md).

One cycle, for a sequence whose tokens ``x_0 .. x_m`` are final (``x_m`` not yet fed to the target):

1. **draft**: the MTP graph (the spec's ``phase: mtp`` variant) runs over the positions whose MTP KV
   is not final yet, ``p0 .. m-1``: row ``t`` holds token ``x_{t+1}`` and the target's hidden state
   at ``t``; the last row's logits give draft ``d_1`` (for ``x_{m+1}``). For ``K > 1`` the same layer
   runs again, one row at position ``m + j - 1`` holding ``d_j`` and the previous MTP run's own
   hidden state, giving ``d_{j+1}`` (one MTP layer reused recursively, as vLLM does);
2. **verify**: the target's decode graph runs one multi-token decode row of ``K + 1`` tokens
   ``[x_m, d_1 .. d_K]`` at positions ``m .. m+K``; ``t_i`` = the target's argmax at row ``i``.
   The longest prefix with ``d_{i+1} == t_i`` is accepted, and ``t_a`` after it is the bonus (all
   matched) or the correction: the cycle emits ``t_0 .. t_a``, exactly the tokens greedy
   non-speculative decoding emits;
3. **roll back**: the sequence length becomes ``m + a + 1``; the KV the rejected drafts wrote at
   later positions (target and MTP layers) lies past it, is never read and is overwritten by the
   next cycle. The next draft run starts at ``p0 = m``, so the MTP KV at every verified position is
   recomputed from the target's hidden state there (the recursive runs' MTP KV is provisional).

**The pool** (``pool.write`` sync or async): one pool object per block holds every cache layer, the
MTP layer included (the connector packs all ``spec.kv_layers`` layers). The MTP KV at position i
depends on token i+1, so a block's key carries its successor token (``BlockKey.lookahead``, as vLLM
PR #50897): block b is saved under ``(chain of blocks 0..b, token (b+1)*block_size)`` once that token is
final (after the first draft run, for every full block of the prompt -- the last one's successor is
the first generated token), and a prompt looks its blocks up with its own successors (at most
``(len - 1) // block_size`` blocks, so each successor is a prompt token). The first draft run's graph saves them
(its save program copies every layer of those blocks after its own layer's KV write, ordered by
record/wait events the race verifier checks; the connector commits after its event). A hit loads
target and MTP KV together; the target prefills the rest with the history variant and the first
draft run starts at the first position not loaded, so the draft reads the MTP KV from the pool
exactly as a cold run computed it. Only final tokens' KV is ever saved: the provisional MTP KV of the recursive draft runs
and the rejected drafts' KV lie past every saved block.

Greedy only: temperature > 0 is refused (rejection sampling, arXiv 2211.17192, is not built yet).
The decoder drives the engine's runner, cache, allocator and KV connector directly, one sequence at
a time (not the scheduler: docs/mtp.md says what is not done).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import torch

from ..pool.keys import BlockKey, KVShard, chain_digests
from .request import RowPlan, StepPlan
from .runner import StepInputs, build_inputs

__all__ = ["MAX_SPECULATIVE_TOKENS", "MtpInputs", "SpecResult", "SpeculativeDecoder", "check_speculative",
           "mtp_variant"]

# K + 1 <= 16: a verify row stays inside absorbed FIA's 1-16-token multi-token decode envelope (docs/npu.md)
MAX_SPECULATIVE_TOKENS = 15


@dataclass
class MtpInputs(StepInputs):
    """The MTP graph's inputs: the step inputs plus each row's previous hidden state ``[T, H]``."""

    prev_hidden: Optional[torch.Tensor] = None


@dataclass
class SpecResult:
    """One prompt's speculative greedy generation, with vLLM's acceptance counters
    (``spec_decode_num_draft_tokens``, ``..._num_accepted_tokens``, ``..._per_pos``)."""

    tokens: list[int]
    finish_reason: str
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    # with collect_logits: the target's logits of every emitted token, and the first draft's logits
    # of each cycle (the MTP layer's prediction of the token after the next)
    target_logits: list = field(default_factory=list)
    draft_logits: list = field(default_factory=list)
    hit_tokens: int = 0  # prompt tokens whose KV (target and MTP layers) came from the pool
    saved_blocks: int = 0  # blocks handed to the pool's save

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


def mtp_variant(spec) -> str:
    """The spec's MTP graph (its ``phase: mtp`` variant); ValueError naming the fix when it has none."""
    if spec.mtp is None:
        raise ValueError(f"spec {spec.name} has no MTP layers: --speculative mtp needs a DeepSeek-V3 spec with an "
                         f"mtp: section (and a checkpoint with num_nextn_predict_layers > 0)")
    for name, v in spec.variants.items():
        if v.phase == "mtp":
            return name
    raise ValueError(f"spec {spec.name} has an mtp: section but no 'phase: mtp' variant: add "
                     f"'mtp_draft: {{phase: mtp}}' under variants")


def check_speculative(spec, num_speculative_tokens: int, temperature: float = 0.0) -> str:
    """The MTP variant of ``spec`` if it can decode speculatively with these settings; ValueError
    (one sentence) otherwise."""
    k = num_speculative_tokens
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"--num-speculative-tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}] "
                         f"(K + 1 tokens per verify row, at most 16), got {k!r}")
    if temperature > 0:
        raise ValueError("--speculative mtp decodes greedily only (temperature 0): rejection sampling for "
                         "temperature > 0 is not implemented yet")
    return mtp_variant(spec)


def _first_variant(spec, phase: str, history: bool = False) -> Optional[str]:
    for name, v in spec.variants.items():
        if v.phase == phase and (phase == "decode" or v.history == history):
            return name
    return None


def mtp_block_keys(tokens: Sequence[int], num_blocks: int, block_size: int, *, model: str, layout: str,
                   shard: KVShard = KVShard()) -> list[str]:
    """Pool keys of the first ``num_blocks`` full blocks of ``tokens`` for a cache with MTP layers:
    the hash chain plus the block's successor token (``BlockKey.lookahead``), which the MTP layer's KV
    at the block's last position depends on. Every such successor must be in ``tokens``."""
    if num_blocks * block_size >= len(tokens) and num_blocks:
        raise ValueError(f"block {num_blocks - 1}'s successor (position {num_blocks * block_size}) is not among "
                         f"the {len(tokens)} tokens")
    chain = chain_digests(tokens, block_size)[:num_blocks]
    return [BlockKey(model, layout, shard, d, lookahead=int(tokens[(b + 1) * block_size])).render()
            for b, d in enumerate(chain)]


class SpeculativeDecoder:
    """Greedy speculative decoding with the MTP layer on an engine's CPU runner (module docstring)."""

    def __init__(self, engine, num_speculative_tokens: int = 1):
        self.spec = engine.spec
        self.mtp = check_speculative(self.spec, num_speculative_tokens)
        self.k = num_speculative_tokens
        self.runner, self.cache, self.alloc = engine.runner, engine.cache, engine.alloc
        self.block_size = self.spec.kv_cache.block_size
        self.prefill = _first_variant(self.spec, "prefill")
        self.history = _first_variant(self.spec, "prefill", history=True)  # None: no pool hits
        self.decode = _first_variant(self.spec, "decode")
        if self.prefill is None or self.decode is None:
            raise ValueError(f"spec {self.spec.name} needs a prefill variant without history and a decode variant "
                             f"for --speculative mtp")
        self.eos = frozenset(getattr(engine.llm, "eos_token_ids", ()))
        self.loader, self.connector = engine.loader, engine.connector
        self.write = engine.write

    # ---- one graph run ----------------------------------------------------------------------
    def _run(self, variant: str, token_ids: Sequence[int], start: int, table: Sequence[int],
             logits_positions: Sequence[int], prev_hidden: Optional[torch.Tensor] = None, save=None):
        """(logits ``[len(logits_positions), V]``, hidden ``[len(token_ids), H]``) of one row. Only an
        MTP run is given a ``save`` (the connector's `PendingSave`: whole blocks, every layer, staged by
        the graph's save program and committed after its event); any other saving module stages nothing."""
        row = RowPlan(None, tuple(int(t) for t in token_ids), start, tuple(table),
                      logits_positions=tuple(logits_positions), save_block_ids=save.block_ids if save else ())
        base = build_inputs(StepPlan(variant, "decode", (row,), False), self.block_size)
        inputs = MtpInputs(**{f: getattr(base, f) for f in StepInputs.__dataclass_fields__}, prev_hidden=prev_hidden)
        if save is not None:
            staging = save.staging
        else:
            staging = self.cache.make_staging(0) if self.runner.saves(variant) else None
        loads = self.cache.make_staging(0) if self.runner.modules[variant].META.get("history") else ()
        try:
            handles = self.runner.execute(variant, inputs, staging, loads)
        except BaseException:
            if save is not None:
                self.connector.cancel(save)
            raise
        if save is not None:
            self.connector.handoff(save, handles.save_job, handles.save_done)
        elif handles.save_job is not None:
            handles.save_job.wait()
        if handles.hidden is None:
            raise RuntimeError(f"{variant}: the module returned no hidden state (regenerate: graphgen generate)")
        return handles.logits, handles.hidden

    def draft(self, tokens: Sequence[int], p0: int, hidden: torch.Tensor, table: Sequence[int], save=None):
        """Drafts ``d_1 .. d_K`` after ``tokens`` (all final; ``hidden``: the target's hidden states
        at positions ``p0 .. len(tokens) - 2``), and the logits of each draft. ``save``: blocks the
        first MTP run saves (their every layer final once it has run)."""
        m = len(tokens) - 1
        logits, g = self._run(self.mtp, tokens[p0 + 1:m + 1], p0, table, (m - p0 - 1,), prev_hidden=hidden,
                              save=save)
        drafts, all_logits = [int(logits[-1].argmax())], [logits[-1]]
        for j in range(1, self.k):  # the same MTP layer again, on its own hidden state
            logits, g = self._run(self.mtp, (drafts[-1],), m + j - 1, table, (0,), prev_hidden=g[-1:])
            drafts.append(int(logits[-1].argmax()))
            all_logits.append(logits[-1])
        return drafts, all_logits

    # ---- a whole generation -----------------------------------------------------------------
    def generate(self, prompt: Sequence[int], max_new_tokens: int, *, ignore_eos: bool = False,
                 collect_logits: bool = False) -> SpecResult:
        prompt = [int(t) for t in prompt]
        if not prompt or max_new_tokens < 1:
            raise ValueError("need a non-empty prompt and max_new_tokens >= 1")
        n = len(prompt)
        need = math.ceil((n + max_new_tokens + self.k + 1) / self.block_size)
        table = self.alloc.alloc(need)  # OutOfBlocks when the cache is too small
        try:
            return self._generate(prompt, max_new_tokens, table, ignore_eos, collect_logits)
        finally:
            self.alloc.free(table)

    def _keys(self, tokens, num_blocks):
        return mtp_block_keys(tokens, num_blocks, self.block_size, model=self.loader.model,
                              layout=self.cache.layout, shard=self.loader.shard)

    def _load(self, prompt, table) -> int:
        """Prompt tokens whose KV (every layer) is loaded from the pool into ``table``'s leading blocks."""
        if self.write == "off" or self.history is None:
            return 0
        keys = self._keys(prompt, (len(prompt) - 1) // self.block_size)
        hit = self.loader.lookup(keys) if keys else 0
        loaded = self.loader.load(keys[:hit]) if hit else []
        for j, blk in enumerate(loaded):
            for layer, parts in zip(self.cache, blk):
                for dst, src in zip(layer, parts):
                    dst[table[j]].copy_(src[0])
        return len(loaded) * self.block_size

    def _prompt_save(self, tokens, n, hit, table):
        """The save of the prompt's full blocks not loaded from the pool, keyed with their successors
        (``tokens`` holds the first generated token): staged by the first MTP run, which writes the
        last MTP KV they need. None when nothing is saved."""
        first, count = hit // self.block_size, n // self.block_size
        if self.write == "off" or count <= first or not self.runner.saves(self.mtp):
            return None
        return self.connector.prepare_save(table[first:count], self._keys(tokens, count)[first:])

    def _generate(self, prompt, max_new_tokens, table, ignore_eos, collect_logits) -> SpecResult:
        stops = frozenset() if ignore_eos else self.eos
        n = len(prompt)
        hit = self._load(prompt, table)
        variant = self.history if hit else self.prefill
        logits, hidden = self._run(variant, prompt[hit:], hit, table, (n - hit - 1,))
        tokens = prompt + [int(logits[-1].argmax())]
        res = SpecResult(tokens=[tokens[-1]], finish_reason="length", accepted_per_pos=[0] * self.k,
                         hit_tokens=hit)
        if collect_logits:
            res.target_logits.append(logits[-1])
        p0 = hit  # first position whose MTP KV is not final (before it: loaded from the pool)
        while len(res.tokens) < max_new_tokens and tokens[-1] not in stops:
            m = len(tokens) - 1
            # the first draft run completes every prompt position's MTP KV: it saves the prompt's blocks
            save = self._prompt_save(tokens, n, hit, table) if p0 == hit else None
            if save is not None:
                res.saved_blocks = len(save.block_ids)
                drafts, dlogits = self.draft(tokens, p0, hidden, table, save=save)
            else:
                drafts, dlogits = self.draft(tokens, p0, hidden, table)
            if collect_logits:
                res.draft_logits.append(dlogits[0])
            logits, verify_hidden = self._run(self.decode, [tokens[m], *drafts], m, table, range(self.k + 1))
            targets = logits.argmax(-1).tolist()
            a = 0
            while a < self.k and drafts[a] == targets[a]:
                res.accepted_per_pos[a] += 1
                a += 1
            res.num_draft_tokens += self.k
            res.num_accepted_tokens += a
            for i, t in enumerate(targets[:a + 1]):
                if len(res.tokens) >= max_new_tokens or tokens[-1] in stops:
                    break
                tokens.append(int(t))
                res.tokens.append(int(t))
                if collect_logits:
                    res.target_logits.append(logits[i])
            # the hidden states of the verified positions m .. m+a (their inputs were all accepted)
            hidden, p0 = verify_hidden[:a + 1], m
        if res.tokens[-1] in stops:
            res.finish_reason = "stop"
        return res


def speculative_generate(engine, prompts: Iterable[Sequence[int]], max_new_tokens: int, *,
                         num_speculative_tokens: int = 1, ignore_eos: bool = False,
                         collect_logits: bool = False) -> list[SpecResult]:
    """Greedy speculative generation of each prompt in turn (`SpeculativeDecoder`)."""
    dec = SpeculativeDecoder(engine, num_speculative_tokens)
    return [dec.generate(p, max_new_tokens, ignore_eos=ignore_eos, collect_logits=collect_logits) for p in prompts]
