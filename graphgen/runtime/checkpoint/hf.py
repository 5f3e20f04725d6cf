"""Hugging Face checkpoint I/O for the CPU runtime.

``load_hf_weights`` reads ``model.safetensors`` (or a sharded ``model.safetensors.index.json``)
into a flat dict keyed by checkpoint names, checks every key and shape against the layout that
``config.json`` implies (the family's layout, graphgen/families), and stacks MoE experts into
``model.layers.N.mlp.experts.{gate,up,down}_proj.weight`` ``[E, ...]``.

``write_random_hf_checkpoint`` writes a random checkpoint in the same layout, with a config.json
transformers can load, without importing transformers (demo and benchmarks run without it), shard by
shard (one shard in memory at a time), refusing up front what the disk or the memory here cannot hold.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .index import EXPERT_KEY as _EXPERT_KEY
from ...families import FAMILIES
from .index import CheckpointIndex, WeightsError, _empty, _family, checkpoint_layout, family_of_config
from .stream import SliceReader, dequantize_blocks
from ..progress import current_progress

Tensor = torch.Tensor

__all__ = ["load_hf_weights", "write_random_hf_checkpoint", "plan_random_checkpoint", "CheckpointTooLarge",
           "checkpoint_layout", "family_of_config", "WeightsError"]

GIB = 1 << 30


def load_hf_weights(hf_dir: str, dtype: torch.dtype = torch.float32, mtp_layers: int = 0) -> dict[str, Tensor]:
    """Flat ``{checkpoint key: tensor}`` in ``dtype``, validated against config.json. ``mtp_layers``:
    also load that many of DeepSeek-V3's MTP layers (``model.layers.{num_hidden_layers + k}.*``,
    graphgen.families.mtp); an MTP layer's ``embed_tokens`` / ``shared_head.head`` the checkpoint
    omits is the target's tensor (shared, not copied). The whole model in one process: the CPU
    reference path and tests; a rank streams its own slices instead
    (`graphgen.runtime.checkpoint.stream.CheckpointWeights`). An FP8 checkpoint's weights come dequantized
    (fp8 x block scale, `graphgen.runtime.checkpoint.stream.dequantize_blocks`)."""
    index = CheckpointIndex.open(hf_dir, mtp_layers)
    fp32 = _family(index.family).fp32_suffixes
    out: dict[str, Tensor] = {}
    stacks: dict[tuple[int, str], dict[int, Tensor]] = {}
    converted: dict[int, Tensor] = {}  # one converted tensor per stored tensor: shared stays shared
    report = current_progress()  # bytes read, for the start's progress lines (graphgen.runtime.progress)
    report.phase("load", total=sum(src.nbytes for src in {id(s): s for s in index.tensors.values()}.values()))
    with SliceReader() as reader:
        for key, src in index.tensors.items():
            if id(src) not in converted:
                want = torch.float32 if fp32 and key.endswith(fp32) else dtype
                scale = index.scale_of(src)
                if scale is None:
                    converted[id(src)] = reader.read(src).to(want, copy=True)
                else:  # FP8: its block scales first (one read buffer), then the weight, dequantized
                    blocks = reader.read(scale.src).clone()
                    converted[id(src)] = dequantize_blocks(reader.read(src), blocks, scale.block).to(want)
                report.advance(src.nbytes)
            m = _EXPERT_KEY.match(key)
            if m:
                stacks.setdefault((int(m.group(1)), m.group(3)), {})[int(m.group(2))] = converted[id(src)]
            else:
                out[key] = converted[id(src)]
    for (layer, proj), per_expert in sorted(stacks.items()):
        tensors = [per_expert[e] for e in range(len(per_expert))]
        out[f"model.layers.{layer}.mlp.experts.{proj}_proj.weight"] = torch.stack(tensors).to(dtype)
    return out


# --------------------------------------------------------------------------------------------
# random checkpoints
# --------------------------------------------------------------------------------------------

# the shard size of `write_random_hf_checkpoint` (transformers 4's save_pretrained max_shard_size "5GB", what
# most Hub repositories publish; transformers 5's 50 GB default would hold 50 GB in memory at once)
DEFAULT_SHARD_BYTES = 5 * 10**9
WEIGHTS_NAME, INDEX_NAME = "model.safetensors", "model.safetensors.index.json"
SHARD_NAME = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")  # huggingface_hub's pattern, 1-based
_SPARSE = ("for a model this size use scripts/sparse_checkpoint.py CONFIG_JSON OUT_DIR: the published layout "
           "with its data as file holes, a few KiB of disk and no weights in memory (docs/npu.md, 'Checkpoints "
           "without the disk')")


@dataclass(frozen=True)
class RandomTensor:
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    copy_of: Optional[str] = None  # an MTP layer's copy of this target tensor (drawn once, read back)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class RandomCheckpoint:
    """What `write_random_hf_checkpoint` writes, before anything is drawn: ``config.json``, the tensors in the
    order they are drawn (the MTP copies last) and the shards they go to (``model.safetensors`` when one
    holds them all, else ``model-0000k-of-0000n.safetensors`` and the index, as ``save_pretrained`` shards)."""
    config: dict
    tensors: tuple[RandomTensor, ...]
    shards: tuple[tuple[int, ...], ...]   # indices into ``tensors``, in order

    @property
    def files(self) -> list[str]:
        n = len(self.shards)
        return [WEIGHTS_NAME] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def shard_bytes(self, i: int) -> int:
        return sum(self.tensors[j].nbytes for j in self.shards[i])

    @property
    def host_peak_bytes(self) -> int:
        """Host memory the writer holds at most: the largest shard (kept until it is saved) plus the float32
        temporaries of one tensor being drawn (the draw and its scaled copy)."""
        largest = max((math.prod(t.shape) for t in self.tensors if t.copy_of is None), default=0)
        return max((self.shard_bytes(i) for i in range(len(self.shards))), default=0) + 8 * largest


def plan_random_checkpoint(family: str, dims: dict, dtype: torch.dtype = torch.float32, mtp_layers: int = 0,
                           mtp_copies: bool = True, shard_bytes: int = DEFAULT_SHARD_BYTES) -> RandomCheckpoint:
    """The `RandomCheckpoint` of `write_random_hf_checkpoint` (same arguments): shapes and sizes only."""
    fam = _family(family)
    d = fam.dims_of(dims)
    dtype_name = str(dtype).replace("torch.", "")
    cfg = fam.hf_config(d, dtype_name, mtp_layers) if mtp_layers else fam.hf_config(d, dtype_name)
    layout = checkpoint_layout(family, d, mtp_layers)
    copies = {}
    if mtp_layers:
        from ...families.mtp import shared_keys

        copies = shared_keys(d, mtp_layers)
        for key in copies:
            layout.pop(key)
    from .tokenizer import eos_token_ids_of

    eos = eos_token_ids_of(cfg["vocab_size"], family)  # the EOS of the tokenizer written below ([]: none fits)
    cfg["eos_token_id"] = (eos[0] if len(eos) == 1 else eos) if eos else None
    if cfg["tie_word_embeddings"]:
        layout.pop("lm_head.weight")  # tied checkpoints omit it; the loader re-adds it
    fp32 = fam.fp32_suffixes
    tensors = [RandomTensor(key, tuple(shape), torch.float32 if fp32 and key.endswith(fp32) else dtype)
               for key, shape in layout.items()]
    if mtp_copies:
        by_key = {t.key: t for t in tensors}
        for key, target in copies.items():
            src = by_key[target if target in by_key else "model.embed_tokens.weight"]
            tensors.append(RandomTensor(key, src.shape, src.dtype, copy_of=src.key))
    # huggingface_hub's split (split_state_dict_into_shards_factory): a shard closes before the tensor that
    # would take it past the size; a tensor larger than the size is a shard of its own (here in its place)
    shards: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i, t in enumerate(tensors):
        if cur and size + t.nbytes > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += t.nbytes
    return RandomCheckpoint(cfg, tuple(tensors), tuple(map(tuple, shards + [cur] if cur else shards)))


def _draw(t: RandomTensor, g: torch.Generator) -> Tensor:
    """One random tensor at the scales of the module doc, in its dtype (float32 draws, in layout order)."""
    shape = list(t.shape)
    if _empty(shape):  # written empty, as transformers does (n_shared_experts: 0)
        x = torch.zeros(shape)
    elif len(shape) == 1:
        if t.key.endswith("e_score_correction_bias"):
            x = 0.05 * torch.randn(shape, generator=g)
        else:  # RMSNorm weights
            x = 1.0 + 0.05 * torch.randn(shape, generator=g)
    elif t.key in ("model.embed_tokens.weight",):
        x = 0.1 * torch.randn(shape, generator=g)
    else:
        std = min(max(shape[1] ** -0.5, 0.02), 0.1)
        x = std * torch.randn(shape, generator=g)
    return x.to(t.dtype).contiguous()


def memory_available_bytes() -> Optional[int]:
    """Memory this process may still take: the kernel's ``MemAvailable``, bounded by this cgroup's
    ``memory.max`` (cgroup v2) and the address-space limit (``ulimit -v``); None when none is known."""
    import resource

    known = []
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/meminfo") as f:
            known += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/self/cgroup") as f:
            rel = next(line.strip().split("::", 1)[1] for line in f if line.startswith("0::"))
        base = os.path.join("/sys/fs/cgroup", rel.lstrip("/"))
        with open(os.path.join(base, "memory.max")) as f:
            limit = f.read().strip()
        if limit != "max":
            with open(os.path.join(base, "memory.current")) as f:
                known.append(int(limit) - int(f.read()))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open("/proc/self/statm") as f:
                known.append(soft - int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE"))
    return max(0, min(known)) if known else None


def room_for(out_dir: str) -> tuple[int, Optional[int]]:
    """(bytes free on the disk ``out_dir`` is on, counting the weight files a rewrite replaces; memory
    available, `memory_available_bytes`)."""
    where = os.path.abspath(out_dir)
    while not os.path.exists(where):
        where = os.path.dirname(where)
    replaced = sum(os.path.getsize(p) for p in _weight_files(out_dir)) if os.path.isdir(out_dir) else 0
    return shutil.disk_usage(where).free + replaced, memory_available_bytes()


class CheckpointTooLarge(ValueError):
    """A random checkpoint the disk or the memory here cannot hold (one sentence naming the sparse writer)."""


def room_problem(plan: RandomCheckpoint, out_dir: str, disk_free: int, memory_free: Optional[int]) -> Optional[str]:
    """The sentence refusing ``plan`` when ``disk_free`` bytes cannot hold its files or ``memory_free`` bytes
    its writer's peak (`RandomCheckpoint.host_peak_bytes`), else None."""
    short = []
    if plan.total_bytes > disk_free:
        short.append(f"{plan.total_bytes / GIB:.1f} GiB of files where the disk of {out_dir} has "
                     f"{disk_free / GIB:.1f} GiB free")
    if memory_free is not None and plan.host_peak_bytes > memory_free:
        largest = max(range(len(plan.shards)), key=plan.shard_bytes)
        short.append(f"{plan.host_peak_bytes / GIB:.1f} GiB of memory while writing (its largest shard, "
                     f"{plan.shard_bytes(largest) / GIB:.1f} GiB, and the float32 draw of its largest tensor) where "
                     f"{memory_free / GIB:.1f} GiB is available")
    if not short:
        return None
    return f"a random checkpoint of this model needs {' and '.join(short)}; {_SPARSE}"


def _weight_files(out_dir: str) -> list[str]:
    return [os.path.join(out_dir, n) for n in sorted(os.listdir(out_dir))
            if n in (WEIGHTS_NAME, INDEX_NAME) or SHARD_NAME.match(n)]


def write_random_hf_checkpoint(out_dir: str, family: str, dims: dict, seed: int = 0,
                               dtype: torch.dtype = torch.float32, tokenizer: bool = True,
                               mtp_layers: int = 0, mtp_copies: bool = True, shard_bytes: int = DEFAULT_SHARD_BYTES,
                               on_shard: Optional[Callable[[int, RandomCheckpoint, int], None]] = None) -> str:
    """Write ``config.json`` + the weights with random values; returns ``out_dir``. The weights are one
    ``model.safetensors`` when they fit ``shard_bytes``, else shards of at most that size (a larger tensor
    alone) and ``model.safetensors.index.json``, as ``save_pretrained`` writes them: each shard is drawn,
    saved and dropped before the next, so the host holds one shard (`RandomCheckpoint.host_peak_bytes`),
    never the model; `CheckpointTooLarge` before anything is written when the disk or the memory here
    cannot hold it. The values do not depend on the sharding (one generator, drawn in layout order).
    ``on_shard(i, plan, held)``: after shard ``i`` is saved, with the tensor bytes the writer held for it.
    The weight files of an earlier checkpoint in ``out_dir`` are replaced.
    With ``tokenizer`` (and the ``tokenizers`` package installed) also a byte-level BPE tokenizer of
    exactly ``vocab_size`` tokens (``runtime.tokenizer.write_tokenizer``), so text prompts work.
    ``eos_token_id`` in ``config.json`` is that tokenizer's EOS (``tokenizer.eos_token``; written even
    without the ``tokenizers`` package), so ``graphgen run``/``serve`` stop where it would.

    Scales keep activations and logits O(1): matrices ~ N(0, (1/sqrt(fan_in))^2) clipped to
    std 0.02..0.1, norms ~ 1 + N(0, 0.05^2), embeddings std 0.1 (normed right after), and a small
    random e_score_correction_bias so the biased routing choice is exercised.

    ``mtp_layers``: also that many DeepSeek-V3 MTP layers (``num_nextn_predict_layers`` in
    config.json), drawn after every target tensor (so the target's weights equal the checkpoint's
    without MTP of the same seed); their ``embed_tokens`` / ``shared_head.head`` are copies of the
    target's, as DeepSeek publishes them, or left out (``mtp_copies=False``: the loader shares the
    target's)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    plan = plan_random_checkpoint(family, dims, dtype, mtp_layers, mtp_copies, shard_bytes)
    problem = room_problem(plan, out_dir, *room_for(out_dir))
    if problem:
        raise CheckpointTooLarge(problem)
    os.makedirs(out_dir, exist_ok=True)
    for old in _weight_files(out_dir):  # an earlier checkpoint's (a single file would shadow an index)
        os.remove(old)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(plan.config, f, indent=2, sort_keys=True)
        f.write("\n")
    g = torch.Generator().manual_seed(seed)
    saved_in: dict[str, str] = {}
    for i, (shard, name) in enumerate(zip(plan.shards, plan.files)):
        tensors: dict[str, Tensor] = {}
        for j in shard:
            t = plan.tensors[j]
            if t.copy_of is None:
                tensors[t.key] = _draw(t, g)
            elif t.copy_of in tensors:
                tensors[t.key] = tensors[t.copy_of].clone()
            else:  # its target went to an earlier shard: read it back
                with safe_open(saved_in[t.copy_of], framework="pt") as f:
                    tensors[t.key] = f.get_tensor(t.copy_of)
        path = os.path.join(out_dir, name)
        save_file(tensors, path, metadata={"format": "pt"})
        saved_in.update(dict.fromkeys(tensors, path))
        held = sum(x.nbytes for x in tensors.values())
        del tensors
        if on_shard is not None:
            on_shard(i, plan, held)
    if len(plan.shards) > 1:  # the index last: a write cut short leaves no checkpoint that looks whole
        index = {"metadata": {"total_parameters": sum(math.prod(t.shape) for t in plan.tensors),
                              "total_size": plan.total_bytes},
                 "weight_map": {t.key: os.path.basename(saved_in[t.key]) for t in plan.tensors}}
        with open(os.path.join(out_dir, INDEX_NAME), "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    if tokenizer and importlib.util.find_spec("tokenizers") is not None:
        from .tokenizer import write_tokenizer

        write_tokenizer(out_dir, plan.config["vocab_size"], family=family)
    return out_dir


def check_config(spec, hf_dir) -> None:
    """The checkpoint's config.json must describe the spec's model (family and every stated dim);
    ``ValueError``/``FileNotFoundError`` naming the mismatch and the fix otherwise."""
    import dataclasses
    import json
    from pathlib import Path

    hf_dir = Path(hf_dir)
    cfg_path = hf_dir / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{cfg_path}: no config.json (expected a Hugging Face checkpoint folder)")
    cfg = json.loads(cfg_path.read_text())
    try:
        family = family_of_config(cfg)
    except WeightsError as e:
        raise ValueError(f"{cfg_path}: {e}") from None
    fix = f"create a matching spec with: graphgen import-hf {hf_dir} --out specs/NAME.yaml"
    if family != spec.family:
        raise ValueError(f"{cfg_path} does not match spec {spec.name} (model_type {cfg.get('model_type')!r} is "
                         f"family {family}, the spec is {spec.family}); {fix}")
    # Every dim the config states must agree (same family => same field names). Not compared:
    # max_position_embeddings (a context limit, not a weight or numeric property) and the RoPE
    # fields, which transformers 5 nests under rope_parameters.
    skip = {"max_position_embeddings", "rope_theta", "rope_scaling"}
    wrong = [(k, cfg[k], v) for k, v in dataclasses.asdict(spec.dims).items()
             if k not in skip and cfg.get(k) is not None and cfg[k] != v]
    if wrong:
        desc = ", ".join(f"{k}: checkpoint {a} vs spec {b}" for k, a, b in wrong)
        raise ValueError(f"{cfg_path} does not match spec {spec.name} ({desc}); {fix}")
    _check_quantization(spec, cfg, cfg_path, fix)
    declared = FAMILIES[family].mtp_layers_of_config(cfg)
    if spec.mtp_layers > declared:
        raise ValueError(f"{cfg_path} does not match spec {spec.name}: the spec has mtp: {{num_layers: "
                         f"{spec.mtp_layers}}} but the checkpoint declares num_nextn_predict_layers: {declared}; "
                         f"use a checkpoint with MTP layers, or remove the spec's mtp: section")


def _check_quantization(spec, cfg: dict, cfg_path, fix: str) -> None:
    """The spec's ``quantization.checkpoint`` must be what config.json's ``quantization_config`` says (an
    FP8 block size, or none): the loader reads what the spec declares."""
    from ...modelspec.import_hf import fp8_checkpoint_of

    fp8, refused = fp8_checkpoint_of(cfg.get("quantization_config"))
    if refused:
        raise ValueError(f"{cfg_path}: quantization_config: {refused[0]}")
    declared = spec.quantization.checkpoint
    if fp8 == declared:
        return
    have = f"an fp8 checkpoint with {list(fp8.weight_block_size)} blocks" if fp8 else "no quantization_config"
    says = (f"quantization: {{checkpoint: {{weight_block_size: {list(declared.weight_block_size)}}}}}" if declared
            else "no quantization.checkpoint")
    want = (f"add 'quantization: {{checkpoint: {{quant_method: fp8, weight_block_size: "
            f"{list(fp8.weight_block_size)}}}}}' to the spec" if fp8 else "remove the spec's quantization.checkpoint")
    raise ValueError(f"{cfg_path} does not match spec {spec.name}: config.json has {have} but the spec has "
                     f"{says}; {want}, or {fix}")
