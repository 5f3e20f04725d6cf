"""compile_spec is the one door from a spec to sources (generate and compile_variant go through it)."""
from pathlib import Path

import pytest

from graphgen.generate import spec_outputs
from graphgen.lower.compile import compile_spec, compile_variant
from graphgen.modelspec.loader import load_spec

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def spec():
    return load_spec(REPO / "specs/tiny_qwen3_npu.yaml")


def test_every_variant_and_enabled_target_once_with_its_paths(spec):
    compiled = compile_spec(spec, variants=list(spec.variants)[:2])
    assert [(c.variant, c.target) for c in compiled] == [(v, t) for v in list(spec.variants)[:2] for t in ("cpu", "npu")]
    cpu, npu = compiled[:2]
    assert cpu.graph is npu.graph  # one pipeline run per variant, rendered per target
    assert list(cpu.sources) == [f"tiny_qwen3_npu/cpu/{cpu.variant}.py"]
    modes = spec.targets.npu.compile_modes
    assert list(npu.sources) == [f"tiny_qwen3_npu/npu/{m.replace('-', '_')}/{npu.variant}.py" for m in modes]


def test_compile_variant_and_generate_are_the_same_sources(spec):
    variant = next(iter(spec.variants))
    files = spec_outputs(spec, "specs/tiny_qwen3_npu.yaml")
    assert files[f"tiny_qwen3_npu/cpu/{variant}.py"] == compile_variant(spec, variant, "cpu",
                                                                         spec_file="specs/tiny_qwen3_npu.yaml")
    mode = spec.targets.npu.compile_modes[0]
    assert files[f"tiny_qwen3_npu/npu/{mode.replace('-', '_')}/{variant}.py"] == compile_variant(
        spec, variant, "npu", spec_file="specs/tiny_qwen3_npu.yaml")


def test_undeclared_or_unknown_target_is_refused():
    cpu_only = load_spec(REPO / "specs/tiny_qwen3.yaml")
    with pytest.raises(ValueError, match="does not declare the npu target"):
        compile_spec(cpu_only, targets=("npu",))
    with pytest.raises(ValueError, match="unknown target 'gpu'"):
        compile_variant(cpu_only, next(iter(cpu_only.variants)), "gpu")
