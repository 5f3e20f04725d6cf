"""Multi-LoRA on the build path (issue 40): the spec's ``lora:`` section with file:line errors, and the
``insert_lora`` pass (its contract, and the race check covering the adapter slots)."""

from __future__ import annotations

from pathlib import Path

import pytest

from graphgen.ir.graph import SAVE_STREAM, Node
from graphgen.lora import LORA_INDEX, lora_weight_keys, slot_buffer
from graphgen.modelspec.errors import SpecError
from graphgen.modelspec.loader import load_spec, parse_spec_text
from graphgen.passes.base import PassContext
from graphgen.passes.insert_lora import InsertLora
from graphgen.passes.manager import run_pipeline
from graphgen.passes.verify import check

ROOT = Path(__file__).resolve().parents[2]
QWEN = (ROOT / "specs/tiny_qwen3_lora.yaml").read_text()


def _errors(text: str) -> list[tuple[int, str, str]]:
    with pytest.raises(SpecError) as info:
        parse_spec_text(text, "lora.yaml")
    return [(d.line, d.message, d.fix) for d in info.value.diagnostics]


def _line(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


@pytest.mark.parametrize("edit, needle, says, fix", [
    ("  max_lora_rank: 8\n", "  max_lora_rank: 12\n", "max_lora_rank 12 is not one of", "use max_lora_rank: 16"),
    ("  targets: [q_proj, k_proj", "  targets: [qproj, k_proj", "lora target 'qproj' is no projection",
     "did you mean 'q_proj'?"),
    ("  targets: [q_proj, k_proj", "  targets: [k_proj, k_proj", "lora target 'k_proj' is listed twice",
     "remove the duplicate"),
    ("  max_loras: 2\n", "  max_loras: 0\n", "lora.max_loras: must be >= 1", "at least 1"),
])
def test_lora_section_errors_name_line_and_fix(edit, needle, says, fix):
    text = QWEN.replace(edit, needle)
    assert text != QWEN
    errs = _errors(text)
    assert len(errs) == 1, errs
    line, message, got_fix = errs[0]
    assert line == _line(text, needle.strip().split(":")[0] + ":") and says in message and fix in got_fix


def test_lora_with_parallel_ranks_is_refused_in_one_rule():
    text = QWEN.replace("targets:\n  cpu: {}\n", "targets:\n  cpu: {}\nparallel: {tp: 2}\n")
    assert any("not split over parallel ranks" in m for _, m, _ in _errors(text))


def test_multi_lora_is_a_section_not_a_feature():
    text = QWEN.replace("features: [prefix_cache]", "features: [prefix_cache, multi_lora]")
    (line, message, fix), = _errors(text)
    assert "enabled by the lora: section" in message and "lora: {max_loras: 4}" in fix


def test_insert_lora_adapts_every_targeted_projection_once():
    spec = load_spec(ROOT / "specs/tiny_qwen3_lora.yaml")
    g = run_pipeline(spec, "splitfuse")
    keys = lora_weight_keys(spec)
    assert len(keys) == 2 * 7  # 2 layers x q, k, v, o, gate, up, down
    read = [b for n in g.nodes if n.attrs.get("lora") for b in n.input("lora")[1:]]
    assert sorted(read) == sorted(slot_buffer(k) for k in keys)
    assert all(n.input("lora")[0] == LORA_INDEX for n in g.nodes if n.attrs.get("lora"))
    # DeepSeek-V3: MLA's projections and the dense layer's MLP; the MoE layers' experts take none
    ds = load_spec(ROOT / "specs/tiny_deepseek_v3_lora.yaml")
    dkeys = lora_weight_keys(ds)
    assert "model.layers.0.mlp.down_proj.weight" in dkeys and not any("experts" in k for k in dkeys)
    assert not any(k.startswith("model.layers.1.mlp") for k in dkeys)
    # a spec without lora: is left as it was
    plain = run_pipeline(load_spec(ROOT / "specs/tiny_qwen3.yaml"), "splitfuse")
    assert LORA_INDEX not in plain.names and not any(n.attrs.get("lora") for n in plain.nodes)


def test_the_race_check_covers_the_adapter_slots():
    """A write of an adapter slot on another stream, unordered with the forward's reads, is a race the verifier
    names (negative control: the shipped graph has none); the pass's ensures refuses any writer of a slot."""
    spec = load_spec(ROOT / "specs/tiny_qwen3_lora.yaml")
    g = run_pipeline(spec, "mempool_prefill")
    assert check(g) == []
    # layer 1's down_proj is read after the forward's last record: a save-stream write of it is unordered
    # (its q_proj, read before that record, would be ordered: the verifier tells the two apart)
    slot = slot_buffer("model.layers.1.mlp.down_proj.weight")
    bad = g.copy()
    # a (hypothetical) slot reload issued on the save stream while the step runs
    # (spliced in by hand: Graph.add admits schema-valid nodes only, and no op writes a slot)
    at = next(i for i, n in enumerate(bad.nodes) if n.stream == SAVE_STREAM)
    bad.nodes.insert(at + 1, Node("reload", "kv_save", SAVE_STREAM, reads=("kv_cache.L00", "save_block_ids"),
                                  writes=(slot,)))
    problems = check(bad)
    assert any(p.startswith(f"race on {slot}") for p in problems), problems
    ctx = PassContext(spec, "mempool_prefill")
    assert any("writes LoRA slots" in p for p in InsertLora().ensures(bad, ctx))
    assert InsertLora().ensures(g, ctx) == []


def test_the_npu_lowering_passes_every_adapted_projection_its_slots(tmp_path):
    """A spec with lora: and the npu target is accepted, and every NPU emitter of a node with LoRA operands
    hands its helper the LoRA-adapted weight (npu_calls.lora_weight: each adapted projection's slots at its
    output offset), never the bare weight that would drop the delta; a node without them, the bare weight."""
    import dataclasses
    import re

    from graphgen.lower import cpu
    from graphgen.lower.npu import NpuCtx, emit
    from graphgen.lower.render import Names
    from graphgen.modelspec.model import NpuTarget, Targets

    (tmp_path / "tiny_qwen3_lora.yaml").write_text(QWEN.replace("targets:\n  cpu: {}\n", "targets:\n  cpu: {}\n  npu: {}\n"))
    assert load_spec(tmp_path / "tiny_qwen3_lora.yaml").targets.npu is not None  # the spec rule accepts it
    spec = load_spec(ROOT / "specs/tiny_qwen3_lora.yaml")
    g = run_pipeline(dataclasses.replace(spec, targets=Targets(npu=NpuTarget())), "decode")
    ctx = NpuCtx(Names(g), "max-autotune", dict(g.events), {})
    adapted = [n for n in g.nodes if n.attrs.get("lora")]
    assert adapted
    for n in adapted:
        code = "\n".join(emit(n, ctx))
        segs = re.findall(r"\((\d+), b\.lora\['([^']+)'\]\)", code)
        assert '"sel": b.lora_sel' in code and len(segs) == len(n.attrs["lora"]), code
        # each adapted projection's slots at the offset the CPU lowering (written apart) gives them
        cpu_code = "\n".join(cpu.emit(n, cpu.CpuCtx(Names(g))))
        assert segs == re.findall(r"\((\d+), b\.lora\['([^']+)'\]\)", cpu_code), (code, cpu_code)
    assert any(int(o) > 0 for n in adapted for o in re.findall(r"\((\d+), b\.lora", "\n".join(emit(n, ctx))))  # a merged one
    bare = next(n for n in g.nodes if n.op == "lm_head")
    assert "b.lora" not in "\n".join(emit(bare, ctx))
