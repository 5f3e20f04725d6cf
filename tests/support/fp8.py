"""FP8 checkpoints in DeepSeek-V3's published layout, made from an unquantized one (the tests' data).

Every tensor `graphgen.runtime.checkpoint.index.published_fp8` names is stored ``float8_e4m3fn`` with a
float32 ``<name>.weight_scale_inv`` per ``block`` (the scale that multiplies the fp8 values back:
max |w| of the block / 448, e4m3's largest finite value), and config.json gains the published
``quantization_config`` with that block size. What these values mean is decided by the readers the
tests compare (transformers' FP8 dequantization, DeepSeek-V3's ``weight_dequant``), not here: this only
writes bytes in the published format.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

E4M3_MAX = 448.0


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, float32 scales [ceil(r / b0), ceil(c / b1)]) of a 2-D weight, the last blocks partial."""
    b0, b1 = block
    r, c = w.shape
    sr, sc = math.ceil(r / b0), math.ceil(c / b1)
    padded = torch.zeros(sr * b0, sc * b1, dtype=torch.float32)
    padded[:r, :c] = w.float()
    tiles = padded.view(sr, b0, sc, b1)
    scale = tiles.abs().amax(dim=(1, 3)) / E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (tiles / scale[:, None, :, None]).view(sr * b0, sc * b1)[:r, :c]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def to_fp8_checkpoint(src: str | Path, out: str | Path, block: tuple[int, int]) -> Path:
    """``src`` (config.json + model.safetensors) rewritten into ``out`` in the published FP8 layout."""
    from safetensors.torch import load_file, save_file

    from graphgen.runtime.checkpoint.index import SCALE_SUFFIX, published_fp8

    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for key, t in load_file(str(src / "model.safetensors")).items():
        if published_fp8(key, t.shape) and t.numel():
            tensors[key], tensors[key[:-len(".weight")] + SCALE_SUFFIX] = quantize_fp8_blocks(t, block)
        else:
            tensors[key] = t
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for extra in src.iterdir():  # tokenizer, generation config
        if extra.name not in ("config.json", "model.safetensors") and extra.is_file():
            (out / extra.name).write_bytes(extra.read_bytes())
    return out
