"""Import a Hugging Face ``config.json`` as a graphgen spec.

``spec_from_hf_config(config, name)`` maps a config dict to a :class:`ModelSpec`;
``import_hf(hf_dir, out_path)`` reads ``<hf_dir>/config.json`` and writes a readable YAML spec
with the three standard variants (``decode``, ``mempool_prefill``, ``splitfuse``), async pool
writes with ``prefix_cache``, and the cpu + npu targets.

Supported: ``model_type`` ``qwen3`` and ``deepseek_v3``, in both the transformers 4 layout
(``rope_theta`` + ``rope_scaling``, ``torch_dtype``) and the transformers 5 one
(``rope_parameters``, ``dtype``). Anything graphgen would not reproduce exactly (another model
type, a missing field, Qwen3 with RoPE scaling, DeepSeek routing other than ``noaux_tc`` +
``sigmoid``, quantized checkpoints, ...) is a :class:`SpecError` naming the config file, the field
and why -- never silently dropped. DeepSeek-V3's MTP layers (``num_nextn_predict_layers``) become
the ``mtp:`` section (plus an ``mtp_draft`` variant; the targets as any import) when the checkpoint holds their
tensors.
Torch-free: the config is read with ``json`` (and a safetensors header as JSON).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import typing
from pathlib import Path
from typing import Any, Optional, Sequence

from . import model as m
from .compat import check_compat
from .errors import Diagnostic, SpecError
from ..families import BY_HF_MODEL_TYPE
from ..install import source_checkout
from .dump import dump_spec_yaml
from .loader import parse_spec_text
from ..families.base import Family

# What each family reads from a config (model_type, the defaults transformers assumes for omitted
# fields, the values graphgen reproduces) is declared by the family (graphgen/families).
_YARN_KEYS = {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"}
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


class _Report:
    def __init__(self, source: str, text: str | None):
        self.source = source
        self.lines = text.splitlines() if text else []
        self.diags: list[Diagnostic] = []
        self.notes: list[str] = []

    def where(self, key: str) -> tuple[int, int]:
        """Line/column of ``"key":`` in the config text (1:1 when unknown or absent)."""
        needle = f'"{key}"'
        for i, line in enumerate(self.lines):
            col = line.find(needle)
            if col >= 0 and line[col + len(needle):].lstrip().startswith(":"):
                return i + 1, col + 1
        return 1, 1

    def error(self, key: str, message: str, fix: str) -> None:
        self.diags.append(Diagnostic(self.source, *self.where(key), f"{key}: {message}", fix))


def _typed(cfg: dict[str, Any], key: str, tp: type[Any], rep: _Report, *, default: Any = dataclasses.MISSING,
           model_type: str = "") -> Any:
    if key not in cfg or cfg[key] is None:
        if default is not dataclasses.MISSING:
            return default
        rep.error(key, f"missing (a {model_type} config needs it)", f"add \"{key}\" to the config")
        return dataclasses.MISSING
    value = cfg[key]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)) or (
            tp is float and not math.isfinite(value)):
        kind = {int: "an integer", float: "a finite number", bool: "true or false"}[tp]
        rep.error(key, f"expected {kind}, got {value!r}", f"write {kind} (unquoted JSON)")
        return dataclasses.MISSING
    return value


def _rope(cfg: dict[str, Any], fam: Family, rep: _Report) -> tuple[Any, Any]:
    """(rope_theta, RopeScaling|None) from ``rope_parameters`` (transformers 5) or
    ``rope_theta`` + ``rope_scaling`` (transformers 4)."""
    params: Any  # the scaling parameters: a JSON object, once checked
    if isinstance(cfg.get("rope_parameters"), dict):
        key, params = "rope_parameters", dict(cfg["rope_parameters"])
        theta = _typed(params, "rope_theta", float, rep, default=fam.hf_defaults["rope_theta"])
    else:
        theta = _typed(cfg, "rope_theta", float, rep, default=fam.hf_defaults["rope_theta"])
        key, params = "rope_scaling", cfg.get("rope_scaling")
        if params is None:
            return theta, None
        if not isinstance(params, dict):
            rep.error(key, f"expected an object or null, got {params!r}", "fix the config")
            return theta, dataclasses.MISSING
        params = dict(params)
    kind = params.pop("rope_type", None) or params.get("type") or "default"
    params.pop("type", None)
    params.pop("rope_theta", None)
    if kind == "default" and not params:
        return theta, None
    if not fam.rope_scaling:
        rep.error(key, f"{fam.label} with RoPE scaling ({kind}) is not implemented (feature 'yarn')",
                  f"use a config without rope scaling (graphgen reproduces unscaled {fam.label} only)")
        return theta, dataclasses.MISSING
    if kind != "yarn":
        rep.error(key, f"RoPE scaling type '{kind}' is not implemented (only yarn)", "use yarn or no scaling")
        return theta, dataclasses.MISSING
    extra = sorted(set(params) - _YARN_KEYS)
    if params.get("truncate", True) is True and "truncate" in extra:
        extra.remove("truncate")  # truncate: true is the YaRN default DeepSeek uses
    if extra:
        rep.error(key, f"YaRN parameter(s) {', '.join(extra)} are not implemented",
                  f"remove {', '.join(extra)} (graphgen implements {', '.join(sorted(_YARN_KEYS))})")
        return theta, dataclasses.MISSING
    kwargs: dict[str, Any] = {"type": "yarn"}
    failed = False
    for f in dataclasses.fields(m.RopeScaling):
        if f.name == "type":
            continue
        if f.default is dataclasses.MISSING and params.get(f.name) is None:
            rep.error(key, f"YaRN needs '{f.name}'", f"add \"{f.name}\" to {key}")
            failed = True
            continue
        tp = int if f.name == "original_max_position_embeddings" else float
        value = _typed(params, f.name, tp, rep, default=f.default)
        if value is dataclasses.MISSING:
            failed = True
        else:
            kwargs[f.name] = value
    return theta, (dataclasses.MISSING if failed else m.RopeScaling(**kwargs))


def _dims(cfg: dict[str, Any], fam: Family, rep: _Report) -> Any:
    cls = fam.dims_cls
    hints = typing.get_type_hints(cls)
    theta, scaling = _rope(cfg, fam, rep)
    kwargs, failed = {}, theta is dataclasses.MISSING or scaling is dataclasses.MISSING
    for f in dataclasses.fields(cls):
        name = f.name
        if name == "rope_theta":
            kwargs[name] = theta
            continue
        if name == "rope_scaling":
            kwargs[name] = scaling
            continue
        tp, nullable = hints[name], False
        if typing.get_origin(tp) is typing.Union:  # Optional[int]: null has a meaning (q_lora_rank)
            (tp,) = [a for a in typing.get_args(tp) if a is not type(None)]
            nullable = True
        if nullable and name in cfg and cfg[name] is None:
            kwargs[name] = None
            continue
        default = fam.hf_defaults.get(name, dataclasses.MISSING)
        value = _typed(cfg, name, tp, rep, default=default, model_type=fam.hf_model_type)
        if value is dataclasses.MISSING:
            failed = True
            continue
        bound = f.metadata.get("minimum")
        if bound is not None and value < bound:
            rep.error(name, f"must be >= {bound}, got {value}", "fix the config")
            failed = True
            continue
        kwargs[name] = value
    return None if failed else cls(**kwargs)


def _checks(cfg: dict[str, Any], fam: Family, rep: _Report) -> None:
    for key, want in fam.hf_must_be.items():
        if key in cfg and cfg[key] is not None and cfg[key] != want:
            rep.error(key, f"{cfg[key]!r} is not implemented (graphgen reproduces {want!r})",
                      f"only configs with \"{key}\": {json.dumps(want)} can be imported")
    for key, message, fix in fam.hf_checks(cfg):
        rep.error(key, message, fix)
    rep.notes.extend(fam.hf_notes(cfg))


_FP8_FIELDS = {"fmt": "e4m3", "activation_scheme": "dynamic"}


def fp8_checkpoint_of(qc: Any) -> tuple[Optional[m.Fp8Checkpoint], Optional[tuple[str, str]]]:
    """(the spec's `Fp8Checkpoint`, None) for config.json's ``quantization_config`` (None: none given), or
    (None, (message, fix)) for one graphgen does not read: one sentence naming what is supported."""
    if qc is None:
        return None, None
    supported = ("graphgen reads fp8 checkpoints only (quant_method fp8, fmt e4m3, activation_scheme dynamic, "
                 "a two-number weight_block_size: DeepSeek-V3's published layout)")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method != "fp8":
        return None, (f"quant_method {method!r} is not supported: {supported}",
                      "use the fp8 checkpoint or a dequantized (bfloat16) one without quantization_config")
    wrong = [f"{k} {qc.get(k)!r}" for k, want in _FP8_FIELDS.items() if qc.get(k, want) != want]
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and not isinstance(b, bool)
                                                                 and b > 0 for b in block)):
        wrong.append(f"weight_block_size {block!r}")
    if wrong:
        return None, (f"{', '.join(wrong)} is not supported: {supported}",
                      "use the fp8 checkpoint as published, or a dequantized (bfloat16) one")
    return m.Fp8Checkpoint(weight_block_size=tuple(block)), None


def _kv_dtype(cfg: dict[str, Any], rep: _Report) -> str | None:
    key = "dtype" if cfg.get("dtype") is not None else "torch_dtype"
    value = cfg.get(key)
    if value is None:
        rep.notes.append("The config names no dtype: the KV cache is float32 (what transformers loads).")
        return "float32"
    if value not in _DTYPES:
        rep.error(key, f"{value!r} has no KV-cache dtype in graphgen", f"use one of: {', '.join(_DTYPES)}")
        return None
    return _DTYPES[value]


class LayoutError(ValueError):
    """``import_hf``'s layout options do not fit the model (one sentence naming the fix)."""


def _standard_spec(name: str, family: Any, dims: Any, dtype: Any, description: str, block_size: int,
                   compile_modes: Sequence[Any], device_memory_gib: float | None = None) -> m.ModelSpec:
    return m.ModelSpec(
        name=name, family=family, dims=dims, description=description,
        variants={
            "decode": m.Variant(phase="decode"),
            "mempool_prefill": m.Variant(phase="prefill", history=False),
            "splitfuse": m.Variant(phase="prefill", history=True),
        },
        kv_cache=m.KVCacheLayout(block_size=block_size, dtype=dtype),
        pool=m.PoolWrite(write="async", granularity="forward"),
        features=("prefix_cache",),
        targets=m.Targets(cpu=m.CpuTarget(), npu=m.NpuTarget(compile_modes=tuple(compile_modes),
                                                             device_memory_gib=device_memory_gib)),
    )


def _checkpoint_keys(hf_dir: Path) -> set[str] | None:
    """The tensor names of the checkpoint in ``hf_dir`` (the safetensors index, or the header of
    ``model.safetensors``: JSON after an 8-byte length, no torch needed); None when it holds no weights."""
    index = hf_dir / "model.safetensors.index.json"
    single = hf_dir / "model.safetensors"
    try:
        if index.exists():
            return set(json.loads(index.read_text())["weight_map"])
        if single.exists():
            with open(single, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                return set(json.loads(f.read(size))) - {"__metadata__"}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return None


def _mtp_section(config: dict[str, Any], fam: Family, keys: set[str] | None, rep: _Report) -> Optional[m.Mtp]:
    """The ``mtp:`` section for the MTP layers the config declares -- if the checkpoint holds them
    (transformers' DeepseekV3Config declares one by default, and ``save_pretrained`` writes none; a
    folder without weights cannot tell)."""
    declared = fam.mtp_layers_of_config(config)
    if not declared:
        return None
    first = f"model.layers.{config.get('num_hidden_layers')}.eh_proj.weight"
    if keys is None or first not in keys:
        why = "there are no weights to check" if keys is None else f"the checkpoint holds no MTP tensors ({first})"
        rep.notes.append(f"config.json declares num_nextn_predict_layers: {declared}, but {why}: no mtp: section "
                         f"(add 'mtp: {{num_layers: {declared}}}' and a 'phase: mtp' variant by hand; docs/mtp.md).")
        return None
    rep.notes.append(f"The checkpoint's MTP layer(s) (num_nextn_predict_layers: {declared}) are the mtp: section "
                     "and the mtp_draft variant (speculative decoding: graphgen run --speculative mtp; docs/mtp.md), "
                     "counted in the layout's memory; --speculative mtp runs on the CPU target at one rank so far "
                     "(not yet on the NPU runner).")
    return m.Mtp(num_layers=declared)


def _convert(config: Any, name: str, source: str, text: str | None, *, block_size: int = 128,
             compile_modes: Sequence[str] = ("max-autotune",), checkpoint_keys: set[str] | None = None,
             device_memory_gib: float | None = None, quantization: m.QuantMethod = "none"
             ) -> tuple[m.ModelSpec, list[str]]:
    rep = _Report(source, text)
    if not isinstance(config, dict):
        raise SpecError([Diagnostic(source, 1, 1, "the config is not a JSON object", "use a model config.json")])
    model_type = config.get("model_type")
    if model_type not in BY_HF_MODEL_TYPE:
        rep.error("model_type", f"{model_type!r} is not supported" if model_type else "missing",
                  f"graphgen imports model_type {' or '.join(BY_HF_MODEL_TYPE)}")
        raise SpecError(rep.diags)
    fam = BY_HF_MODEL_TYPE[model_type]
    if not m.is_identifier(name):
        rep.diags.append(Diagnostic(source, 1, 1, f"spec name {name!r} is not a Python identifier",
                                    "pass name= with letters, digits and underscores, e.g. my_model"))
    _checks(config, fam, rep)
    fp8, refused = fp8_checkpoint_of(config.get("quantization_config"))
    if refused:
        rep.error("quantization_config", *refused)
    dims = _dims(config, fam, rep)
    dtype = _kv_dtype(config, rep)
    if rep.diags:
        raise SpecError(rep.diags)
    spec = _standard_spec(name, fam.name, dims, dtype, f"Imported from a Hugging Face {model_type} config.",
                          block_size, compile_modes, device_memory_gib)
    if fp8 is not None or quantization != "none":
        spec = dataclasses.replace(spec, quantization=m.Quantization(method=quantization, checkpoint=fp8))
    if fp8 is not None:
        rep.notes.append(f"The checkpoint's weights are FP8 (e4m3, one scale per {list(fp8.weight_block_size)} "
                         "block): the quantization: section records it; the loader dequantizes each rank's slice"
                         + (" and quantizes the linear layers to int8 (w8a8_dynamic)." if quantization != "none"
                            else " to the compute dtype (--quantization w8a8_dynamic: int8 weights, half the "
                                 "memory of bfloat16)."))
    mtp = _mtp_section(config, fam, checkpoint_keys, rep)
    if mtp is not None:
        spec = dataclasses.replace(spec, mtp=mtp, variants={**spec.variants, "mtp_draft": m.Variant(phase="mtp")})
    # Shape rules (heads divide, even RoPE dims, expert groups, ...): dims keep HF's names, so
    # each problem names the config field.
    for where, message, fix in check_compat(spec):
        field_name = where.split(".")[-1] if where.startswith("dims.") else "model_type"
        rep.error(field_name, message, fix)
    if rep.diags:
        raise SpecError(rep.diags)
    return spec, rep.notes


def spec_from_hf_config(config: dict[str, Any], name: str, *, source: str = "config.json") -> m.ModelSpec:
    """The standard spec of a Hugging Face config dict; :class:`SpecError` if it is unsupported."""
    return _convert(config, name, source, None)[0]


def _default_name(hf_dir: Path) -> str:
    base = re.sub(r"[^0-9A-Za-z_]+", "_", hf_dir.resolve().name).strip("_").lower() or "model"
    return base if m.is_identifier(base) else f"m_{base}"


@dataclasses.dataclass(frozen=True)
class LayoutPick:
    """What a `LayoutChoice` picked: the spec's layout ``{"tp", "ep"[, "dp"]}``, the note for the spec's header,
    and the device it fitted (written as ``targets.npu.device_memory_gib``: validate then holds the spec to
    the device the layout was chosen for, not to a default)."""
    layout: dict[str, int]
    note: str
    device_memory_gib: float


class LayoutChoice(typing.Protocol):
    """``import-hf --fit``'s layout picker (`graphgen.passes.memory.choose_layout`: the spec model sits
    below the passes, so the CLI hands the picker in): a `LayoutPick`, or `LayoutError` when nothing fits."""

    def __call__(self, spec: m.ModelSpec) -> LayoutPick: ...


def _layout(spec: m.ModelSpec, tp: int | None, ep: int | None, dp: int | None, fit: LayoutChoice | None,
            rep_notes: list[str]) -> m.ModelSpec:
    """The spec with the layout asked for (``--tp/--ep/--dp``), or with ``fit`` the one it picks (the
    smallest that fits the device as ``graphgen validate`` counts it, and that device); `LayoutError` when
    the layout breaks a rule or nothing fits."""
    if fit is not None:
        pick = fit(spec)
        rep_notes.append(pick.note)
        tp, ep, dp = pick.layout["tp"], pick.layout["ep"], pick.layout.get("dp")
        if spec.targets.npu is not None:
            npu = dataclasses.replace(spec.targets.npu, device_memory_gib=pick.device_memory_gib)
            spec = dataclasses.replace(spec, targets=dataclasses.replace(spec.targets, npu=npu))
    if tp is None and ep is None and dp is None:
        return spec
    out = spec.with_overrides(tp=tp, ep=ep, dp=dp)
    from ..families.parallel import layout_rules

    bad = list(layout_rules(out.family, out.dims, out.parallel)) + [p for p in check_compat(out)
                                                                    if p[0].startswith("parallel")]
    if bad:
        where, message, fix = bad[0]
        raise LayoutError(f"{where}: {message}; fix: {fix}")
    return out


def import_hf(hf_dir: str | Path, out_path: str | Path, name: str | None = None, *, block_size: int = 128,
              compile_modes: Sequence[str] = ("max-autotune",), tp: int | None = None, ep: int | None = None,
              dp: int | None = None, device_memory_gib: float | None = None, fit: LayoutChoice | None = None,
              quantization: m.QuantMethod = "none") -> m.ModelSpec:
    """Read ``<hf_dir>/config.json``, write its spec to ``out_path`` (YAML) and return it. ``tp``/``ep``/
    ``dp``: its ``parallel:`` layout; ``device_memory_gib``: ``targets.npu.device_memory_gib``; ``fit``:
    a picker of the layout instead (`LayoutChoice`: the CLI's ``--fit`` gives
    `graphgen.passes.memory.choose_layout`, the smallest layout that fits the device); ``quantization``:
    ``quantization.method`` (``w8a8_dynamic``: int8 linear layers)."""
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    source = hf_dir / "config.json"
    try:
        text = source.read_text(encoding="utf-8")
    except OSError as e:
        raise SpecError([Diagnostic(str(source), 1, 1, f"cannot read config: {e.strerror}",
                                    "point at a Hugging Face model directory")]) from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecError([Diagnostic(str(source), e.lineno, e.colno, f"invalid JSON: {e.msg}",
                                    "fix the JSON syntax")]) from None
    spec, notes = _convert(config, name or _default_name(hf_dir), str(source), text,
                           block_size=block_size, compile_modes=compile_modes,
                           checkpoint_keys=_checkpoint_keys(hf_dir), device_memory_gib=device_memory_gib,
                           quantization=quantization)
    spec = _layout(spec, tp, ep, dp, fit, notes)
    header = "\n".join([f"Imported from {hf_dir.name}/config.json (model_type {config['model_type']}) "
                        "by graphgen.modelspec.import_hf.", *notes])
    out_path.parent.mkdir(parents=True, exist_ok=True)
    repo = source_checkout()
    rel = None
    # editors find the schema only inside a source checkout (a wheel ships none: `graphgen schema`)
    if repo is not None and out_path.resolve().is_relative_to(repo):
        rel = os.path.relpath(repo / "specs" / "schema.json", out_path.resolve().parent).replace(os.sep, "/")
    text_out = dump_spec_yaml(spec, header=header, schema=rel)
    if parse_spec_text(text_out, str(out_path)) != spec:  # the dump contract; never expected to fire
        raise AssertionError("dumped spec does not parse back equal")
    out_path.write_text(text_out, encoding="utf-8")
    return spec
