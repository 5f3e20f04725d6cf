"""The NPU graphs' activation and workspace memory, per rank, from the shapes their inputs fix (audit 4 M5).

Pure Python, no torch: `graphgen validate`, ``import-hf --fit`` and ``graphgen dry-run`` count the same bytes
(`graphgen.passes.memory.RankMemory`'s ``activations`` part; the dry run holds them on its ledger).

Every warm-up graph runs once (`graphgen.npu.run.warmup`), so the rank's peak is the largest graph's peak on
top of the weights and the KV cache. One decoder layer's intermediates are alive at a time (each layer's are
freed before the next; GE's feature memory is sized by its largest graph and reused, largest first:
audit 3 N12), so a graph's peak is modelled as the hidden-sized tensors every layer keeps (residual, normed
input, attention output: 3 x [T, H]) plus the larger of its attention and its FFN intermediates (attention's
counted whole; the MoE's by liveness, below). The sizes, for T tokens on this rank:

* **attention**, GQA: q/k/v [T, (Nq + 2 Nkv) D / tp] and the output [T, Nq D / tp]. MLA: q [T, Nh/tp (nope +
  rope)] twice (projected, absorbed), and on a prefill graph the up-projection of every KV row it attends to,
  ``S`` = T (no history) or the bucket's gather rows (history: ``(batch - 1) max_blocks block_size + T``,
  `graphgen.npu.run.inputs.StepPadding.gather_rows`): kv_b's output [S, Nh/tp (nope + v)], K [S, Nh/tp (nope +
  rope)] and V [S, Nh/tp v]. Decode attends to the latent cache: no up-projection.
* **dense MLP**: gate_up [T, 2 I / tp] and its activation [T, I / tp].
* **MoE**: the routed rows ``R = G x top_k``, ``G`` = T x dp under DP attention (the tokens every DP group
  gathers), else T, through expanded_x [R, H], its int8 copy under W8A8 [R, H] bytes, GMM1 [R, 2 I_moe], the
  activation [R, I_moe], GMM2 [R, H], and finalize's ``zeros_like`` + ``where`` 2 x [R, H] (audit 4 §2d: 65,536
  rows on the 2-node spec): here by liveness, the largest set alive at one step (an op's inputs freed after
  their last use), not their sum: GMM2's output with the zeros and the where, 3 x [R, H], on DeepSeek.

The graphs are the warm-up's (`graphgen.dryrun.rank.graph_list`): decode buckets, prefill buckets (batch
``prefill_seqs + 1``) and, on a history prefill variant of a layout that runs them (not under DP), the mixed
cells (batch ``D + prefill_seqs + 1``). `allocator_reserve_bytes` is the caching allocator's rounding and
fragmentation (no ``expandable_segments``), kept free on top.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from ..modelspec.model import ModelSpec

__all__ = ["ALLOCATOR_RESERVE_FRACTION", "allocator_reserve_bytes", "GraphActivation", "graph_activations", "peak_activation", "gather_rows"]

GIB = 1 << 30
# audit 4 §2d: allocator rounding and fragmentation 0.3-1 GiB of the 60.97 GiB torch sees, without
# PYTORCH_NPU_ALLOC_CONF=expandable_segments ([inference], not measured): 1.5 % of what torch sees (0.91 GiB
# there; it scales with the allocations), until the first hardware run measures it (docs/npu.md checklist)
ALLOCATOR_RESERVE_FRACTION = 0.015


def allocator_reserve_bytes(visible_bytes: Optional[int]) -> int:
    """The allocator reserve of a device whose torch-visible memory is ``visible_bytes`` (None: 0)."""
    return 0 if visible_bytes is None else int(ALLOCATOR_RESERVE_FRACTION * visible_bytes)
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class GraphActivation:
    """One warm-up graph's modelled peak: ``what`` names it and its largest part."""
    graph: str
    tokens: int
    batch: int
    bytes: int
    largest: str


def gather_rows(batch: int, tokens: int, max_blocks: int, block_size: int) -> int:
    """`StepPadding.gather_rows`, restated torch-free (a test ties the two)."""
    return (batch - 1) * max_blocks * block_size + tokens


def max_model_len(spec: "ModelSpec") -> int:
    """The NPU target's ``max_model_len``, or its default: the default of
    `graphgen.npu.run.bucketing.max_model_len` (not imported: it is torch-side)."""
    npu = spec.targets.npu
    declared: Optional[int] = npu.max_model_len if npu is not None else None
    return declared or min(4096, int(getattr(spec.dims, "max_position_embeddings", 4096)))


def _one(spec: "ModelSpec", phase: str, history: bool, tokens: int, batch: int) -> tuple[int, str]:
    d: Any = spec.dims  # a family's dims (Qwen3 or DeepSeek-V3): the fields are read where the family has them
    par = spec.parallel
    npu = spec.targets.npu
    size = ITEMSIZE[npu.dtype if npu is not None else spec.kv_cache.dtype]
    tp, dp = par.tp, par.dp
    H, T = d.hidden_size, tokens
    base = 3 * T * H * size
    mla = getattr(d, "kv_lora_rank", None) is not None
    if mla:
        nh = -(-d.num_attention_heads // tp)
        nope, rope, v = d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim
        attn = 2 * T * nh * (nope + rope) * size
        if phase == "prefill":
            bs = spec.kv_cache.block_size
            S = gather_rows(batch, T, -(-max_model_len(spec) // bs), bs) if history else T
            attn += S * nh * ((nope + v) + (nope + rope) + v) * size
    else:
        nq, nkv = -(-d.num_attention_heads // tp), -(-d.num_key_value_heads // tp)
        attn = T * (2 * nq + 2 * nkv) * d.head_dim * size
    inter = -(-d.intermediate_size // tp)
    ffn, ffn_what = 3 * T * inter * size, "dense MLP"
    if getattr(d, "n_routed_experts", 0):
        rows = T * (dp if dp > 1 else 1) * d.num_experts_per_tok
        q = 1 if spec.quantization.method == "w8a8_dynamic" else 0  # the int8 copies (bytes per element)
        I = d.moe_intermediate_size
        # what is alive at each step of the routed path, an op's inputs freed after their last use (eager;
        # GE plans its feature memory by the same liveness): init_routing's expanded_x and its int8 copy; the
        # int8 copy and GMM1's gate_up; gate_up and the activation (and its int8 copy); that and GMM2's output;
        # GMM2's output, finalize's zeros_like and the where over them
        moe = rows * max(H * (size + q), H * q + 2 * I * size, 2 * I * size + I * (size + q), I * (size + q) + H * size,
                         3 * H * size)
        if moe > ffn:
            ffn, ffn_what = moe, f"MoE over {rows} routed rows"
    if attn >= ffn:
        return base + attn, "attention" + (" (history up-projection)" if mla and phase == "prefill" else "")
    return base + ffn, ffn_what


def graph_activations(spec: "ModelSpec") -> list[GraphActivation]:
    """One `GraphActivation` per warm-up graph of ``spec``'s NPU target (none without one)."""
    npu = spec.targets.npu
    if npu is None:
        return []
    out = []
    for name, v in spec.variants.items():
        phase = str(getattr(v.phase, "value", v.phase))
        if phase != "prefill":  # decode (and MTP/verify rows: a few per sequence)
            for b in npu.decode_batch_buckets:
                n, what = _one(spec, "decode", False, b, b)
                out.append(GraphActivation(f"{name} batch={b}", b, b, n, what))
            continue
        shapes = [(t, npu.prefill_seqs + 1, "") for t in npu.prefill_token_buckets]
        if v.history and spec.parallel.dp == 1:  # the mixed cells (DP runs none: warmup.runs_mixed_cells)
            shapes += [(t, dr + npu.prefill_seqs + 1, f" mixed decode_rows={dr}") for dr in npu.decode_batch_buckets
                       for t in npu.prefill_token_buckets if t >= dr + npu.prefill_seqs + 1]
        for t, batch, cell in shapes:
            n, what = _one(spec, "prefill", bool(v.history), t, batch)
            out.append(GraphActivation(f"{name}{cell} tokens={t}", t, batch, n, what))
    return out


def peak_activation(spec: "ModelSpec") -> Optional[GraphActivation]:
    """The warm-up graph with the largest modelled peak (None: no NPU target)."""
    acts = graph_activations(spec)
    return max(acts, key=lambda a: a.bytes) if acts else None
