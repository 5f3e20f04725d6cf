"""Speculative decoding with DeepSeek-V3's MTP layer on the CPU target, through the scheduler (docs/mtp.md).

Every request of an engine built with ``num_speculative_tokens`` K > 0 decodes speculatively. One
cycle, for a request whose tokens ``x_0 .. x_m`` are final (``x_m`` not yet fed to the target):

1. **draft** (`MtpDrafter.after_step`, once the step that produced ``x_m`` has landed): the MTP
   graph (the spec's ``phase: mtp`` variant) runs over the positions whose MTP KV is not final yet,
   ``p0 .. m-1``: row ``t`` holds token ``x_{t+1}`` and the target's hidden state at ``t`` (kept
   per request in ``Request.spec_hidden`` from the steps that computed them: a whole prompt, its
   chunks, a verify row's accepted prefix); the last row's logits give draft ``d_1``. For ``K > 1``
   the same layer runs again, one row at position ``m + j - 1`` holding ``d_j`` and the previous
   MTP run's own hidden state, giving ``d_{j+1}`` (one MTP layer reused recursively, as vLLM
   does). Every request drafting after the same step shares each of these forwards (one row each).
   A draft is the MTP logits' argmax for a greedy request, a draw from its own sampler (and its
   distribution kept) otherwise;
2. **verify**: the scheduler gives the request a decode row of ``K + 1`` tokens ``[x_m, d_1 .. d_K]``
   at positions ``m .. m+K`` (a verify row, batched with other requests' rows, prompt chunks
   included, in one forward); `MtpDrafter.verify` takes the longest prefix with ``d_{i+1} == t_i``
   (``t_i``: the target's argmax at row i) plus ``t_a`` after it (the bonus or the correction) —
   exactly the tokens greedy non-speculative decoding emits — or, at temperature > 0, rejection
   sampling (`sampling.rejection_sample`, arXiv 2211.17192) with the request's own generator;
3. **roll back**: `Scheduler.update` sets the request's ``cached`` to ``m + a + 1``; the KV the
   rejected drafts wrote at later positions (target and MTP layers) lies past it, is never read and
   is overwritten by the next cycle. The next draft run starts at ``p0 = m``, so the MTP KV at every
   verified position is recomputed from the target's hidden state there (the recursive runs' MTP KV
   is provisional).

**The pool** (``pool.write`` sync or async): one pool object per block holds every cache layer, the
MTP layer included (the connector packs all ``spec.kv_layers`` layers). The MTP KV at position i
depends on token i+1, so a block's key carries its successor token (``BlockKey.lookahead``, as vLLM
PR #50897): block b is saved under ``(chain of blocks 0..b, token (b+1)*block_size)`` once that token is
final — by the first draft run after a prompt's prefill, for every full block of the prompt not
loaded (the last one's successor is the first generated token); a request that finished on that very
token (``max_tokens`` 1: a P/D prefill; a stop token) keeps its blocks for that run, which drafts
nothing (`Scheduler.hold_for_draft`) — and a prompt looks its blocks up
with its own successors (at most ``(len - 1) // block_size`` blocks, so each successor is a prompt
token). That draft run's graph saves them (its save program copies every layer of those blocks after
its own layer's KV write, ordered by record/wait events the race verifier checks; the runner hands
it to the connector, which commits after its event: a draft run is a plan of the MTP variant
submitted through the runner, like any step); the target's graphs save nothing under speculation. A hit loads target
and MTP KV together; the first draft run starts at the first position not loaded, so the draft reads
the MTP KV from the pool exactly as a cold run computed it. Only final tokens' KV is ever saved.

Not under speculation (refused by `speculative_refusal` with the field's name): logprobs, logits
processors (penalties, logit_bias, min_tokens, bad_words, allowed_token_ids), structured output —
each would have to be applied at every verify position against the accepted prefix. The draft runs are not
counted in ``max_num_batched_tokens``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..pool.keys import successor_keys
from .request import Request, RowPlan, StepPlan
from .sampling import SamplingParams, rejection_sample

__all__ = ["MAX_SPECULATIVE_TOKENS", "MtpDrafter", "check_speculative", "mtp_variant", "speculative_refusal",
           "run_rows"]

# K + 1 <= 16: a verify row stays inside absorbed FIA's 1-16-token multi-token decode envelope (docs/npu.md)
MAX_SPECULATIVE_TOKENS = 15

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


def check_speculative(spec, num_speculative_tokens: int) -> str:
    """The MTP variant of ``spec`` if it can decode speculatively with K drafts; ValueError (one
    sentence) otherwise."""
    k = num_speculative_tokens
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"--num-speculative-tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}] "
                         f"(K + 1 tokens per verify row, at most 16), got {k!r}")
    if spec.pool.write != "off" and spec.pool.policy == "write_back":
        raise ValueError("--speculative mtp does not combine with pool.policy write_back yet: a block's MTP KV "
                         "is saved by the draft run that completes it (use write_through)")
    return mtp_variant(spec)


def speculative_refusal(params: SamplingParams) -> Optional[tuple[str, str]]:
    """``(field, sentence)`` refusing ``params`` under speculative decoding, or None: each of these
    would have to be applied at every verify position against the accepted prefix (not built)."""
    def no(name: str, what: str = ""):
        return name, f"{what or name} is not supported with --speculative mtp (docs/mtp.md)"

    if params.logprobs is not None:
        return no("logprobs")
    if params.structured is not None:
        return no("response_format", "structured output (response_format)")
    for name in ("presence_penalty", "frequency_penalty", "logit_bias", "min_tokens", "bad_words",
                 "allowed_token_ids"):
        if getattr(params, name) not in (0, 0.0, (), None):
            return no(name)
    if params.repetition_penalty != 1.0:
        return no("repetition_penalty")
    return None


class MtpDrafter:
    """The draft and verify halves of speculative decoding for an `EngineCore` (module docstring):
    ``verify`` turns a verify row's logits into the tokens it emits, ``after_step`` keeps each
    request's hidden states and runs the MTP graph for the requests that got tokens: each run a plan
    of the MTP variant submitted through ``runner`` (which makes its save), blocks reserved and
    saves selected through ``scheduler``'s policy."""

    def __init__(self, spec, num_speculative_tokens: int, runner, cache, scheduler):
        self.mtp = check_speculative(spec, num_speculative_tokens)
        self.k = num_speculative_tokens
        self.runner, self.cache, self.scheduler = runner, cache, scheduler
        self.block_size = spec.kv_cache.block_size
        self.target_layers = spec.dims.num_hidden_layers  # cache layers from here on are the MTP layers'
        self.saves = spec.pool.write != "off" and runner.saves(self.mtp)
        self.totals = {"spec_decode_num_draft_tokens": 0, "spec_decode_num_accepted_tokens": 0,
                       "spec_decode_num_accepted_tokens_per_pos": [0] * self.k}

    def stats(self) -> dict:
        """The engine's acceptance totals since start (vLLM's names; per position: a copy)."""
        return {k: list(v) if isinstance(v, list) else v for k, v in self.totals.items()}

    # ---- verify -----------------------------------------------------------------------------
    def verify(self, row: RowPlan, logits: torch.Tensor) -> tuple[int, ...]:
        """The tokens a verify row emits (its ``K' + 1`` logits ``[K'+1, V]``, ``K'`` drafts):
        greedy, the accepted prefix and the target's next token; else rejection sampling."""
        r, drafts = row.request, [int(t) for t in row.token_ids[1:]]
        if r.sampler is None:
            targets = logits.argmax(-1).tolist()
            a = 0
            while a < len(drafts) and drafts[a] == targets[a]:
                a += 1
            emitted = tuple(int(t) for t in targets[:a + 1])
        else:
            target = torch.stack([r.sampler.probs(lg) for lg in logits])
            emitted, a = rejection_sample(target, r.draft_probs[:len(drafts)], drafts, r.sampler.generator)
        res = r.result
        res.num_draft_tokens += len(drafts)
        res.num_accepted_tokens += a
        self.totals["spec_decode_num_draft_tokens"] += len(drafts)
        self.totals["spec_decode_num_accepted_tokens"] += a
        for i in range(a):
            res.accepted_per_pos[i] += 1
            self.totals["spec_decode_num_accepted_tokens_per_pos"][i] += 1
        return tuple(emitted)

    # ---- draft ------------------------------------------------------------------------------
    def after_step(self, plan: StepPlan, tokens: list, hidden_rows: Optional[list], collect_logits: bool) -> None:
        """A step has landed and the scheduler took its ``tokens`` (per row: the tokens taken, or
        None): keep each row's hidden states of final positions, then draft for every request that
        got a token and goes on."""
        if hidden_rows is None:
            raise RuntimeError(f"{plan.variant}: the module returned no hidden state (regenerate: graphgen generate)")
        todo, held = [], []
        for row, tok, h in zip(plan.rows, tokens, hidden_rows):
            r = row.request
            if r.save_hold:  # finished on its first token: one draft run for its prompt blocks' save, no drafts
                if self.saves and len(r.prompt) // self.block_size > r.hit_blocks:
                    held.append(r)
                else:
                    self.scheduler.let_go(r)
            if r.finished and not r.save_hold:
                r.spec_hidden = None
                continue
            taken = 0 if tok is None else len(tok) if isinstance(tok, tuple) else 1
            if row.decode:  # positions start .. start + taken - 1 are verified (their inputs final)
                r.spec_hidden, r.spec_p0 = h[:taken], row.start
            elif r.spec_hidden is None or row.start != r.spec_p0 + len(r.spec_hidden):
                # a prompt or its first chunk (also when recomputed after a preemption)
                r.spec_hidden, r.spec_p0 = h, row.start
            else:  # a later chunk
                r.spec_hidden = torch.cat([r.spec_hidden, h])
            if row.loaded:
                self._load_mtp_layers(row)
            if taken:
                todo.append((r, not row.decode))
        try:
            if todo:
                self._draft(todo, collect_logits)
        finally:
            for r in held:  # their prompt blocks' saves are staged (pinned by the commits): the blocks go back
                r.spec_hidden = None
                self.scheduler.let_go(r)

    def _load_mtp_layers(self, row: RowPlan) -> None:
        """The MTP layers' part of the pool blocks a prefill row loaded, into the cache: the target's
        graphs load their own layers only (their kv_load program), and the next draft run, on this
        thread after the step has landed, is the first to read these."""
        for block, staged in zip(row.load_block_ids, row.loaded):
            for layer in range(self.target_layers, len(staged)):
                for dst, src in zip(self.cache[layer], staged[layer]):
                    dst[block].copy_(src[0])

    def _prompt_save(self, r: Request) -> list[tuple[int, str]]:
        """(block, key) of the prompt's full blocks not loaded from the pool, keyed with their
        successors (``r.seq`` holds the first generated token), as the write policy selects them."""
        first, count = r.hit_blocks, len(r.prompt) // self.block_size
        if not self.saves or count <= first:
            return []
        keys = successor_keys(self.scheduler.loader, r.seq, count, r.lora_salt)
        return self.scheduler.blocks.selected([(r.table[j], keys[j]) for j in range(first, count)])

    def _draft(self, todo: list[tuple[Request, bool]], collect_logits: bool) -> None:
        rows, hidden, plans, save_pairs = [], [], [], []
        for r, after_prompt in todo:
            m = len(r.seq) - 1
            if r.spec_hidden.shape[0] != m - r.spec_p0:
                raise RuntimeError(f"request {r.req_id!r}: {r.spec_hidden.shape[0]} hidden states for draft positions "
                                   f"{r.spec_p0}..{m - 1}")
            # drafts worth verifying (the last token needs none), as many as the blocks allow
            k = 0 if r.finished else min(self.k, r.max_new_tokens - len(r.tokens) - 1)  # finished: the save only
            if k > 1 and not self.scheduler.reserve(r, m + k - 1):
                k = 1  # the recursive runs would write past its blocks: one draft only
            pairs = self._prompt_save(r) if after_prompt else []
            save_pairs += pairs
            r.result.saved_blocks += len(pairs)
            rows.append(RowPlan(r, tuple(r.seq[r.spec_p0 + 1:m + 1]), r.spec_p0, tuple(r.table),
                                logits_positions=(m - r.spec_p0 - 1,), save_block_ids=tuple(b for b, _ in pairs),
                                save_keys=tuple(key for _, key in pairs)))
            hidden.append(r.spec_hidden)
            plans.append((r, k, m))
            r.spec_hidden = None
        logits, g = self._run(rows, torch.cat(hidden))  # the rows carry the prompt blocks' saves
        last = torch.tensor([sum(len(x.token_ids) for x in rows[:i + 1]) - 1 for i in range(len(rows))])
        g = g[last]
        drafts: dict = {id(r): [] for r, _, _ in plans}
        probs: dict = {id(r): [] for r, _, _ in plans}
        for i, (r, k, _) in enumerate(plans):
            if collect_logits:
                r.result.draft_logits.append(logits[i])
            if k > 0:
                self._pick(r, logits[i], drafts, probs)
        for j in range(1, self.k):  # the same MTP layer again, on its own hidden state
            live = [i for i, (_, k, _) in enumerate(plans) if k > j]
            if not live:
                break
            rows = [RowPlan(plans[i][0], (drafts[id(plans[i][0])][-1],), plans[i][2] + j - 1,
                            tuple(plans[i][0].table), logits_positions=(0,)) for i in live]
            logits, gj = self._run(rows, g[live])
            g = g.clone()
            g[live] = gj
            for n, i in enumerate(live):
                self._pick(plans[i][0], logits[n], drafts, probs)
        for r, k, _ in plans:
            r.drafts = tuple(drafts[id(r)])
            r.draft_probs = torch.stack(probs[id(r)]) if probs[id(r)] else None

    def _run(self, rows: list[RowPlan], prev_hidden: torch.Tensor):
        return run_rows(self.runner, self.mtp, rows, prev_hidden=prev_hidden)

    @staticmethod
    def _pick(r: Request, logits: torch.Tensor, drafts: dict, probs: dict) -> None:
        if r.sampler is None:
            drafts[id(r)].append(int(logits.argmax()))
            return
        q = r.sampler.probs(logits)
        drafts[id(r)].append(int(torch.multinomial(q, 1, generator=r.sampler.generator)))
        probs[id(r)].append(q)


def run_rows(runner, variant: str, rows: Sequence[RowPlan], *, prev_hidden: Optional[torch.Tensor] = None):
    """(logits ``[logits positions, V]``, hidden ``[tokens, H]``) of one forward of ``variant`` over
    ``rows`` outside the step loop (the MTP draft runs; tests of single graphs), submitted through
    the runner as a plan of its own: the blocks the rows save (``save_block_ids``/``save_keys``) are
    staged by the graph's save program and committed after its event, as a step's."""
    plan = StepPlan(variant, "decode", tuple(rows), runner.saves(variant), prev_hidden=prev_hidden)
    out = runner.collect(runner.submit(plan))
    if out.hidden is None:
        raise RuntimeError(f"{variant}: the module returned no hidden state (regenerate: graphgen generate)")
    return torch.cat(out.logits), torch.cat(out.hidden)
