"""CPU STAND-IN for torchair / torch_npu -- graph structure, lowering wiring and documented kernel
limits on CPU, never NPU behaviour.

``install()`` makes NPU-targeted generated code traceable on a CPU-only machine:

* registers the ``air::`` and ``npu::`` ops (``graphgen.npu.standin.oplib``: real schemas from
  ``manifest.json``, reference kernels from ``graphgen.npu.standin.kernels``, the documented limits of
  ``graphgen.npu.check.limits`` checked on every call, at trace time and when run);
* puts fake ``torchair`` and ``torch_npu`` modules into ``sys.modules`` (this file), with a
  ``torch.compile`` backend that runs AOT autograd as torchair does and models its re-inplace pass.

It does nothing when ``torch_npu`` is installed (registering the same ``air``/``npu`` ops a
second time would fail, and the real thing should be used).  Nothing here runs on an NPU.
"""
from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import oplib
from .oplib import AIR_OPS, NPU_OPS, enforce_limits  # noqa: F401  (re-exported: callers import them here)

STANDIN_LABEL = "<graphgen CPU stand-in: graph structure and wiring checks only, not NPU behaviour>"
_MANIFEST = Path(__file__).resolve().parents[1] / "manifest.json"  # graphgen/npu/manifest.json
_state = oplib._state


def torch_npu_available() -> bool:
    """Is the REAL torch_npu installed?  (Our own stand-in in sys.modules does not count.)"""
    mod = sys.modules.get("torch_npu")
    if mod is not None:
        return not is_standin(mod)
    try:
        return importlib.util.find_spec("torch_npu") is not None
    except (ValueError, ImportError):
        return False


# --------------------------------------------------------------------------- fake torchair
class _Scope:
    """Context manager emitting air.scope_enter / air.scope_exit, as torchair.scope does."""

    def __init__(self, keys, values):
        self.keys, self.values = keys, values

    def __enter__(self):
        return torch.ops.air.scope_enter(self.keys, self.values)

    def __exit__(self, *exc):
        torch.ops.air.scope_exit()
        return False


def _npu_stream_switch(stream_tag: str, stream_priority: int = 0, enable_inner_parallel: bool = True):
    return _Scope(["_user_stream_label", "_user_stream_priority", "_enable_inner_parallel"],
                  [stream_tag, str(stream_priority), str(enable_inner_parallel)])


def _npu_wait_tensor(self, dependency):
    return torch.ops.air.wait_tensor(self, dependency)


def _record():
    return torch.ops.air.record()


def _wait(tensors: list):
    if not tensors:
        raise ValueError("torchair.ops.wait() requires at least one tensor input")
    return torch.ops.air.wait(tensors)


@dataclass(frozen=True)
class StandinTaggedEvent:
    """Stand-in for the torch.npu.Event that torchair.ops.npu_create_tagged_event returns."""
    tag: str


_TAGS: dict[str, StandinTaggedEvent] = {}


def _npu_create_tagged_event(tag: str):
    if tag in _TAGS:  # torchair raises the same error for a reused tag
        raise ValueError(f"tagged event tag {tag} is already in use")
    _TAGS[tag] = StandinTaggedEvent(tag)
    return _TAGS[tag]


def _npu_tagged_event_record(event):
    return torch.ops.air.tagged_event_record(event.tag)


def _npu_tagged_event_wait(event):
    return torch.ops.air.tagged_event_wait(event.tag)


def _npu_record_tagged_stream(input, tagged_stream: str):
    return torch.ops.air.record_tagged_stream_(input, tagged_stream)


class _Option:
    def __init__(self, default, choices):
        self.value, self.choices = default, choices


class CompilerConfig:
    """Stand-in: only ``mode``, ``experimental_config.tiling_schedule_optimize`` (torchair's default False,
    ``air/configs/experimental_config.py:28``) and a ``debug`` namespace -- the options graphgen sets."""

    def __init__(self):
        object.__setattr__(self, "mode", _Option("max-autotune", ["max-autotune", "reduce-overhead", "npugraph_ex"]))
        object.__setattr__(self, "debug", types.SimpleNamespace(graph_dump=types.SimpleNamespace(type=None)))
        object.__setattr__(self, "experimental_config", types.SimpleNamespace(tiling_schedule_optimize=False))

    def __setattr__(self, name, value):
        # torchair's config objects accept `cfg.mode = "reduce-overhead"` and validate it.
        if name == "mode":
            if value not in self.mode.choices:
                raise ValueError(f"mode must be one of {self.mode.choices}, got {value!r}")
            self.mode.value = value
        else:
            object.__setattr__(self, name, value)


@dataclass
class CapturedGraph:
    """One compiled graph: the raw post-AOT forward and the graph after the modelled torchair passes."""
    mode: str
    raw: torch.fx.GraphModule        # exactly what AOT autograd handed to the compiler
    gm: torch.fx.GraphModule         # after modelled torchair re-inplacing (what would be lowered)
    example_inputs: list
    reinplaced: list = field(default_factory=list)

    def placeholder_for(self, tensor: torch.Tensor, graph: str = "gm") -> str:
        """Name of the graph input that receives ``tensor`` (matched by identity/storage)."""
        g = getattr(self, graph)
        phs = [n for n in g.graph.nodes if n.op == "placeholder"]
        for n, ex in zip(phs, self.example_inputs):
            if ex is tensor or (isinstance(ex, torch.Tensor) and ex.data_ptr() == tensor.data_ptr()
                                and ex.shape == tensor.shape):
                return n.name
        raise KeyError("tensor is not an input of this graph")


class StandinBackend:
    """torch.compile backend: AOT autograd as torchair calls it, then the modelled re-inplace.

    torchair (npu_fx_compiler.py::_compile_graph_with_aot) calls ``aot_module_simplified`` with
    ``keep_inference_input_mutations=True`` (experimental_config default), so graph-input writes
    come back as trailing ``aten.copy_`` nodes.  Both graphs are captured for inspection.
    The decompositions are torchair's own table (``get_npu_backend`` -> ``_get_merged_decompositions``:
    its defaults, then the caller's), as extracted from the wheel into ``ge_converters.json``, so
    the captured graphs hold the ops GE would be handed (``graphgen.npu.check.geops``).
    """

    def __init__(self, compiler_config=None, custom_decompositions=None):
        from graphgen.npu.check.geops import torchair_decompositions

        self.config = compiler_config or CompilerConfig()
        self.decompositions = {**torchair_decompositions(), **(custom_decompositions or {})}
        self.graphs: list[CapturedGraph] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        from torch._functorch.aot_autograd import aot_module_simplified
        from graphgen.npu.check.aotcheck import model_torchair_reinplace

        mode = self.config.mode.value

        def fw_compiler(aot_gm: torch.fx.GraphModule, inputs):
            raw = copy.deepcopy(aot_gm)
            done = model_torchair_reinplace(aot_gm, mode)
            self.graphs.append(CapturedGraph(mode, raw, aot_gm, list(example_inputs), done))
            return aot_gm.forward

        # the mode-dependent limits (e.g. TND in reduce-overhead) are checked while AOT traces
        # and the static-graph rule: TND attention is refused under tiling sink (docs/npu.md, "Decode as a
        # static graph")
        sink = bool(getattr(getattr(self.config, "experimental_config", None), "tiling_schedule_optimize", False))
        with oplib.tracing_mode(mode, sink):
            return aot_module_simplified(gm, example_inputs, fw_compiler=fw_compiler,
                                         inference_compiler=fw_compiler, keep_inference_input_mutations=True,
                                         decompositions=self.decompositions)


def _get_npu_backend(*, compiler_config=None, custom_decompositions=None):
    backend = StandinBackend(compiler_config, custom_decompositions)
    if compiler_config is not None:  # cache_compile(config=...) compiles with it: its graphs stay inspectable
        compiler_config.standin_backend = backend
    return backend


class StandinCachedModel:
    """torchair.inference.cache_compile's bookkeeping, modelled (air/inference/_cache_compiler.py), not its
    serialisation: only a bound ``nn.Module`` method is accepted (:699-703); the entry lives at
    ``cache_dir/<class>_<dynamic|static>_<md5>/<func.__name__>/compiled_module`` (:203-235); it is written after
    the first graph compiles, and a second graph from the same code object logs "Skip cache as ... recompiled"
    and removes it (:555-573).  The file written is a marker naming the graph and its tensor inputs' sizes and
    strides, not a loadable cache; an entry that exists at the first call is "loaded" as
    ``LazyCompiledModel.compile`` does (:648-657: no guard, no compile), modelled by checking the inputs as
    the loaded kernel's ``assert_size_stride`` does, then running the method eagerly: ``loaded`` says so, and
    no graph is compiled."""

    FILE = "compiled_module"

    def __init__(self, func, config, dynamic: bool, cache_dir: str, ge_cache: bool = False, call=None):
        import hashlib
        import os
        import types as _types

        if not isinstance(func, _types.MethodType):
            raise ValueError(f"Only method can be cached now, got {func}")
        if not isinstance(func.__self__, torch.nn.Module):
            raise ValueError(f"Only torch.nn.Module method can be cached now, got {func}")
        config = config or CompilerConfig()
        self.backend = getattr(config, "standin_backend", None) or _get_npu_backend(compiler_config=config)
        md5 = hashlib.md5((str(func.__self__) + config.mode.value).encode()).hexdigest()  # nosec: a name
        cache_dir = cache_dir or os.path.join(os.getcwd(), ".torchair_cache")
        # GE's own cache: only under max-autotune (:231-232 names the entry "..._gecache_<md5>"; :711-713 warns
        # it has no effect otherwise); modelled as one ".om" marker beside the entry (GE's file naming)
        self.ge_cache = bool(ge_cache) and config.mode.value == "max-autotune"
        self.call = call or {}  # the keyword arguments cache_compile was called with (tests bind them to the wheel's)
        parts = [type(func.__self__).__name__, "dynamic" if dynamic else "static"] + (["gecache"] if self.ge_cache else [])
        self.cache_bin = Path(cache_dir) / "_".join(parts + [md5]) / func.__name__ / self.FILE
        self.compiled = torch.compile(func, backend=self.backend, fullgraph=True, dynamic=dynamic)
        self.graphs = 0  # graphs this code object compiled
        self.skipped = False
        self.func = func
        self.loaded = None  # decided at the first call, as LazyCompiledModel does

    @staticmethod
    def _tensor_inputs(args) -> list[tuple[list, list]]:
        """(shape, stride) of every tensor in ``args``, in the order Dynamo flattens them."""
        from graphgen.npu.trees import leaves

        return [[list(x.shape), list(x.stride())] for _, x in leaves(args) if isinstance(x, torch.Tensor)]

    def _assert_size_stride(self, args) -> None:
        """The loaded kernel's first-call check, modelled: torchair's codegen asserts every tensor input's
        size and stride as traced (``assert_size_stride(args[i], shape, stride)``,
        ``air/_ge_concrete_graph/fx2ge_converter.py:1412,2079-2087``) and nothing re-traces on a mismatch."""
        recorded = json.loads(self.cache_bin.read_text().split("\n", 1)[1] or "[]")
        for i, (want, got) in enumerate(zip(recorded, self._tensor_inputs(args))):
            if want != got:
                raise AssertionError(f"expected size/stride {want[0]}/{want[1]}, got {got[0]}/{got[1]} "
                                     f"at input {i} of the loaded {self.cache_bin.parent.name} "
                                     f"({STANDIN_LABEL}: torchair's assert_size_stride)")

    def __call__(self, *args, **kwargs):
        if self.loaded is None:
            self.loaded = self.cache_bin.exists()
            if self.loaded:
                self._assert_size_stride(args)
        if self.loaded:
            return self.func(*args, **kwargs)
        before = len(self.backend.graphs)
        out = self.compiled(*args, **kwargs)
        if len(self.backend.graphs) > before:
            self.graphs += 1
            if self.graphs == 1:
                self.cache_bin.parent.mkdir(parents=True, exist_ok=True)
                self.cache_bin.write_text(f"{STANDIN_LABEL}: cache entry of {self.cache_bin.parent.name}\n"
                                          + json.dumps(self._tensor_inputs(args)))
                if self.ge_cache:  # GE saves <graph_key>_<time>.om in ge.graph_compiler_cache_dir (CANN 图编译缓存)
                    (self.cache_bin.parent / f"{self.cache_bin.parent.name}_standin.om").write_text(
                        f"{STANDIN_LABEL}: GE model cache marker\n")
            elif not self.skipped:
                import shutil
                import warnings

                warnings.warn(f"Skip cache as {self.cache_bin.parent.name} recompiled", UserWarning)
                shutil.rmtree(self.cache_bin.parent, ignore_errors=True)
                self.skipped = True
        return out


def _cache_compile(func, *, config=None, backend=None, dynamic=True, cache_dir=None, global_rank=None, tp_rank=None,
                   pp_rank=None, custom_decompositions=None, ge_cache=False, **kwargs):
    call = dict(config=config, backend=backend, dynamic=dynamic, cache_dir=cache_dir, global_rank=global_rank,
                tp_rank=tp_rank, pp_rank=pp_rank, custom_decompositions=custom_decompositions, ge_cache=ge_cache,
                **kwargs)
    return StandinCachedModel(func, config, dynamic, cache_dir, ge_cache, call)


def _build_modules() -> dict[str, types.ModuleType]:
    def mod(name, doc, **attrs):
        m = types.ModuleType(name, doc)
        m.__file__ = STANDIN_LABEL
        m.__graphgen_standin__ = True
        for k, v in attrs.items():
            setattr(m, k, v)
        return m

    doc = "CPU STAND-IN for torchair (graphgen.npu.standin.fakes): graph structure and wiring checks only, not NPU behaviour."
    scope = mod("torchair.scope", doc, npu_stream_switch=_npu_stream_switch, npu_wait_tensor=_npu_wait_tensor)
    ops = mod("torchair.ops", doc, record=_record, wait=_wait, npu_create_tagged_event=_npu_create_tagged_event,
              npu_tagged_event_record=_npu_tagged_event_record, npu_tagged_event_wait=_npu_tagged_event_wait,
              npu_record_tagged_stream=_npu_record_tagged_stream)
    inference = mod("torchair.inference", doc, cache_compile=_cache_compile)
    torchair = mod("torchair", doc, scope=scope, ops=ops, inference=inference, CompilerConfig=CompilerConfig,
                   get_npu_backend=_get_npu_backend)
    tn_doc = "CPU STAND-IN for torch_npu (graphgen.npu.standin.fakes): torch_npu.<op> -> torch.ops.npu.<op>."
    torch_npu = mod("torch_npu", tn_doc, **{n: getattr(torch.ops.npu, n) for n in NPU_OPS})
    return {"torchair": torchair, "torchair.scope": scope, "torchair.ops": ops,
            "torchair.inference": inference, "torch_npu": torch_npu}


def install() -> bool:
    """Install the stand-in; returns False (and does nothing) when torch_npu is installed."""
    if torch_npu_available():
        return False
    if _state["installed"]:
        if _state.get("modules"):
            sys.modules.update(_state["modules"])  # re-insert after uninstall(); ops stay registered
        return True
    manifest = json.loads(_MANIFEST.read_text())
    oplib.register_ops(manifest)
    mods = _build_modules()
    _state["modules"] = mods
    for name, m in mods.items():
        existing = sys.modules.get(name)
        if existing is not None and not getattr(existing, "__graphgen_standin__", False):
            raise RuntimeError(f"a real {name} module is already imported; refusing to shadow it")
        sys.modules[name] = m
    _state["installed"] = True
    return True


def uninstall() -> None:
    """Remove the fake ``torchair``/``torch_npu`` modules from ``sys.modules`` (the registered ops stay).

    Other libraries probe ``importlib.util.find_spec("torch_npu")`` (transformers does): a stand-in
    left in ``sys.modules`` would make them fail or, worse, believe an NPU is present."""
    for name, m in (_state.get("modules") or {}).items():
        if sys.modules.get(name) is m:
            del sys.modules[name]


def is_standin(module) -> bool:
    return bool(getattr(module, "__graphgen_standin__", False))


@contextlib.contextmanager
def fresh_tags():
    """Tagged-event tags are process-global (as in torchair); tests use this to start clean."""
    saved = dict(_TAGS)
    _TAGS.clear()
    try:
        yield
    finally:
        _TAGS.clear()
        _TAGS.update(saved)
