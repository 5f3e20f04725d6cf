"""Per-rank device memory of a spec's layout, as a launch lays it out, for ``graphgen validate`` and
``graphgen import-hf --fit``. Pure Python, no torch.

What one rank holds, in the order a launch allocates it (`graphgen.runtime.engine.assembly.build_engine`):

* the **weights**: the sharded graphs' weight names (each rank's chunk, padded chunks whole) in the
  target's dtype, the family's float32 keys in float32, plus the RoPE table; under W8A8 (`graphgen.ir.quant`)
  the linear layers' weights one byte each plus one scale per output channel. The load-time weights are
  placed straight into their final tensors (`graphgen.runtime.checkpoint.plan`), so the only **load
  transient** is one slice copied into a non-contiguous view (an expert of a transposed expert stack, or
  under W8A8 any transposed int8 weight);
* the **communicator buffers** of its collectives (HCCL: two buffers per communicator);
* the **KV cache**: at least the blocks the largest decode batch needs at ``max_model_len``
  (`kv_blocks_needed`); a launch allocates the engine's default (`DEFAULT_NUM_BLOCKS` + the NPU's padding
  block) or, with ``--device-memory-utilization``, what is left (`RankMemory.auto_blocks`, the rule of
  `graphgen.runtime.core.device_memory.kv_blocks_that_fit`);
* the **staging rings** (``staging_buffers`` × ``save_rows`` blocks, on the device and pinned on the host).

Summed (`RankMemory.per_rank_bytes`, the one per-rank figure every message prints: its parts are
`RankMemory.per_rank_parts`), it fits when it stays within ``utilization`` × the memory the device gives torch (vLLM's
``gpu_memory_utilization`` rule over ``mem_get_info``'s total: the device less what its runtime keeps);
the rest, the **workspace reserve**, is the runtime's own and the headroom for the graphs' workspace
and fragmentation (`NPU_MEMORY`, with its sources). The host side while loading is the largest stored
slice plus one read block (`graphgen.runtime.checkpoint.stream`) and the pinned ring; a slice the loader
dequantizes (FP8) or quantizes (W8A8) also has its float32 temporaries on the host
(`HOST_BYTES_PER_CONVERTED_ELEMENT`). ``graphgen dry-run`` measures the same quantities on a ledger device
(docs/npu.md, "Full-size launch").
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional

from ..families import FAMILIES
from ..families.parallel import PLANS, rank_kv_components
from ..ir.quant import linear_weight_names, quantized_weight_names, scale_dtype
from ..ir.weights import graph_weight_names, parse_shard
from .activations import max_model_len as _max_len

if TYPE_CHECKING:
    from ..ir.graph import Graph
    from ..modelspec.import_hf import LayoutPick
    from ..modelspec.model import ModelSpec, NpuTarget

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
GIB = 1 << 30
MIB = 1 << 20
DEFAULT_NUM_BLOCKS = 512          # graphgen run/serve --num-blocks (graphgen.engine_args)
READ_BLOCK_BYTES = 64 << 20       # graphgen.runtime.checkpoint.stream.READ_BLOCK_BYTES (not imported: torch-side)
# host bytes per element of a slice the loader converts (FP8 dequantized, or W8A8 quantized): the float32
# slice, its block scales expanded to it (dequantize_blocks) or the quantization's float32 temporaries
# (quantize_rows: |w|, then w / scale rounded), two of them alive at once, plus the int8 result
HOST_BYTES_PER_CONVERTED_ELEMENT = 4 * 3 + 1


@dataclass(frozen=True)
class TargetMemory:
    """A target's device memory facts, each with its source (docs/npu.md, "Full-size launch")."""
    device_memory_gib: float   # the default device when a spec declares none
    runtime_gib: float         # kept by the device's runtime: torch never sees it
    communicator_mib: float    # per collective communicator (HCCL: send + receive buffers)
    utilization: float         # the engine's share of what torch sees; the rest is workspace headroom
    source: str


NPU_MEMORY = TargetMemory(
    device_memory_gib=64.0, runtime_gib=64.0 - 60.97, communicator_mib=2 * 200, utilization=0.9,
    source="64 GiB HBM per Atlas A2/A3 die, of which torch_npu reports 60.97 GiB total capacity (its OOM "
           "message, vllm-ascend issues #19 and #5020): 3.03 GiB held by the runtime; HCCL takes 2 x HCCL_BUFFSIZE "
           "(default 200 MB) per communicator (CANN environment variable reference, HCCL_BUFFSIZE); the engine "
           "uses 0.9 of the 60.97 GiB (54.87 GiB), vLLM's and vllm-ascend's default gpu_memory_utilization over "
           "mem_get_info's total; the workspace reserve, 9.13 GiB, is the runtime's 3.03 GiB and 6.10 GiB of "
           "headroom for graph workspace and fragmentation")


def _size(n: int) -> str:
    if n >= GIB / 10:
        return f"{n / GIB:.2f} GiB"
    return f"{n / MIB:.2f} MiB" if n >= MIB / 10 or n == 0 else f"{n / 1024:.2f} KiB"


@dataclass(frozen=True)
class RankMemory:
    """One rank of a layout (the largest: padded chunks count whole). Bytes unless named otherwise.

    `per_rank_bytes` is the one figure compared with the device's share (`budget_bytes`): the sum of
    `per_rank_parts`, each part named; a new kind of memory (activations, issue 36) is a part there, and
    every figure validate, ``--fit`` and the fix sentences print follows."""
    tp: int
    ep: int
    weight_bytes: int          # the device's weights (RoPE table included)
    kv_bytes_per_block: int    # one block, all layers
    kv_blocks: int = 0         # blocks counted: what the largest decode batch needs at max_model_len, or --num-blocks
    dp: int = 1
    cp: int = 1
    default_blocks: int = DEFAULT_NUM_BLOCKS + 1   # a launch's (--num-blocks, default 512, + the NPU's padding block)
    ring_bytes: int = 0        # device staging ring (the pinned host ring is as large)
    transient_bytes: int = 0   # the load transient (one slice copied into a non-contiguous view)
    largest_slice: int = 0     # the largest stored slice (the host read buffer) and its conversion's temporaries
    comm_bytes: int = 0        # communicator buffers
    runtime_bytes: int = 0     # kept by the device's runtime (torch sees the device less this)
    device_bytes: Optional[int] = None   # the device (None: no budget)
    utilization: float = 1.0
    blocks_asked: bool = False  # kv_blocks is --num-blocks (+ padding), not the decode batch's need
    activation_bytes: int = 0  # the largest warm-up graph's activations and workspace (graphgen.passes.activations)
    reserve_bytes: int = 0     # the caching allocator's rounding and fragmentation (allocator_reserve_bytes)

    def per_rank_parts(self, blocks: Optional[int] = None) -> tuple[tuple[str, int], ...]:
        """(name, bytes) of what one rank holds at its peak with ``blocks`` KV blocks (default `kv_blocks`,
        at least one): the weights, the KV cache, and what a launch adds around them."""
        n = max(self.kv_blocks if blocks is None else blocks, 1)
        return (("weights", self.weight_bytes), ("KV", n * self.kv_bytes_per_block), ("staging rings", self.ring_bytes),
                ("communicators", self.comm_bytes), ("load transient", self.transient_bytes),
                ("activations", self.activation_bytes), ("allocator reserve", self.reserve_bytes))

    def per_rank_bytes(self, blocks: Optional[int] = None) -> int:
        """The per-rank figure: `per_rank_parts` summed (what `fits` compares with `budget_bytes`)."""
        return sum(n for _, n in self.per_rank_parts(blocks))

    @property
    def fixed_bytes(self) -> int:
        """Everything of `per_rank_bytes` but the KV cache."""
        return sum(n for name, n in self.per_rank_parts() if name != "KV")

    @property
    def launch_peak_bytes(self) -> int:
        """`per_rank_bytes` at a launch's KV blocks (`default_blocks`): the peak ``graphgen dry-run`` measures."""
        return self.per_rank_bytes(self.default_blocks)

    @property
    def host_load_bytes(self) -> int:
        """Host memory the loader holds (its read buffer: the largest slice + a read block) + the pinned ring."""
        return self.largest_slice + READ_BLOCK_BYTES + self.ring_bytes

    @property
    def visible_bytes(self) -> Optional[int]:
        """What the device gives torch (``mem_get_info``'s total; the ledger's capacity)."""
        return None if self.device_bytes is None else self.device_bytes - self.runtime_bytes

    @property
    def budget_bytes(self) -> Optional[int]:
        """The device's share the engine may use (``utilization`` x what torch sees)."""
        visible = self.visible_bytes
        return None if visible is None else int(self.utilization * visible)

    def auto_blocks(self) -> Optional[int]:
        """KV blocks a launch with ``--device-memory-utilization`` would allocate (None: no budget)."""
        if self.budget_bytes is None:
            return None
        return max(0, (self.budget_bytes - self.fixed_bytes) // self.kv_bytes_per_block)

    def fits(self) -> bool:
        b = self.budget_bytes
        return b is None or self.per_rank_bytes() <= b

    def layout(self) -> str:
        return f"tp={self.tp}, ep={self.ep}" + "".join(f", {k}={v}" for k, v in (("dp", self.dp), ("cp", self.cp))
                                                      if v > 1)

    def blocks_what(self) -> str:
        if self.blocks_asked:
            return "blocks a launch with --num-blocks allocates"
        return "blocks for the largest decode batch"

    def parts_text(self) -> str:
        """``weights X + KV Y (N blocks ..., B each) + ...``: the parts of `per_rank_bytes` (those not zero)."""
        out = []
        for name, n in self.per_rank_parts():
            if name == "KV":
                out.append(f"KV {_size(n)} ({max(self.kv_blocks, 1)} {self.blocks_what()}, "
                           f"{_size(self.kv_bytes_per_block)} each)")
            elif n or name == "weights":
                out.append(f"{name} {_size(n)}")
        return " + ".join(out)

    def text(self) -> str:
        budget, visible, device = self.budget_bytes, self.visible_bytes, self.device_bytes
        of = "" if budget is None else f" of {_size(budget)}"
        out = f"per rank ({self.layout()}): {_size(self.per_rank_bytes())}{of} = {self.parts_text()}"
        if device is None or visible is None or budget is None:
            return out
        launch = "" if self.blocks_asked else (
            f"; a launch at the default {self.default_blocks} KV blocks peaks at {_size(self.launch_peak_bytes)} "
            f"(graphgen dry-run's device peak)")
        return (out + f" ({self.utilization:g} x the {_size(visible)} torch sees of {device / GIB:g} GiB: workspace "
                f"reserve {_size(device - budget)}){launch}; KV sized from what is left "
                f"(--device-memory-utilization {self.utilization:g}): {self.auto_blocks()} blocks; host while loading "
                f"{_size(self.host_load_bytes)}")


def kv_blocks_needed(spec: ModelSpec) -> int:
    """Blocks one rank holds for the NPU target's largest decode batch at its max_model_len (the target's
    defaults when the spec has no NPU target): every DP group has a batch of its own, and KV is replicated
    over the CP and TP ranks (the MLA latent) or split by KV heads, so the count is per rank either way."""
    npu = _npu(spec)
    return npu.decode_batch_buckets[-1] * math.ceil(_max_len(spec) / spec.kv_cache.block_size)


def _npu(spec: ModelSpec) -> NpuTarget:
    from ..modelspec.model import NpuTarget

    return spec.targets.npu or NpuTarget()




def communicator_bytes(par: Any) -> int:
    """Device bytes of the collective communicators a rank joins (``NPU_MEMORY.communicator_mib`` each):
    the world's, and each named group (tp, dp, cp) of its own."""
    n = 0 if par.world == 1 else 1 + sum(1 for k in (par.tp, par.dp, par.cp) if 1 < k < par.world)
    return int(n * NPU_MEMORY.communicator_mib * MIB)


def rank_memory(spec: ModelSpec, graphs: Iterable[Graph], device_memory_gib: Optional[float] = None, *,
                utilization: Optional[float] = None, num_blocks: Optional[int] = None) -> RankMemory:
    """``graphs``: the spec's graphs after ``shard`` (every variant reads the same weights; the union
    is counted once). ``device_memory_gib``: the device (default: ``targets.npu.device_memory_gib``, else
    the NPU target's documented default for a spec with an NPU target; no budget without one);
    ``utilization``: the engine's share of it (default `NPU_MEMORY`'s 0.9); ``num_blocks``: count the KV
    cache a launch with ``--num-blocks`` allocates (+ the NPU's padding block) instead of the largest decode
    batch's need."""
    fam = FAMILIES[spec.family]
    mtp = {"mtp_layers": spec.mtp_layers} if spec.mtp_layers else {}
    stacked = fam.checkpoint_layout(fam.dims_of(spec.dims), stacked=True, **mtp)
    npu = spec.targets.npu
    compute = npu.dtype if npu is not None else spec.kv_cache.dtype
    size = ITEMSIZE[compute]
    stored = ITEMSIZE[spec.kv_cache.dtype]  # the specs' checkpoints are stored in the KV cache's dtype
    graphs = list(graphs)
    int8, linear = quantized_weight_names(graphs), linear_weight_names(graphs)
    fp8 = spec.quantization.checkpoint is not None  # the linear layers stored one byte each, and MLA's kv_b_proj
    weight_bytes = largest = transient = 0
    for name in sorted(graph_weight_names(graphs)):
        key, dim, parts = parse_shard(name)
        shape = list(stacked[key])
        if dim is not None:
            shape[dim] = math.ceil(shape[dim] / parts)
        expert = key.endswith(("experts.gate_proj.weight", "experts.up_proj.weight", "experts.down_proj.weight"))
        piece = math.prod(shape[1:] if expert else shape)  # an expert is stored (and read) one by one
        if name in int8:  # int8 + one scale per output channel (all dims but the input's)
            weight_bytes += math.prod(shape) + math.prod(shape[:-1]) * ITEMSIZE[scale_dtype(compute)]
            transient = max(transient, piece)  # copied into a transposed view through a temporary
        else:
            weight_bytes += math.prod(shape) * (4 if fam.fp32_suffixes and key.endswith(fam.fp32_suffixes) else size)
            if expert:  # copied into the transposed stack's view: through a temporary on the device
                transient = max(transient, piece * size)
        one_byte = fp8 and (name in linear or key.endswith("kv_b_proj.weight"))
        converted = one_byte or name in int8
        largest = max(largest, piece * ((1 if one_byte else stored)
                                        + (HOST_BYTES_PER_CONVERTED_ELEMENT if converted else 0)))
    comps = rank_kv_components(spec.family, dataclasses.asdict(spec.dims), spec.parallel.tp)
    kv = spec.kv_layers * spec.kv_cache.block_size * sum(math.prod(s) for _, s in comps) * stored
    par = spec.parallel
    mem = RankMemory(par.tp, par.ep, weight_bytes, kv, kv_blocks_needed(spec) if num_blocks is None else num_blocks,
                     par.dp, par.cp, blocks_asked=num_blocks is not None)
    if npu is None:
        return mem
    gib = device_memory_gib or npu.device_memory_gib or NPU_MEMORY.device_memory_gib
    # the RoPE table's width: the rotary part of a head (MLA's qk_rope_head_dim), else the whole head
    rot: int = getattr(spec.dims, "qk_rope_head_dim", None) or getattr(spec.dims, "head_dim")
    save_rows = npu.save_rows or max(1, npu.prefill_token_buckets[-1] // spec.kv_cache.block_size)
    saves = any(spec.variant_saves(v) for v in spec.variants.values())
    from .activations import allocator_reserve_bytes, peak_activation

    act = peak_activation(spec)
    return dataclasses.replace(
        mem, activation_bytes=0 if act is None else act.bytes,
        reserve_bytes=allocator_reserve_bytes(int(gib * GIB) - int(NPU_MEMORY.runtime_gib * GIB)),
        weight_bytes=weight_bytes + _max_len(spec) * 2 * rot * size,
        ring_bytes=npu.staging_buffers * save_rows * kv if saves else 0, transient_bytes=transient,
        largest_slice=largest, comm_bytes=communicator_bytes(par),
        runtime_bytes=int(NPU_MEMORY.runtime_gib * GIB), device_bytes=int(gib * GIB),
        utilization=utilization or NPU_MEMORY.utilization,
        kv_blocks=mem.kv_blocks if num_blocks is None else num_blocks + 1,  # + the NPU's padding block
        default_blocks=mem.default_blocks if num_blocks is None else num_blocks + 1)


def budget_source(spec: ModelSpec, device_memory_gib: Optional[float] = None) -> str:
    """Where the device size comes from: the flag, the spec, or the NPU target's default."""
    if device_memory_gib is not None:
        return "--device-memory-gib"
    if spec.targets.npu is not None and spec.targets.npu.device_memory_gib is not None:
        return "targets.npu.device_memory_gib"
    return "the NPU target's default device"


def default_blocks_note(mem: RankMemory) -> Optional[str]:
    """The sentence for a layout that fits, but not with the engine's default KV blocks, else None."""
    budget, n = mem.budget_bytes, mem.auto_blocks()
    if budget is None or n is None or not mem.fits() or mem.launch_peak_bytes <= budget:
        return None
    return (f"the engine's default {mem.default_blocks} KV blocks do not fit ({_size(mem.launch_peak_bytes)} of "
            f"{_size(budget)}): launch with --device-memory-utilization {mem.utilization:g} ({n} blocks) or "
            f"--num-blocks {n - 1} (the NPU reserves one more)")


def memory_problems(spec: ModelSpec, mem: RankMemory, device_memory_gib: Optional[float] = None, *,
                    num_blocks: Optional[int] = None) -> list[str]:
    """The sentence(s) of a layout that does not fit ``mem.device_bytes``, naming a layout that does
    (`fit_layout`, at ``mem``'s utilization and ``num_blocks``); [] when it fits or there is no budget."""
    device, visible, budget = mem.device_bytes, mem.visible_bytes, mem.budget_bytes
    if mem.fits() or device is None or visible is None or budget is None:
        return []
    where = budget_source(spec, device_memory_gib)
    gib = device / GIB
    fit = fit_layout(spec, gib, utilization=mem.utilization, num_blocks=num_blocks)
    found = fit.memory
    fix_text = (f"fix: set parallel {', '.join(f'{k}: {v}' for k, v in fit.layout.items())} ({found.layout()}: "
                f"{_size(found.per_rank_bytes())} per rank)"
                if fit.layout is not None and found is not None else fit.why)
    n = mem.auto_blocks()
    need = kv_blocks_needed(spec)
    if mem.blocks_asked and n is not None and n >= max(need, 2):  # the layout fits; the blocks asked for do not
        fewer = (f"fix: launch with --num-blocks {n - 1} (the NPU reserves one more) or --device-memory-utilization "
                 f"{mem.utilization:g} ({n} blocks; the largest decode batch needs {need})")
        fix_text = fewer + (f", or {fix_text.removeprefix('fix: ')}" if fit.layout is not None else "")
    if where == "the NPU target's default device":  # the spec states none: say how to state it
        where += ": state yours with targets.npu.device_memory_gib or --device-memory-gib"
    return [f"per rank {_size(mem.per_rank_bytes())} ({mem.parts_text()}) exceeds the engine's {_size(budget)}, "
            f"{mem.utilization:g} x the {_size(visible)} torch sees of a {gib:g} GiB device ({where}); {fix_text}"]


def _layout_candidates(spec: ModelSpec) -> Iterator[dict[str, int]]:
    """Layouts to try, smallest world first: tp a power of two with ep 1 or tp (dp, cp 1; sp as the spec);
    for a spec with DP attention, its kind first: dp × tp ranks with ep = dp × tp, the most DP groups first."""
    moe = PLANS[spec.family].experts is not None  # routed experts: ep may split them
    powers = (1, 2, 4, 8, 16, 32, 64, 128)
    for world in powers:
        if spec.parallel.dp > 1 and moe:
            for tp in powers[:powers.index(world)]:
                yield {"tp": tp, "ep": world, "dp": world // tp, "cp": 1}
        for ep in ((1, world) if moe and world > 1 else (1,)):
            yield {"tp": world, "ep": ep, "dp": 1, "cp": 1}


@dataclass(frozen=True)
class LayoutFit:
    """`fit_layout`'s answer: the smallest layout that fits (``{"tp", "ep"[, "dp", "cp"]}``: the keys that
    differ from the spec's, tp and ep always) and its `RankMemory`, or none and why."""
    layout: Optional[dict[str, int]]
    memory: Optional[RankMemory]
    why: str = ""


def fit_layout(spec: ModelSpec, device_memory_gib: float, *, utilization: Optional[float] = None,
               num_blocks: Optional[int] = None) -> LayoutFit:
    """The smallest layout the spec's rules accept that fits ``device_memory_gib`` (`rank_memory`'s
    ``utilization`` and ``num_blocks``), or none, with why (the spec rule that refused the larger layouts)."""
    from ..modelspec.compat import check_compat
    from .manager import run_pipeline

    refused: Optional[str] = None
    for layout in _layout_candidates(spec):
        cand = spec.with_overrides(tp=layout["tp"], ep=layout["ep"], dp=layout["dp"], cp=layout["cp"],
                                   sp=spec.parallel.sp and layout["tp"] > 1)
        problems = list(check_compat(cand))
        if problems:
            refused = refused or (problems[0][1] if layout["tp"] > 1 else None)
            continue
        graphs = [run_pipeline(cand, v, until="shard") for v in cand.variants]
        mem = rank_memory(cand, graphs, device_memory_gib, utilization=utilization, num_blocks=num_blocks)
        if mem.fits():
            return LayoutFit({k: v for k, v in layout.items() if k in ("tp", "ep") or getattr(spec.parallel, k) != v},
                             mem)
    return LayoutFit(None, None, f"no layout graphgen can launch fits: {refused}" if refused else
                     "no layout up to tp=128 fits (fix: a larger device)")


def choose_layout(spec: ModelSpec, device_memory_gib: Optional[float] = None) -> LayoutPick:
    """``graphgen import-hf --fit``'s picker (`graphgen.modelspec.import_hf.LayoutChoice`): the smallest
    layout that fits ``device_memory_gib`` (default: the NPU target's die), the note the imported spec's
    header gets, and that device size (the spec records it); `LayoutError` when the spec has no device to
    fit or nothing fits."""
    from ..modelspec.import_hf import LayoutError, LayoutPick

    if spec.targets.npu is None:  # no device to fit
        raise LayoutError(f"{spec.name}: --fit sizes a layout for the NPU target's devices, and this spec has no "
                          f"npu target; fix: --tp/--ep/--dp, or add an npu target")
    gib = device_memory_gib or NPU_MEMORY.device_memory_gib
    chosen = fit_layout(spec, gib)
    if chosen.layout is None or chosen.memory is None:
        raise LayoutError(f"{spec.name} on {gib:g} GiB devices: {chosen.why}")
    return LayoutPick(chosen.layout, f"Layout chosen by --fit for {gib:g} GiB devices: {chosen.memory.layout()} "
                                     f"(graphgen validate shows its per-rank memory).", gib)
