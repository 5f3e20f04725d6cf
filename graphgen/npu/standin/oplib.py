"""torch.library registration of the ``air::`` and ``npu::`` ops for the CPU stand-in.

Schemas are the REAL ones from ``manifest.json`` (extracted from the torch-npu 2.14.0 wheel).  Every
``npu::`` op gets its reference kernel from ``graphgen.npu.standin.kernels`` for CPU and Meta, wrapped so the
op's rows in ``graphgen.npu.check.limits`` are checked first: a call outside a kernel's documented limits
raises ``KernelLimitError`` while Dynamo/AOT trace (Meta, fake tensors) and when run eagerly (CPU).
``enforce_limits(False)`` turns the check off for the wiring/structure tests of the tiny float32
specs, which are outside the hardware envelope by construction.  Nothing here runs on an NPU.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, Optional

import torch
from torch.fx.node import has_side_effect

from ..check import limits
from .kernels import CPU_KERNELS, META_KERNELS

# air:: ops torchair defines (all of them are registered so generated code may use any).
AIR_OPS = ("scope_enter", "scope_exit", "record", "wait", "wait_tensor", "tagged_event_record",
           "tagged_event_wait", "record_tagged_stream", "record_tagged_stream_")
# torchair marks these with has_side_effect so DCE keeps them (ops/_record_wait.py, scope/_scope.py,
# ops/_tagged_event.py); record is not marked: its output feeds a wait.
_AIR_SIDE_EFFECT = ("scope_enter", "scope_exit", "wait", "tagged_event_record", "tagged_event_wait",
                    "record_tagged_stream")
# npu:: kernels a Qwen3 dense layer and a DeepSeek MLA(+MoE) layer lowering uses; the KV write and
# the save both go through npu_scatter_nd_update_ (see docs/npu-research.md).
NPU_OPS = ("npu_scatter_nd_update", "npu_scatter_nd_update_", "npu_scatter_pa_kv_cache",
           "npu_scatter_pa_kv_cache_functional", "npu_rms_norm", "npu_add_rms_norm", "npu_swiglu",
           "npu_apply_rotary_pos_emb", "npu_interleave_rope", "npu_fused_infer_attention_score",
           "npu_fused_infer_attention_score_v2",  # the static decode graph's BSH/BNSD attention
           # DeepSeek-V3 MoE (real schemas from the manifest; CPU kernels are OUR reading of the docs)
           "npu_moe_gating_top_k", "npu_moe_init_routing_v2", "npu_grouped_matmul", "npu_moe_finalize_routing",
           "npu_moe_token_unpermute",
           # the permute/unpermute pair vllm-ascend ran in GE graphs (audit 3 N4; graphgen.lower.npu_helpers)
           "npu_moe_init_routing", "npu_moe_compute_expert_tokens",
           # W8A8 (dynamic): per-token activation quantization and the int8 products (graphgen.ir.quant)
           "npu_dynamic_quant", "npu_quant_matmul")

# Process-wide registration state (torch.library registrations cannot be undone cheaply, so they are
# made once); also the limits switch and the compile mode the stand-in backend is tracing.
_state: dict[str, Any] = {"installed": False, "libs": [], "enforce": True, "only": None, "mode": None,
                          "tiling_sink": False}


def _schema(manifest: dict, key: str) -> str:
    return manifest["op_schemas"][key]["schema"]


@contextlib.contextmanager
def enforce_limits(on: bool, only: Optional[set] = None):
    """Check (True, the default) or skip (False) the documented kernel limits inside the block;
    ``only``: check just these row keys (to show one row catches a call that breaks several)."""
    saved = _state["enforce"], _state["only"]
    _state["enforce"], _state["only"] = on, (set(only) if only is not None else None)
    try:
        yield
    finally:
        _state["enforce"], _state["only"] = saved


@contextlib.contextmanager
def tracing_mode(mode: Optional[str], tiling_sink: bool = False):
    """The compile mode being traced, and whether its config sinks tiling (tiling_schedule_optimize):
    limits that depend on them (TND in reduce-overhead, TND with tiling sink)."""
    saved = _state["mode"], _state["tiling_sink"]
    _state["mode"], _state["tiling_sink"] = mode, bool(tiling_sink)
    try:
        yield
    finally:
        _state["mode"], _state["tiling_sink"] = saved


def _checked(op: str, kernel: Callable) -> Callable:
    sig = inspect.signature(kernel)
    limit_op = op[:-1] if op.endswith("_") else op  # the in-place twin has the functional op's limits

    @functools.wraps(kernel)
    def run(*args, **kwargs):
        if _state["enforce"] and limits.BY_OP.get(limit_op):
            bound = sig.bind_partial(*args, **kwargs).arguments
            extra = bound.pop("kw", None) or bound.pop("kwargs", None) or {}
            limits.check_call(limits.Call(limit_op, {**bound, **extra}, _state["mode"], _state["tiling_sink"]), _state["only"])
        return kernel(*args, **kwargs)
    return run


def _functionalize_via(functional_name: str, mutated: tuple[int, ...]):
    """Functionalize kernel: call the functional twin, then replace the mutated inputs' values.

    Mirrors what torchgen-generated functionalization does for native mutable ops; without it
    AOT would try auto_functionalize, which rejects ``-> Tensor(a!)`` returns.
    """
    def kernel(*args, **kwargs):
        for i in mutated:
            torch._sync(args[i])
        unwrap = lambda t: torch._from_functional_tensor(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
        raw_args = [unwrap(a) for a in args]
        raw_kwargs = {k: unwrap(v) for k, v in kwargs.items()}
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)):
            out = getattr(torch.ops.npu, functional_name)(*raw_args, **raw_kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for i, new in zip(mutated, outs):
            torch._functionalize_replace(args[i], new)
            torch._functionalize_commit_update(args[i])
            torch._functionalize_sync(args[i])
        return args[mutated[0]] if not isinstance(out, (tuple, list)) else None
    return kernel


def register_ops(manifest: dict) -> None:
    """Register the air:: and npu:: ops once per process (a second call is a no-op)."""
    if not hasattr(torch.ops.air, "scope_enter"):
        air = torch.library.Library("air", "FRAGMENT")  # noqa: TOR901
        _state["libs"].append(air)
        for name in AIR_OPS:
            air.define(_schema(manifest, f"air::{name}"))
        noop = lambda *a, **k: None  # noqa: E731
        for name in AIR_OPS:
            if name == "record":
                air.impl(name, lambda *, device=None: torch.empty(0, device=device), "CompositeExplicitAutograd")
                air.impl(name, lambda *, device=None: torch.empty(0, device="meta"), "Meta")
            elif name == "wait_tensor":
                # max-autotune only on NPU; here an identity so graphs using it still trace.
                air.impl(name, lambda self, dependency: self.clone(), "CompositeExplicitAutograd")
            else:
                air.impl(name, noop, "CompositeExplicitAutograd")
        # record_tagged_stream_ does not really mutate; torchair routes its functionalization to the
        # non-mutating twin the same way (torchair/ops/_tagged_event.py).
        air.impl("record_tagged_stream_",
                 lambda input, tag: torch.ops.air.record_tagged_stream(torch._from_functional_tensor(input), tag),
                 "Functionalize")
        for name in _AIR_SIDE_EFFECT:
            has_side_effect(getattr(torch.ops.air, name).default)
    if not hasattr(torch.ops.npu, "npu_scatter_nd_update"):
        npu = torch.library.Library("npu", "FRAGMENT")  # noqa: TOR901
        _state["libs"].append(npu)
        for name in NPU_OPS:
            npu.define(_schema(manifest, f"npu::{name}"))
            npu.impl(name, _checked(name, CPU_KERNELS[name]), "CompositeExplicitAutograd")
            npu.impl(name, _checked(name, META_KERNELS.get(name, CPU_KERNELS[name])), "Meta")
        npu.impl("npu_scatter_nd_update_", _functionalize_via("npu_scatter_nd_update", (0,)), "Functionalize")
        npu.impl("npu_scatter_pa_kv_cache",
                 _functionalize_via("npu_scatter_pa_kv_cache_functional", (2, 3)), "Functionalize")
        # the pa kv cache write returns nothing: keep it from being dead-code eliminated when traced eagerly
        has_side_effect(torch.ops.npu.npu_scatter_pa_kv_cache.default)
