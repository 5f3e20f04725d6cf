"""Where every tensor of a Hugging Face checkpoint lies, read from the safetensors headers alone.

A safetensors file is an 8-byte little-endian header length, a JSON header (``key -> {"dtype", "shape",
"data_offsets": [begin, end]}``, offsets relative to the end of the header) and the tensors' bytes
(https://huggingface.co/docs/safetensors, "Format"). `CheckpointIndex.open` reads only those headers, of
``model.safetensors`` or of every shard ``model.safetensors.index.json`` names, and checks every key and
shape against the layout ``config.json`` implies (the family's, graphgen/families), with the messages
`graphgen.runtime.checkpoint.hf.load_hf_weights` has always given. No tensor byte is read here and no
torch is imported: a loader reads exactly the byte ranges it needs afterwards
(`graphgen.runtime.checkpoint.stream`), so a rank touches only its own slices.

FP8 checkpoints (config.json's ``quantization_config``: quant_method fp8, DeepSeek-V3's published layout):
a ``float8_e4m3fn`` weight ``<name>.weight`` comes with ``<name>.weight_scale_inv``, float32, one scale per
``weight_block_size`` block (the value is fp8 x scale: DeepSeek-V3 ``inference/kernel.py`` ``weight_dequant``,
transformers' ``Fp8Dequantize``). The scales are no layout keys: `CheckpointIndex.scales` pairs them with
their weights, and a loader dequantizes each slice it reads (`graphgen.runtime.checkpoint.stream`).

Aliases: a tied ``lm_head.weight`` a checkpoint omits is ``model.embed_tokens.weight``'s bytes; an MTP
layer's omitted ``embed_tokens`` / ``shared_head.head`` the target's (`graphgen.families.mtp`). MoE
experts stay one stored tensor each; `CheckpointIndex.source` gives a stacked key
(``model.layers.N.mlp.experts.gate_proj.weight``, ``[E, ...]``) as the tuple of its experts' tensors.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from typing import Optional, Union

from ...families import BY_HF_MODEL_TYPE, FAMILIES

__all__ = ["Stored", "CheckpointIndex", "WeightsError", "read_header", "family_of_config", "checkpoint_layout",
           "ITEMSIZE", "BlockScales", "SCALE_SUFFIX", "fp8_block_of", "published_fp8"]

EXPERT_KEY = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
STACKED_KEY = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate|up|down)_proj\.weight$")
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")
# bytes per element of the safetensors dtypes (the format's names)
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
            "I8": 1, "U8": 1, "BOOL": 1}


class WeightsError(ValueError):
    """A checkpoint does not match what its config.json describes."""


def family_of_config(config: dict) -> str:
    mt = config.get("model_type")
    if mt not in BY_HF_MODEL_TYPE:
        raise WeightsError(f"unsupported model_type {mt!r} in config.json (supported: {sorted(BY_HF_MODEL_TYPE)})")
    return BY_HF_MODEL_TYPE[mt].name


def _family(name: str):
    if name not in FAMILIES:
        raise WeightsError(f"unknown model family {name!r} (expected {' or '.join(FAMILIES)})")
    return FAMILIES[name]


def checkpoint_layout(family: str, dims, mtp_layers: int = 0) -> dict[str, tuple]:
    """Checkpoint key -> shape, as a Hugging Face checkpoint of this family stores it (experts
    unstacked, ``lm_head.weight`` included even when tied); ``dims`` is a dims object or a
    config.json dict; ``mtp_layers``: with that many MTP layers (DeepSeek-V3). The family's layout
    (graphgen/families) is the one source."""
    fam = _family(family)
    try:
        extra = {"mtp_layers": mtp_layers} if mtp_layers else {}
        return fam.checkpoint_layout(fam.dims_of(dims), **extra)
    except TypeError as e:  # a required dim is missing from the config
        raise WeightsError(f"config.json does not describe a {family} model: {e}") from None


@dataclass(frozen=True)
class Stored:
    """One tensor's bytes in a safetensors file: ``[begin, end)`` are absolute file offsets."""
    path: str
    key: str
    dtype: str  # the format's name: BF16, F32, F8_E4M3, ...
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_header(path: str) -> dict[str, Stored]:
    """The tensors of one safetensors file (its header only); `WeightsError` for a file that is not one."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            size = os.fstat(f.fileno()).st_size
            if not 2 <= n <= size - 8:
                raise ValueError(f"header length {n} does not fit a file of {size} bytes")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        raise WeightsError(f"{path}: not a readable safetensors file ({e})") from None
    base = 8 + n
    out = {}
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        begin, end = meta["data_offsets"]
        shape = tuple(int(s) for s in meta["shape"])
        want = ITEMSIZE.get(meta["dtype"], 0) * _prod(shape)
        if meta["dtype"] not in ITEMSIZE or end - begin != want or base + end > size:
            raise WeightsError(f"{path}: tensor {key!r} ({meta['dtype']} {list(shape)}) has data offsets "
                               f"[{begin}, {end}] that do not match its shape or the file size")
        out[key] = Stored(path, key, meta["dtype"], shape, base + begin, base + end)
    return out


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _empty(shape) -> bool:
    return 0 in tuple(shape)


def _files(hf_dir: str) -> dict[str, Optional[list[str]]]:
    """{file path: the keys the index maps to it (None: the single file, every key)}."""
    single = os.path.join(hf_dir, "model.safetensors")
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(single):
        return {single: None}
    if not os.path.exists(index):
        raise WeightsError(f"{hf_dir}: neither model.safetensors nor model.safetensors.index.json found")
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    files: dict[str, list[str]] = {}
    for key, fname in weight_map.items():
        files.setdefault(os.path.join(hf_dir, fname), []).append(key)
    return dict(files)  # typed as the return (dict is invariant in its values)


def _stored_tensors(hf_dir: str) -> dict[str, Stored]:
    out: dict[str, Stored] = {}
    for path, keys in _files(hf_dir).items():
        if not os.path.exists(path):
            raise WeightsError(f"{hf_dir}: shard {os.path.basename(path)} named in the index is missing")
        present = read_header(path)
        for key in (keys if keys is not None else sorted(present)):
            if key not in present:
                raise WeightsError(f"{path}: index lists {key!r} but the shard does not hold it")
            out[key] = present[key]
    return out


def _more(keys: list) -> str:
    return f"{keys[:5]}" + (f" (and {len(keys) - 5} more)" if len(keys) > 5 else "")


SCALE_SUFFIX = ".weight_scale_inv"  # an FP8 weight's block scales (DeepSeek-V3's published layout)


@dataclass(frozen=True)
class BlockScales:
    """The block scales of one FP8 weight: ``src`` (float32, ``[ceil(rows / b0), ceil(cols / b1)]``), one
    per ``block`` = (b0, b1) block of the weight; a weight element is its fp8 value times its block's scale."""
    src: Stored
    block: tuple[int, int]


# 2-D tensors of a decoder layer the published FP8 checkpoints keep in bf16: the MoE router, and the MTP
# layer's embedding, head and eh_proj (vLLM's DeepSeek MTP layer builds eh_proj as a plain nn.Linear)
_FP8_KEPT = (".mlp.gate.weight", ".embed_tokens.weight", ".shared_head.head.weight", ".eh_proj.weight")


def published_fp8(key: str, shape) -> bool:
    """Whether the published FP8 layout (DeepSeek-V3 / V3.1) stores ``key`` in float8_e4m3fn with block
    scales: every 2-D weight of a decoder layer (the MTP layer's decoder block included) but `_FP8_KEPT`;
    the embedding, the LM head and every norm stay bf16. What `scripts/sparse_checkpoint.py` and the tests'
    FP8 writer lay out; the loader itself takes whatever has scales."""
    return len(tuple(shape)) == 2 and _LAYER_KEY.match(key) is not None and not key.endswith(_FP8_KEPT)


def fp8_block_of(config: dict) -> Optional[tuple[int, int]]:
    """The FP8 block size of config.json's ``quantization_config`` (None: an unquantized checkpoint);
    `WeightsError` for one graphgen does not read (the sentence of `graphgen import-hf`)."""
    from ...modelspec.import_hf import fp8_checkpoint_of

    fp8, refused = fp8_checkpoint_of(config.get("quantization_config"))
    if refused:
        raise WeightsError(f"config.json quantization_config: {refused[0]}")
    return None if fp8 is None else (fp8.weight_block_size[0], fp8.weight_block_size[1])


@dataclass(frozen=True)
class CheckpointIndex:
    """A checkpoint folder's tensors by key, checked against its config.json (see the module doc).
    ``tensors``: every non-empty key of the layout (aliases resolved); ``layout``: key -> shape;
    ``scales``: stored key -> `BlockScales` of each FP8 weight (an FP8 checkpoint: ``fp8_block``)."""
    hf_dir: str
    config: dict
    family: str
    mtp_layers: int
    tensors: dict
    layout: dict
    scales: dict = dataclasses.field(default_factory=dict)
    fp8_block: Optional[tuple[int, int]] = None

    @classmethod
    def open(cls, hf_dir, mtp_layers: int = 0) -> "CheckpointIndex":
        hf_dir = str(hf_dir)
        with open(os.path.join(hf_dir, "config.json")) as f:
            config = json.load(f)
        family = family_of_config(config)
        declared = FAMILIES[family].mtp_layers_of_config(config)
        if mtp_layers > declared:
            raise WeightsError(f"{hf_dir}: the spec has {mtp_layers} MTP layer(s) but config.json declares "
                               f"num_nextn_predict_layers: {declared}; use a checkpoint with MTP layers or remove "
                               f"the spec's mtp: section")
        layout = checkpoint_layout(family, config, mtp_layers)
        raw = _stored_tensors(hf_dir)
        if config.get("tie_word_embeddings") and "lm_head.weight" not in raw and "model.embed_tokens.weight" in raw:
            raw["lm_head.weight"] = raw["model.embed_tokens.weight"]
        if mtp_layers:
            from ...families.mtp import shared_keys

            for key, target in shared_keys(FAMILIES[family].dims_of(config), mtp_layers).items():
                if key not in raw and target in raw:
                    raw[key] = raw[target]
        block = fp8_block_of(config)
        scales = _scales(hf_dir, raw, block)
        _check(hf_dir, family, config, mtp_layers, layout, raw)
        tensors = {k: raw[k] for k, shape in layout.items() if not _empty(shape)}
        return cls(hf_dir, config, family, mtp_layers, tensors, layout,
                   {src.key: scales[src.key] for src in tensors.values() if src.key in scales}, block)

    def scale_of(self, src: Stored) -> Optional[BlockScales]:
        """The block scales of stored tensor ``src`` (None: it is not FP8)."""
        return self.scales.get(src.key)

    def source(self, key: str) -> Union[Stored, tuple[Stored, ...]]:
        """The stored tensor of ``key``, or for a stacked expert key (``...mlp.experts.gate_proj.weight``)
        the tuple of its experts' stored tensors, expert 0 first."""
        if key in self.tensors:
            return self.tensors[key]
        m = STACKED_KEY.match(key)
        if m is None or f"{m[1]}.0.{m[2]}_proj.weight" not in self.tensors:
            raise KeyError(f"checkpoint key {key!r} is not in {self.hf_dir} (nor a stack of its experts)")
        out, e = [], 0
        while f"{m[1]}.{e}.{m[2]}_proj.weight" in self.tensors:
            out.append(self.tensors[f"{m[1]}.{e}.{m[2]}_proj.weight"])
            e += 1
        return tuple(out)

    def shape(self, key: str) -> tuple[int, ...]:
        src = self.source(key)
        return (len(src), *src[0].shape) if isinstance(src, tuple) else src.shape


def _scales(hf_dir: str, raw: dict, block: Optional[tuple[int, int]]) -> dict[str, BlockScales]:
    """Stored key -> `BlockScales` of every FP8 weight, each scale key removed from ``raw`` (so the layout
    check sees the weights alone); `WeightsError` for an FP8 weight without its scales (or in a checkpoint
    whose config.json declares no fp8 quantization), a scale of the wrong shape or dtype, or a scale
    without its FP8 weight."""
    out: dict[str, BlockScales] = {}
    for key in [k for k in raw if k.endswith(SCALE_SUFFIX)]:
        weight = key[:-len(SCALE_SUFFIX)] + ".weight"
        src, scale = raw.get(weight), raw.pop(key)
        if src is None or src.dtype != "F8_E4M3":
            raise WeightsError(f"{hf_dir}: {key} scales {weight}, which is "
                               + ("missing" if src is None else f"stored {src.dtype}, not F8_E4M3"))
        if block is None:
            raise WeightsError(f"{hf_dir}: {weight} is stored FP8 with block scales but config.json has no "
                               f"quantization_config (fix: the checkpoint's config.json as published, with "
                               f"quant_method fp8)")
        want = tuple(-(-n // b) for n, b in zip(src.shape, block))
        if scale.dtype != "F32" or len(src.shape) != 2 or scale.shape != want:
            raise WeightsError(f"{hf_dir}: {key} is {scale.dtype} {list(scale.shape)}; a {list(block)} block scale "
                               f"of {weight} {list(src.shape)} is F32 {list(want)}")
        out[src.key] = BlockScales(scale, block)
    unscaled = [k for k, src in raw.items() if src.dtype.startswith("F8") and src.key not in out]
    if unscaled:
        raise WeightsError(f"{hf_dir}: FP8 tensor(s) {_more(unscaled)} have no {SCALE_SUFFIX} block scales")
    return out


def _check(hf_dir: str, family: str, config: dict, mtp_layers: int, layout: dict, raw: dict) -> None:
    """Every key and shape of the layout present, nothing unexpected (the messages of load_hf_weights)."""
    L = config["num_hidden_layers"]

    # keys a loader may skip: layers past the loaded ones are DeepSeek's MTP module (not asked
    # for), and rotary inv_freq buffers are recomputed from the config
    def ignorable(key: str) -> bool:
        m = _LAYER_KEY.match(key)
        return (m is not None and int(m.group(1)) >= L + mtp_layers) or key.endswith("rotary_emb.inv_freq")

    # zero-size entries are weights the model does not have (n_shared_experts: 0): transformers
    # writes them empty, other writers leave them out; either way they are not loaded
    missing = [k for k, shape in layout.items() if k not in raw and not _empty(shape)]
    if missing:
        raise WeightsError(f"{hf_dir}: checkpoint is missing key(s) {_more(missing)} for a {family} "
                           f"model as config.json describes it")
    unexpected = [k for k in raw if k not in layout and not ignorable(k)]
    if unexpected:
        raise WeightsError(f"{hf_dir}: unexpected checkpoint key(s) {_more(unexpected)} for a {family} model")
    for key, shape in layout.items():
        if key in raw and tuple(raw[key].shape) != tuple(shape):
            raise WeightsError(f"{hf_dir}: {key} has shape {list(raw[key].shape)}, expected {list(shape)} "
                               f"from config.json")
