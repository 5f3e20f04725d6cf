"""Write a full-size checkpoint whose headers are true and whose tensor data are file holes.

    python scripts/sparse_checkpoint.py CONFIG_JSON OUT_DIR [--shard-gb 4]

``OUT_DIR`` gets ``config.json`` (a copy of CONFIG_JSON), ``model-0000k-of-0000n.safetensors`` shards and
``model.safetensors.index.json``, in the layout Hugging Face repos publish (Qwen/Qwen3-32B: 17 shards;
deepseek-ai/DeepSeek-V3.1: 163): every tensor the model's config implies (the family's checkpoint layout,
graphgen/families; MoE experts one key each; DeepSeek's MTP layers when ``num_nextn_predict_layers`` says
so), in the layer order of the published index, in the config's dtype. Each shard is its safetensors
header (https://huggingface.co/docs/safetensors, "Format") followed by a hole of exactly the data's size
(``truncate``): the files have their real sizes (a 65 GB Qwen3-32B) but occupy a few kilobytes of disk, and
read back as zeros. ``graphgen dry-run`` loads them as it would the real files (docs/npu.md, "Full-size
launch").

What is stored in which dtype is one table, `stored_tensors`: the config's dtype, except what the
published checkpoints keep in float32 (DeepSeek-V3's ``e_score_correction_bias``). A config with the
published FP8 ``quantization_config`` (DeepSeek-V3.1's: quant_method fp8, e4m3, ``weight_block_size``
[128, 128]) gets the published FP8 layout: each weight `graphgen.runtime.checkpoint.index.published_fp8`
names stored ``F8_E4M3``, followed by its float32 ``<name>.weight_scale_inv`` of one scale per block
(163 shards of 4 GB for DeepSeek-V3.1, as published). Any other quantization is refused in one sentence.
Torch-free: only the JSON headers are written.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from graphgen.families import BY_HF_MODEL_TYPE  # noqa: E402
from graphgen.modelspec.import_hf import fp8_checkpoint_of  # noqa: E402
from graphgen.runtime.checkpoint.index import SCALE_SUFFIX, published_fp8  # noqa: E402

ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1}
DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
FLOAT32_KEYS = (".e_score_correction_bias",)  # float32 in the published DeepSeek-V3 / V3.1 checkpoints
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class ConfigError(ValueError):
    """The config cannot be written as a checkpoint here (one sentence)."""


def stored_tensors(config: dict) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(key, safetensors dtype, shape)`` of every tensor of the published layout, in the order the
    published indexes list them: the embedding, each layer's tensors (MTP layers last), the final norm
    and the LM head (left out when tied, as a tied checkpoint omits it)."""
    fam = BY_HF_MODEL_TYPE.get(config.get("model_type"))
    if fam is None:
        raise ConfigError(f"model_type {config.get('model_type')!r} is not one of {sorted(BY_HF_MODEL_TYPE)}")
    fp8, refused = fp8_checkpoint_of(config.get("quantization_config"))
    if refused:
        raise ConfigError(f"quantization_config: {refused[0]}")
    dtype = DTYPES.get(config.get("torch_dtype") or config.get("dtype") or "float32")
    if dtype is None:
        raise ConfigError(f"dtype {config.get('torch_dtype') or config.get('dtype')!r} is not one of {sorted(DTYPES)}")
    mtp = fam.mtp_layers_of_config(config)
    layout = fam.checkpoint_layout(fam.dims_of(config), **({"mtp_layers": mtp} if mtp else {}))
    if config.get("tie_word_embeddings"):
        layout.pop("lm_head.weight")

    def order(key: str):
        m = _LAYER.match(key)
        return (1, int(m.group(1))) if m else ((0, 0) if "embed_tokens" in key else (2, 0))

    keys = sorted((k for k, s in layout.items() if 0 not in s), key=order)  # stable: the family's order inside
    out = []
    for k in keys:
        shape = tuple(layout[k])
        if fp8 is not None and published_fp8(k, shape):  # the FP8 weight, then its block scales
            b = fp8.weight_block_size
            out += [(k, "F8_E4M3", shape),
                    (k[:-len(".weight")] + SCALE_SUFFIX, "F32", tuple(-(-n // bi) for n, bi in zip(shape, b)))]
        else:
            out.append((k, "F32" if k.endswith(FLOAT32_KEYS) else dtype, shape))
    return out


def _shards(tensors, shard_bytes: int) -> list[list]:
    out, cur, size = [], [], 0
    for t in tensors:
        n = math.prod(t[2]) * ITEMSIZE[t[1]]
        if cur and size + n > shard_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += n
    return out + [cur] if cur else out


def _write_shard(path: Path, tensors) -> int:
    """One safetensors file: header, then a hole the size of the data; returns the data's size."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for key, dtype, shape in tensors:
        n = math.prod(shape) * ITEMSIZE[dtype]
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data start 8-byte aligned, as the reference writer does
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        f.truncate(8 + len(text) + offset)
    return offset


def write_sparse_checkpoint(config: dict, out_dir, shard_gb: float = 4.0) -> Path:
    """Write the sparse checkpoint of ``config`` into ``out_dir`` (see the module doc); returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards = _shards(stored_tensors(config), int(shard_gb * 1e9))
    weight_map, total = {}, 0
    for i, part in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        total += _write_shard(out / name, part)
        weight_map.update({key: name for key, _, _ in part})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="a Hugging Face config.json (e.g. Qwen/Qwen3-32B's)")
    p.add_argument("out", help="the checkpoint folder to write")
    p.add_argument("--shard-gb", type=float, default=4.0,
                   help="largest shard in GB of data (default 4, as the published repos)")
    args = p.parse_args(argv)
    try:
        config = json.loads(Path(args.config).read_text())
        out = write_sparse_checkpoint(config, args.out, args.shard_gb)
    except (OSError, ValueError) as e:
        print(f"sparse_checkpoint: {e}", file=sys.stderr)
        return 2
    files = sorted(out.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    disk = sum(f.stat().st_blocks * 512 for f in files)
    print(f"wrote {out}: {len(files)} shards, {size / (1 << 30):.2f} GiB apparent, {disk / 1024:.0f} KiB on disk")
    return 0


if __name__ == "__main__":
    sys.exit(main())
