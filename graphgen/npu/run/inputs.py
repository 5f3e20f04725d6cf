"""Host-side inputs of generated NPU modules: step inputs, RoPE tables, KV/staging buffers, tiny weights.

Pure torch; no torch_npu needed (tensors are created on ``device``, default CPU).  The field names
and layouts are the contract stated in every generated ``npu/<mode>/<variant>.py`` (``STEP_FIELDS``,
``KV_SHAPES``, ``ROPE``); nothing here was run on an NPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ...families import FAMILIES

# sparse_mode=3 takes a compressed 2048x2048 causal mask (True = masked) whatever the sequence lengths.
MASK_SIZE = 2048
ROPE_CACHE_KEY = "graphgen.rope_cos_sin_cache"  # same key the NPU templates read


@dataclass
class NpuStepInputs:
    input_ids: torch.Tensor          # [T] int64
    positions: torch.Tensor          # [T] int64
    kv_index: torch.Tensor           # [T, 2] int64: (slot // block_size, slot % block_size)
    block_tables: torch.Tensor       # [B, M] int32
    actual_seq_lengths: list         # cumulative query lengths (TND layout), len B
    actual_seq_lengths_kv: list      # seq_lens (history + new tokens), len B
    atten_mask: Optional[torch.Tensor]  # [2048, 2048] bool causal mask (prefill/splitfuse), else None
    logits_indices: torch.Tensor     # [B] int64
    save_block_ids: Optional[torch.Tensor] = None  # [S] int64 blocks to save
    save_rows: Optional[torch.Tensor] = None       # [S, 1] int64 = arange(S): staging rows written
    load_block_ids: Optional[torch.Tensor] = None  # [R] int64 cache blocks the loaded blocks go to
    load_rows: Optional[torch.Tensor] = None       # [R, 1] int64 = load_block_ids as scatter indices
    # [S] int64: every sequence's first seq_len cache rows (block * block_size + offset) packed in
    # sequence order, then pad-block rows (prefill/splitfuse; None for decode).  DeepSeek splitfuse
    # gathers its history latent by these rows (gather_rows).
    kv_gather_rows: Optional[torch.Tensor] = None
    # [T, hidden] the hidden state each MTP row drafts from (the target's at t, or the previous draft's):
    # the MTP graph's input (phase mtp, docs/mtp.md); None for the other graphs
    prev_hidden: Optional[torch.Tensor] = None
    # Multi-LoRA (a module whose STEP_READS has them: docs/lora.md, "NPU"): [T, S] each token's one-hot adapter
    # slot in the compute dtype (base-model and padding tokens: an all-zero row), and the slot stacks by
    # checkpoint weight (graphgen.runtime.lora.slots: {key: (A [S, R, in], B [S, out, R])})
    lora_sel: Optional[torch.Tensor] = None
    lora: Optional[dict] = None


def npu_step_inputs(*, input_ids, positions, slot_mapping, block_tables, seq_lens, query_lens, logits_indices,
                    block_size: int, save_block_ids=None, load_block_ids=None, decode: bool = False, device=None,
                    pad: Optional["StepPadding"] = None, prev_hidden=None,
                    gather: Optional[bool] = None) -> NpuStepInputs:
    """NPU step inputs from the CPU runtime's (design.md) host quantities.

    ``pad`` (a :class:`StepPadding`) pads the step to a shape bucket so every tensor has a static
    shape per bucket (graphgen.npu.run.bucketing): padding sequences are appended whose tokens write and
    read only the reserved ``pad.pad_block``; block tables get ``pad.max_blocks`` columns (filled with
    the pad block), saves and loads ``pad.save_rows`` rows each (the pad block repeated: a padding
    load row scatters a zero block into the pad block).  ``gather``: build ``kv_gather_rows`` (S ints per
    step, audit 3 N9: only a module whose ``STEP_READS`` has it reads them); None: for every non-decode step."""
    if pad is not None:
        (input_ids, positions, slot_mapping, block_tables, seq_lens, query_lens, logits_indices,
         save_block_ids) = pad.apply(input_ids, positions, slot_mapping, block_tables, seq_lens, query_lens,
                                     logits_indices, save_block_ids, block_size)
        load_block_ids = None if load_block_ids is None else pad.rows(load_block_ids, "load")
    dev = device or torch.device("cpu")
    gather = None if (decode if gather is None else not gather) else gather_rows(
        block_tables, seq_lens, block_size, pad.gather_rows(block_size) if pad is not None else None,
        pad.pad_block if pad is not None else 0)
    slots = torch.as_tensor(slot_mapping, dtype=torch.int64)
    ql = [int(x) for x in torch.as_tensor(query_lens).tolist()]
    cum = [sum(ql[:i + 1]) for i in range(len(ql))]
    save = None if save_block_ids is None else torch.as_tensor(save_block_ids, dtype=torch.int64)
    load = None if load_block_ids is None else torch.as_tensor(load_block_ids, dtype=torch.int64).view(-1)
    return NpuStepInputs(
        input_ids=torch.as_tensor(input_ids, dtype=torch.int64).to(dev),
        positions=torch.as_tensor(positions, dtype=torch.int64).to(dev),
        kv_index=torch.stack((slots // block_size, slots % block_size), dim=-1).to(dev),
        block_tables=torch.as_tensor(block_tables, dtype=torch.int32).to(dev),
        actual_seq_lengths=cum,
        actual_seq_lengths_kv=[int(x) for x in torch.as_tensor(seq_lens).tolist()],
        # decode rows of one token need no mask (sparse_mode 0); a speculative verify row (k + 1 tokens over
        # its history) is causal inside the row: sparse_mode 3 with the mask, as prefill
        atten_mask=None if decode and max(ql, default=1) == 1 else causal_mask(dev),
        logits_indices=torch.as_tensor(logits_indices, dtype=torch.int64).to(dev),
        save_block_ids=None if save is None else save.to(dev),
        save_rows=None if save is None else torch.arange(save.numel(), dtype=torch.int64).view(-1, 1).to(dev),
        load_block_ids=None if load is None else load.to(dev),
        load_rows=None if load is None else load.view(-1, 1).to(dev),
        kv_gather_rows=None if gather is None else torch.as_tensor(gather, dtype=torch.int64).to(dev),
        prev_hidden=None if prev_hidden is None else prev_hidden.to(dev),
    )


_MASKS: dict[str, torch.Tensor] = {}


def causal_mask(device=None) -> torch.Tensor:
    """The compressed causal mask of ``sparse_mode=3`` (``[2048, 2048]`` bool, True above the
    diagonal), built once per device and shared by every step and bucket (audit 2 row 15a: it was
    built on the host and copied to the device every prefill step). Read-only: no graph writes it."""
    key = str(torch.device(device) if device is not None else torch.device("cpu"))
    mask = _MASKS.get(key)
    if mask is None:
        mask = _MASKS.setdefault(key, torch.triu(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool), 1).to(key))
    return mask


def gather_rows(block_tables, seq_lens, block_size: int, rows: Optional[int] = None, pad_block: int = 0):
    """The packed history row order on the host, which knows the lengths (an int64 tensor): for each
    sequence its first seq_len rows of the paged cache (``table[p // block_size] * block_size + p %
    block_size``), in sequence order, then ``rows - sum(seq_lens)`` rows of ``pad_block`` (never read:
    the attention stops at the cumulative KV lengths).  ``rows`` None: exactly sum(seq_lens)."""
    lens = [int(n) for n in torch.as_tensor(seq_lens).tolist()]
    total = sum(lens)
    if rows is not None and total > rows:
        raise ValueError(f"{total} KV rows (sum of seq_lens) exceed the bucket's {rows} gather rows")
    parts = []
    for table, n in zip(block_tables, lens):  # vectorised per sequence: no Python loop over the S rows
        p = torch.arange(n)
        parts.append(torch.as_tensor(table, dtype=torch.int64)[p // block_size] * block_size + p % block_size)
    if rows is not None:
        parts.append(torch.full((rows - total,), pad_block * block_size, dtype=torch.int64))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


@dataclass(frozen=True)
class StepPadding:
    """Pad one step to a bucket: ``batch`` sequences, ``tokens`` tokens, ``max_blocks`` table columns.

    Padding sequences (``batch - B`` of them, at least one token each; the first takes the surplus
    tokens) have no history: kv_len = q_len, every table entry and every slot in ``pad_block``, a block
    the caller reserves and never hands to a real sequence.  So padding never touches a real block,
    keeps ``actual_seq_lengths_kv >= q_len`` (sparse_mode 3) and stays inside the kernels' limits."""

    batch: int
    tokens: int
    max_blocks: int
    pad_block: int
    save_rows: int = 0

    def apply(self, ids, pos, slots, tables, seq_lens, qlens, logit_idx, save, bs):
        ids, pos, slots = list(ids), list(pos), list(slots)
        tables = [list(t) + [self.pad_block] * (self.max_blocks - len(t)) for t in tables]
        seq_lens, qlens, logit_idx = list(seq_lens), [int(q) for q in qlens], list(logit_idx)
        n_pad_seqs, n_pad_tokens = self.batch - len(qlens), self.tokens - len(ids)
        if n_pad_seqs < 0 or any(len(t) > self.max_blocks for t in tables):
            raise ValueError(f"step does not fit the bucket (batch {len(qlens)} > {self.batch} or a table is "
                             f"longer than {self.max_blocks} blocks)")
        if (n_pad_seqs == 0) != (n_pad_tokens == 0) or n_pad_tokens < n_pad_seqs:
            raise ValueError(f"bucket (batch {self.batch}, tokens {self.tokens}) cannot pad a step of "
                             f"{len(qlens)} sequences / {len(ids)} tokens: each padding sequence needs a token")
        for i in range(n_pad_seqs):
            q = n_pad_tokens - (n_pad_seqs - 1) if i == 0 else 1
            if (q + bs - 1) // bs > self.max_blocks:
                raise ValueError(f"padding sequence of {q} tokens needs more than {self.max_blocks} blocks")
            ids += [0] * q
            pos += list(range(q))
            slots += [self.pad_block * bs + p % bs for p in range(q)]
            tables.append([self.pad_block] * self.max_blocks)
            seq_lens.append(q)
            qlens.append(q)
            logit_idx.append(len(ids) - 1)
        if save is not None:
            save = self.rows(save, "save")
        return ids, pos, slots, tables, seq_lens, qlens, logit_idx, save

    def gather_rows(self, block_size: int) -> int:
        """Static length of ``kv_gather_rows`` for this bucket: ``(batch - 1) * max_blocks * block_size
        + tokens``.  A prefill/splitfuse bucket always has a padding sequence (batch = prefill_seqs + 1)
        and padding sequences have no history (kv_len = q_len), so the real sequences hold at most
        batch - 1 full tables and the padding at most ``tokens`` rows: fewer rows to up-project than
        ``batch * max_blocks * block_size``, and still one shape per bucket."""
        return (self.batch - 1) * self.max_blocks * block_size + self.tokens

    def rows(self, blocks, what: str) -> list:
        """Save or load block ids padded to ``save_rows`` rows with the pad block."""
        blocks = [int(b) for b in blocks]
        if len(blocks) > self.save_rows:
            raise ValueError(f"{len(blocks)} blocks to {what} > {self.save_rows} staging rows")
        return blocks + [self.pad_block] * (self.save_rows - len(blocks))


@dataclass(frozen=True)
class UniformPadding(StepPadding):
    """`StepPadding` for the decode module's verify steps (speculative decoding, docs/mtp.md): every sequence
    ``per_row`` tokens (its attention takes S = T / B query tokens a row), padding sequences included; every
    token's logits (``tokens`` rows, static per bucket)."""
    per_row: int = 1

    def apply(self, ids, pos, slots, tables, seq_lens, qlens, logit_idx, save, bs):
        ids, pos, slots, logit_idx = list(ids), list(pos), list(slots), list(logit_idx)
        tables = [list(t) + [self.pad_block] * (self.max_blocks - len(t)) for t in tables]
        seq_lens, qlens = list(seq_lens), [int(q) for q in qlens]
        if len(qlens) > self.batch or any(q != self.per_row for q in qlens) or any(len(t) > self.max_blocks
                                                                                 for t in tables):
            raise ValueError(f"a verify step of {len(qlens)} rows does not fit the bucket (batch {self.batch}, "
                             f"{self.per_row} tokens a row, {self.max_blocks} blocks)")
        for _ in range(self.batch - len(qlens)):
            q = self.per_row
            ids += [0] * q
            pos += list(range(q))
            slots += [self.pad_block * bs + p % bs for p in range(q)]
            tables.append([self.pad_block] * self.max_blocks)
            seq_lens.append(q)
            qlens.append(q)
        logit_idx = logit_idx + list(range(len(logit_idx), len(ids)))
        if save is not None:
            save = self.rows(save, "save")
        return ids, pos, slots, tables, seq_lens, qlens, logit_idx, save


def rope_cache(rope: dict, max_positions: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """``[max_positions, 2 * rot_dim]`` = cat(cos, sin), laid out as the CPU reference (cat(freqs, freqs))."""
    pos = torch.arange(max_positions)
    if rope.get("scaling") is None:
        rot, theta = int(rope["rot_dim"]), float(rope["theta"])
        inv = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.int64).float() / rot))
        freqs = pos.float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
    else:  # YaRN etc.: the CPU reference op owns those formulas
        from graphgen.runtime.core.ops import rope_cos_sin

        cos, sin = rope_cos_sin(pos, rot_dim=rope["rot_dim"], theta=rope["theta"], scaling=rope["scaling"])
    return torch.cat((cos, sin), dim=-1).to(device=device, dtype=dtype)


def kv_buffers(module, num_layers: int, num_blocks: int, staging_rows: int = 0, device=None):
    """(kv, staging) per the generated module's KV_SHAPES / KV_DTYPE; staging is () when staging_rows == 0."""
    dtype = getattr(torch, module.KV_DTYPE)
    kv = [tuple(torch.zeros(num_blocks, *s, dtype=dtype, device=device) for s in module.KV_SHAPES)
          for _ in range(num_layers)]
    staging = [tuple(torch.zeros(staging_rows, *s, dtype=dtype, device=device) for s in module.KV_SHAPES)
               for _ in range(num_layers)] if staging_rows else []
    return kv, staging


def load_buffers(module, num_layers: int, rows: int, device=None):
    """Load staging per the module's KV_SHAPES: loads[L][i] is [rows, *KV_SHAPES[i]] (zeros: the
    host fills them from the pool); () for a module without history (no kv_load)."""
    if not module.META.get("history"):
        return ()
    dtype = getattr(torch, module.KV_DTYPE)
    return [tuple(torch.zeros(rows, *s, dtype=dtype, device=device) for s in module.KV_SHAPES)
            for _ in range(num_layers)]


def random_weights(spec, seed: int = 0, scale: float = 0.05, rope: Optional[dict] = None,
                   max_positions: int = 64) -> dict[str, torch.Tensor]:
    """Small random weights keyed by checkpoint name (experts stacked, as the CPU loader does), in the
    spec's dtype as a checkpoint of that dtype loads (the family's float32 keys -- MoE routers -- stay
    float32, as transformers keeps them), plus the RoPE table under ROPE_CACHE_KEY in the dtype the
    module's ROPE declares when ``rope`` (a generated module's ROPE) is given.  Tiny specs only."""
    g = torch.Generator().manual_seed(seed)
    # the family's checkpoint layout, experts stacked; zero-size weights (n_shared_experts: 0) are absent
    mtp = {"mtp_layers": spec.mtp.num_layers} if getattr(spec, "mtp", None) is not None else {}  # + its MTP layers
    shapes = {k: s for k, s in FAMILIES[spec.family].checkpoint_layout(spec.dims, stacked=True, **mtp).items()
              if 0 not in s}
    W = {}
    for k, s in shapes.items():
        if len(s) == 1 and not k.endswith("bias"):  # norm gains around 1
            W[k] = 1.0 + 0.1 * torch.randn(s, generator=g)
        else:
            W[k] = torch.randn(s, generator=g) * scale
    dtype, keep = getattr(torch, spec.kv_cache.dtype), FAMILIES[spec.family].fp32_suffixes
    W = {k: (w if k.endswith(keep) else w.to(dtype)) for k, w in W.items()}
    if rope is not None:
        W[ROPE_CACHE_KEY] = rope_cache(rope, max_positions, dtype=getattr(torch, rope.get("dtype", "float32")))
    return W


def tiny_step(module, spec, seqs: Sequence[tuple[int, int]], num_blocks: int, seed: int = 0):
    """Step inputs for sequences given as (history_len, new_tokens): blocks assigned in order.

    Shapes only matter for structure tests; the save (saving variants) gathers every block the step uses."""
    g = torch.Generator().manual_seed(seed)
    bs = spec.kv_cache.block_size
    decode = module.META["phase"] == "decode"
    ids, pos, slots, tables, seq_lens, qlens, logit_idx = [], [], [], [], [], [], []
    next_block, t = 0, 0
    max_blocks = max((h + q + bs - 1) // bs for h, q in seqs)
    for hist, q in seqs:
        n = (hist + q + bs - 1) // bs
        table = list(range(next_block, next_block + n))
        next_block += n
        for p in range(hist, hist + q):
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
        ids += torch.randint(0, spec.dims.vocab_size, (q,), generator=g).tolist()
        tables.append(table + [0] * (max_blocks - n))
        seq_lens.append(hist + q)
        qlens.append(q)
        t += q
        logit_idx.append(t - 1)
    if next_block > num_blocks:
        raise ValueError("num_blocks too small for these sequences")
    saves = module.META.get("saves")
    # history variants load each sequence's full history blocks (load_buffers(module, L, len) fills them)
    loads = [b for (hist, _), t in zip(seqs, tables) for b in t[:hist // bs]] if module.META.get("history") else None
    b = npu_step_inputs(input_ids=ids, positions=pos, slot_mapping=slots, block_tables=tables, seq_lens=seq_lens,
                        query_lens=qlens, logits_indices=logit_idx, block_size=bs,
                        save_block_ids=list(range(next_block)) if saves else None, load_block_ids=loads,
                        decode=decode)
    if "lora_sel" in getattr(module, "STEP_READS", ()):  # no token selects an adapter: zero slots
        from .lora import add_lora_inputs, zero_slots

        add_lora_inputs(b, [], zero_slots(spec))
    return b
