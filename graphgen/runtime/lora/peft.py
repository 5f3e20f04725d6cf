"""Read a PEFT LoRA adapter as published -- ``adapter_config.json`` + ``adapter_model.safetensors`` -- and check it
against a spec, refusing what does not fit in one sentence that names the module (docs/lora.md).

Read: ``r``, ``lora_alpha``, ``use_rslora`` (scaling ``alpha / sqrt(r)`` instead of ``alpha / r``, PEFT's
``LoraLayer.update_layer``), ``target_modules`` (a list of module names, or PEFT's regex string), and the
weights ``base_model.model.<key>.lora_A.weight`` ``[r, in]`` / ``lora_B.weight`` ``[out, r]`` of each adapted
linear layer. Refused (PEFT features whose math is not ``x A^T B^T scaling``): DoRA, biases, ``modules_to_save``,
per-module rank/alpha patterns, LoRA on embeddings; and anything that does not fit the spec: a rank over
``lora.max_lora_rank``, a target module the model lacks or the spec's ``lora.targets`` leave out, a shape that is
not the model's. The adapter's identity is ``digest``: sha256 over the canonical config fields read and the
weight file's bytes -- what salts its pool keys (its weights, not its name: a renamed copy shares blocks, a
retrained one under the same name does not).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...lora import lora_modules, lora_weight_keys, module_of

if TYPE_CHECKING:
    from ...modelspec.model import ModelSpec

__all__ = ["Adapter", "AdapterError", "read_adapter", "CONFIG_FILE", "WEIGHTS_FILE"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_KEY = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])(?:\.[A-Za-z0-9_]+)?\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served under the spec; the message is one sentence with the fix."""


@dataclass(frozen=True)
class Adapter:
    """One adapter, checked against a spec: ``weights[key] = (A [r, in], B [out, r] x scaling)`` in float32 for
    every adapted checkpoint weight ``key`` (the scaling folded into B once, at read time)."""

    name: str
    path: str
    rank: int
    alpha: float
    use_rslora: bool
    digest: str  # hex sha256 of the config fields read and the weight file (the pool-key salt)
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(repr=False, compare=False)

    @property
    def scaling(self) -> float:
        return self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank


def _fail(path: Path, what: str, fix: str) -> AdapterError:
    return AdapterError(f"LoRA adapter {path}: {what}; {fix}")


def _config(path: Path) -> dict[str, Any]:
    cfg_file = path / CONFIG_FILE
    if not path.is_dir():
        raise _fail(path, "no such folder", "give the folder PEFT's save_pretrained wrote")
    if not cfg_file.is_file():
        raise _fail(path, f"{CONFIG_FILE} is missing", "give the folder PEFT's save_pretrained wrote")
    if not (path / WEIGHTS_FILE).is_file():
        extra = " (a .bin adapter: re-save it with safe_serialization=True)" if (path / "adapter_model.bin").is_file() else ""
        raise _fail(path, f"{WEIGHTS_FILE} is missing{extra}", "give the folder PEFT's save_pretrained wrote")
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _fail(path, f"{CONFIG_FILE} is not JSON ({e})", "re-save the adapter") from None
    if not isinstance(cfg, dict):
        raise _fail(path, f"{CONFIG_FILE} is not a JSON object", "re-save the adapter")
    return cfg


def _check_config(path: Path, cfg: dict[str, Any]) -> tuple[int, float, bool]:
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise _fail(path, f"peft_type is {cfg.get('peft_type')!r}, not LORA", "give a LoRA adapter")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise _fail(path, f"r is {r!r}, not a positive integer", "fix adapter_config.json's r")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise _fail(path, f"lora_alpha is {alpha!r}, not a number", "fix adapter_config.json's lora_alpha")
    refusals = (("target_parameters", "LoRA on parameters (target_parameters: MoE experts' weights, which peft "
                 "targets for gate/up/down_proj names on a MoE model)"),
                ("use_dora", "DoRA (use_dora: true)"), ("bias", "LoRA biases (bias other than none)"),
                ("modules_to_save", "modules_to_save (fully trained modules)"),
                ("rank_pattern", "per-module ranks (rank_pattern)"), ("alpha_pattern", "per-module alphas (alpha_pattern)"))
    for key, what in refusals:
        v = cfg.get(key)
        if v not in (None, False, "none", {}, []):
            raise _fail(path, f"{what} is not supported", "train the adapter as plain LoRA")
    return r, float(alpha), bool(cfg.get("use_rslora", False))


def read_adapter(path: str | Path, spec: "ModelSpec", *, name: str = "") -> Adapter:
    """The adapter in folder ``path``, checked against ``spec`` (AdapterError: one sentence, naming the module)."""
    from safetensors import safe_open

    path = Path(path)
    if spec.lora is None:
        raise AdapterError(f"spec {spec.name} has no lora: section, so it takes no adapter ({path}); "
                           f"add 'lora: {{max_loras: 4}}' to the spec")
    cfg = _config(path)
    r, alpha, rslora = _check_config(path, cfg)
    if r > spec.lora.max_lora_rank:
        raise _fail(path, f"rank r={r} exceeds lora.max_lora_rank {spec.lora.max_lora_rank}",
                    f"raise max_lora_rank (--max-lora-rank) to at least {r}")
    allowed = set(lora_modules(spec))
    adaptable = lora_weight_keys(spec)
    from ...families import FAMILIES

    family_mods = set(FAMILIES[spec.family].lora_modules)
    model_mods = {module_of(k) for k in FAMILIES[spec.family].checkpoint_layout(spec.dims)
                  if k.endswith(".weight") and k.count(".") >= 2}
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        for t in targets:
            mod = str(t).rsplit(".", 1)[-1]
            if mod not in model_mods:
                raise _fail(path, f"target module {t!r} is not a module of {spec.name}",
                            f"target some of {', '.join(sorted(allowed))}")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
        for k in f.keys():
            m = _KEY.match(k)
            if m is None:
                raise _fail(path, f"weight {k!r} is no LoRA A/B matrix of a linear layer",
                            "save only LoRA weights (no embeddings, DoRA magnitudes or trained modules)")
            pairs.setdefault(f"{m.group(1)}.weight", {})[m.group(2)] = f.get_tensor(k)
    if not pairs:
        raise _fail(path, f"{WEIGHTS_FILE} holds no LoRA weights", "re-save the adapter")
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    scaling = alpha / math.sqrt(r) if rslora else alpha / r
    for key in sorted(pairs):
        mod = module_of(key)
        ab = pairs[key]
        if set(ab) != {"A", "B"}:
            raise _fail(path, f"module {key[:-7]} has lora_{'A' if 'A' not in ab else 'B'} missing", "re-save the adapter")
        if key not in adaptable:
            if mod not in model_mods:
                why = f"targets {key[:-7]}, which {spec.name} lacks"
            elif mod in family_mods and mod not in allowed:
                why = f"targets {key[:-7]}, which the spec's lora.targets leave out"
            else:
                why = f"targets {key[:-7]}, which takes no adapter here (docs/lora.md: {', '.join(sorted(family_mods))} of the dense layers)"
            raise _fail(path, why, f"target some of {', '.join(sorted(allowed))}")
        a, b = ab["A"], ab["B"]
        out_f, in_f = adaptable[key]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r:
            raise _fail(path, f"module {key[:-7]} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, not rank r={r}",
                        "re-save the adapter (rank_pattern is not supported)")
        if a.shape[1] != in_f or b.shape[0] != out_f:
            raise _fail(path, f"module {key[:-7]} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                        f"{spec.name} needs [{r}, {in_f}] and [{out_f}, {r}]",
                        "use an adapter trained on this model")
        weights[key] = (a.float().contiguous(), (b.float() * scaling).contiguous())
    h = hashlib.sha256()
    canon = json.dumps({"r": r, "lora_alpha": alpha, "use_rslora": rslora}, sort_keys=True).encode()
    h.update(len(canon).to_bytes(8, "little") + canon)
    with open(path / WEIGHTS_FILE, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return Adapter(name=name or path.name, path=str(path), rank=r, alpha=alpha, use_rslora=rslora,
                   digest=h.hexdigest(), weights=weights)
