"""FP8 checkpoints as DeepSeek-V3.1 publishes them (issue 28 item 1): ``float8_e4m3fn`` weights with float32
``weight_scale_inv`` block scales and ``quantization_config: {quant_method: fp8, ...}`` in config.json.

* numerics against transformers 5.24's own FP8 dequantization (on a CPU it dequantizes an FP8 checkpoint at
  load: quantizers/quantizer_finegrained_fp8.py ``validate_environment``, integrations/finegrained_fp8.py
  ``Fp8Dequantize``): a tiny random DeepSeek-V3 in the published layout, block size [32, 32], through
  ``graphgen import-hf`` and the engine (the streaming loader), every step's logits within atol 1e-4 in
  float32; its MTP layer (the dict loader) against transformers' ``MtpModel`` on the same checkpoint;
* partial blocks and rank slices, which transformers' dequantization does not cover (it takes the block
  size from weight / scale-grid, exact only when every dim is a multiple of the block or one block): against
  DeepSeek-V3's ``inference/kernel.py`` ``weight_dequant`` semantics (block (i, j) of a [M, N] weight,
  the last ones partial, is x * s[i * cdiv(N, B) + j] in float32), written out here from that kernel;
* a rank reads only the scale blocks covering its slice.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from graphgen.modelspec.import_hf import import_hf
from graphgen.modelspec.loader import load_spec
from graphgen.runtime import open_engine
from graphgen.runtime.checkpoint.hf import check_config, load_hf_weights, write_random_hf_checkpoint
from graphgen.runtime.checkpoint.index import CheckpointIndex
from graphgen.runtime.checkpoint.plan import RankSlicing, plan_weights
from graphgen.runtime.checkpoint.stream import SliceReader, dequantize_blocks
from graphgen.runtime.engine.request import RowPlan
from graphgen.runtime.engine.spec_decode import mtp_variant, run_rows
from support.fp8 import quantize_fp8_blocks, to_fp8_checkpoint
from support.hf import ATOL, DSV3_DIMS, assert_steps_match_hf, hf_mtp_reference, hf_step_logits, rand_prompt

BLOCK = (32, 32)  # every weight dim of DSV3_DIMS is a multiple of 32 or below it (transformers' exact cases)


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    """(the FP8 checkpoint's folder, its unquantized source's) of a tiny DeepSeek-V3 with one MTP layer."""
    tmp = tmp_path_factory.mktemp("fp8")
    src = write_random_hf_checkpoint(str(tmp / "src"), "deepseek_v3", DSV3_DIMS, seed=7, tokenizer=False,
                                     mtp_layers=1)
    return to_fp8_checkpoint(src, tmp / "fp8", BLOCK), src


def test_fp8_checkpoint_logits_match_transformers_dequantization(fp8, tmp_path):
    from support.hf import load_hf_model

    torch.set_num_threads(1)
    ckpt, src = fp8
    spec = import_hf(ckpt, tmp_path / "fp8.yaml", "fp8_tiny", block_size=4)
    assert spec.quantization.checkpoint is not None and spec.quantization.checkpoint.weight_block_size == BLOCK
    hf = load_hf_model("deepseek_v3", str(ckpt)).eval()  # transformers dequantizes the FP8 layers on CPU
    g = torch.Generator().manual_seed(4)
    a = rand_prompt(g, 10)
    b = a[:8] + rand_prompt(g, 3)
    with open_engine(tmp_path / "fp8.yaml", str(ckpt), collect_logits=True, num_blocks=32) as eng:
        ra = eng.generate([a], 3)[0]
        eng.drain()
        rb = eng.generate([b], 3)[0]
    assert rb.hit_tokens == 8
    assert_steps_match_hf(hf, ra, "fp8 prefill + decode")
    assert_steps_match_hf(hf, rb, "fp8 splitfuse + decode")
    # not vacuous: FP8 rounding is visible (the unquantized source's logits are elsewhere)
    ref = load_hf_model("deepseek_v3", src).eval()
    assert (hf_step_logits(ref, a, ra.tokens) - hf_step_logits(hf, a, ra.tokens)).abs().max() > 100 * ATOL


def test_fp8_mtp_layer_matches_transformers_mtp_model(fp8):
    """The MTP layer's decoder block is FP8 too (the published layout): graphgen's MTP graph over the
    dequantized weights (the dict loader) vs transformers' MtpModel on the same checkpoint."""
    ckpt, _ = fp8
    spec = load_spec_for(ckpt)
    L = spec.dims.num_hidden_layers
    main, mtp = hf_mtp_reference(str(ckpt), L)
    n = 9
    ids = torch.randint(0, spec.dims.vocab_size, (1, n + 1), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        h_ref = main(input_ids=ids[:, :n], output_hidden_states=True).hidden_states[-1]
        g_ref = mtp.forward_layer(0, h_ref, torch.arange(n)[None], None, input_ids=ids[:, 1:])
        logits_ref = mtp._project_to_logits(g_ref)[0]
    with open_engine(spec, load_hf_weights(str(ckpt), mtp_layers=1), spec_file="fp8_mtp.yaml") as eng:
        table = eng.alloc.alloc(4)
        x = ids[0].tolist()

        def run(variant, tokens, logits_positions, prev_hidden=None):
            row = RowPlan(None, tuple(tokens), 0, tuple(table), logits_positions=tuple(logits_positions))
            return run_rows(eng.runner, variant, [row], prev_hidden=prev_hidden)

        _, h = run(eng.scheduler.variant_for("prefill", False), x[:n], (n - 1,))
        logits, g = run(mtp_variant(spec), x[1:], range(n), prev_hidden=h)
    assert (h - h_ref[0]).abs().max().item() <= ATOL, "target hidden state"
    assert (g - g_ref[0]).abs().max().item() <= ATOL, "MTP hidden state"
    assert (logits - logits_ref).abs().max().item() <= ATOL, "MTP logits"


def load_spec_for(ckpt):
    """The tiny MTP spec with the checkpoint's dims and its FP8 quantization (pool off: rows run by hand)."""
    from graphgen.modelspec import model as m
    from support.paths import TINY_DSV3_MTP

    base = load_spec(TINY_DSV3_MTP)
    dims = dataclasses.replace(base.dims, **{k: v for k, v in DSV3_DIMS.items() if hasattr(base.dims, k)})
    spec = dataclasses.replace(base, dims=dims, pool=dataclasses.replace(base.pool, write="off"), features=(),
                               quantization=m.Quantization(checkpoint=m.Fp8Checkpoint(weight_block_size=BLOCK)))
    check_config(spec, ckpt)
    return spec


def _weight_dequant(x: torch.Tensor, s: torch.Tensor, block: int) -> torch.Tensor:
    """DeepSeek-V3 inference/kernel.py weight_dequant, as its Triton kernel computes it: one program per
    (pid_m, pid_n) block of BLOCK_SIZE x BLOCK_SIZE, the elements past M/N masked off, y = x (float32) times
    the block's scale s[pid_m * cdiv(N, BLOCK_SIZE) + pid_n]."""
    M, N = x.shape
    n = math.ceil(N / block)
    s = s.reshape(-1)
    y = torch.empty(M, N, dtype=torch.float32)
    for pid_m in range(math.ceil(M / block)):
        for pid_n in range(n):
            rows, cols = slice(pid_m * block, (pid_m + 1) * block), slice(pid_n * block, (pid_n + 1) * block)
            y[rows, cols] = x[rows, cols].float() * s[pid_m * n + pid_n]
    return y


def test_partial_blocks_and_rank_slices_follow_deepseek_weight_dequant(tmp_path):
    """A [80, 70] weight in [32, 32] blocks (3 x 3 scales, the last row and column of blocks partial), read
    whole and as rank slices that start inside a block, each with only the scale blocks covering it."""
    from safetensors.torch import save_file

    from graphgen.runtime.checkpoint.index import read_header

    w = torch.randn(80, 70, generator=torch.Generator().manual_seed(1))
    q, s = quantize_fp8_blocks(w, BLOCK)
    assert s.shape == (3, 3)
    want = _weight_dequant(q, s, 32)
    save_file({"w.weight": q, "w.weight_scale_inv": s}, str(tmp_path / "m.safetensors"))
    stored = read_header(str(tmp_path / "m.safetensors"))
    from graphgen.runtime.checkpoint.index import BlockScales
    from graphgen.runtime.checkpoint.plan import Fill

    scales = BlockScales(stored["w.weight_scale_inv"], BLOCK)
    with SliceReader() as reader:
        assert torch.equal(dequantize_blocks(reader.read(stored["w.weight"]), s, BLOCK), want)
        for narrow in [(0, 20, 40), (1, 33, 37), (0, 64, 16), (1, 0, 35)]:
            f = Fill(stored["w.weight"], narrow, (), scales)
            dim, start, length = narrow
            first, count = f.scale_narrow()[1:]
            assert (first, first + count) == (start // 32, math.ceil((start + length) / 32))
            blocks = reader.read(scales.src, f.scale_narrow()).clone()
            offset = [0, 0]
            offset[dim] = start % 32
            got = dequantize_blocks(reader.read(f.src, narrow), blocks, BLOCK, tuple(offset))
            assert torch.equal(got, want.narrow(dim, start, length)), narrow
    # not vacuous: the blocks' scales differ, so a block read against its neighbour's scale would show
    assert s.unique().numel() == 9


def test_a_rank_reads_only_the_scale_blocks_of_its_slice(fp8):
    """tp 2: a column-parallel weight (q_b_proj, rows split) and a row-parallel one (o_proj, columns split):
    each rank's fills carry the block scales covering exactly its range."""
    ckpt, _ = fp8
    index = CheckpointIndex.open(str(ckpt), 1)
    names = ["model.layers.1.self_attn.q_b_proj.weight[d0/2]", "model.layers.1.self_attn.o_proj.weight[d1/2]"]
    for rank in range(2):
        for p in plan_weights(index, names, {}, RankSlicing(rank, 2)):
            (f,) = p.fills
            dim, start, length = f.narrow
            sdim, first, count = f.scale_narrow()
            assert (sdim, first, first + count) == (dim, start // 32, math.ceil((start + length) / 32))
            assert f.scale_nbytes == count * f.scale.src.shape[1 - dim] * 4 < f.scale.src.nbytes


def test_dry_run_of_a_w8a8_spec_over_a_sparse_fp8_checkpoint(tmp_path, capsys):
    """scripts/sparse_checkpoint.py writes DeepSeek-V3.1's published FP8 layout (F8_E4M3 weights, float32
    128x128 block scales, its MTP layer); `graphgen dry-run` of a W8A8 spec (import-hf --quantization
    w8a8_dynamic) over it places int8 weights and their scales: the measured device peak is the one `graphgen
    validate` counts. The full width of DeepSeek-V3.1 with 4 of its 61 layers (3 dense, 1 MoE) and its MTP
    layer (model.layers.4): the same tensors per layer, fast; the 61-layer run is docs/npu.md's (issue 28).

    Issue 38 item 2: the checkpoint's MTP layer keeps tp 16 and the npu target, and its term is counted: the
    dry run of the spec with it minus that of the same import without it (config.json alone) is validate's
    difference byte for byte, one more KV layer of the launch's blocks (5 of 4 layers' cache per block) and
    the MTP layer's weights (at least its replicated eh_proj, int8) -- dropping either term from validate
    fails here."""
    import json

    from graphgen.cli import main
    from graphgen.passes.manager import run_pipeline
    from graphgen.passes.memory import rank_memory
    from test_dry_run import DATA, _sparse

    config = dict(json.loads((DATA / "deepseek_v3_1.config.json").read_text()), num_hidden_layers=4)
    ckpt = _sparse(tmp_path / "ckpt", config)
    header = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    scales = [k for k in header if k.endswith(".weight_scale_inv")]
    assert "model.layers.3.mlp.experts.255.down_proj.weight_scale_inv" in scales
    assert "model.layers.4.mlp.experts.255.down_proj.weight_scale_inv" in scales  # the MTP layer, FP8 too
    assert not any(k.startswith(("model.embed_tokens", "lm_head")) or ".mlp.gate." in k for k in scales)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(config))
    rows, mems = {}, {}
    for name, src in (("mtp", ckpt), ("plain", tmp_path / "cfg")):
        spec_file = tmp_path / f"{name}.yaml"
        assert main(["import-hf", str(src), "--out", str(spec_file), "--name", "ds4", "--tp", "16",
                     "--quantization", "w8a8_dynamic"]) == 0
        capsys.readouterr()
        out = tmp_path / f"{name}.json"
        assert main(["dry-run", "--spec", str(spec_file), "--weights", str(ckpt), "--rank", "0",
                     "--json", str(out)]) == 0, capsys.readouterr().err
        (rows[name],) = json.loads(out.read_text())["ranks"]
        spec = load_spec(spec_file)
        assert spec.targets.npu is not None and spec.parallel.tp == 16
        mem = mems[name] = rank_memory(spec, [run_pipeline(spec, v, until="shard") for v in spec.variants])
        # byte for byte: weights (int8 + scales, the rest bf16), RoPE table, rings, communicators, default KV
        # blocks; the load transient (one slice through a temporary) passes before the KV cache is allocated
        assert rows[name]["device_peak_bytes"] == mem.launch_peak_bytes - mem.transient_bytes, (name, rows, mem)
        assert rows[name]["device_peak_bytes"] <= rows[name]["budget_bytes"]
        if name == "mtp":
            assert spec.mtp is not None and "mtp_draft" in spec.variants
            # int8 linear layers: 1.2 GB of weights where bfloat16 takes 2.1 GB (embedding and LM head stay bf16)
            bf16 = dataclasses.replace(spec, quantization=dataclasses.replace(spec.quantization, method="none"))
            assert mem.weight_bytes < 0.6 * rank_memory(bf16, [run_pipeline(bf16, v, until="shard")
                                                               for v in bf16.variants]).weight_bytes
        else:
            assert spec.mtp is None
    mtp, plain = mems["mtp"], mems["plain"]
    assert 4 * mtp.kv_bytes_per_block == 5 * plain.kv_bytes_per_block  # the MTP layer's KV: one layer more
    measured = rows["mtp"]["device_peak_bytes"] - rows["plain"]["device_peak_bytes"]
    assert measured == (mtp.launch_peak_bytes - mtp.transient_bytes) - (plain.launch_peak_bytes - plain.transient_bytes)
    assert rows["mtp"]["kv_blocks"] == rows["plain"]["kv_blocks"] == 513
    parts = {n: dict(m.per_rank_parts(m.default_blocks)) for n, m in mems.items()}
    diff = {k: parts["mtp"][k] - parts["plain"][k] for k in parts["mtp"]}
    assert measured == sum(diff.values()) - diff["load transient"]  # the MTP term, part by part
    assert diff["KV"] == 513 * (mtp.kv_bytes_per_block - plain.kv_bytes_per_block) > 0
    assert diff["staging rings"] > 0  # the rings stage every cache layer of a saved block, the MTP layer's too
    assert diff["weights"] > 7168 * 2 * 7168  # at least the MTP layer's eh_proj, one byte each
    assert rows["mtp"]["bytes_read"] > rows["plain"]["bytes_read"]  # the MTP layer's slices were read


def test_a_spec_that_does_not_declare_the_fp8_checkpoint_is_told_how(fp8):
    """check_config: the spec's quantization.checkpoint and config.json's quantization_config go together."""
    ckpt, src = fp8
    spec = load_spec_for(ckpt)
    plain = dataclasses.replace(spec, quantization=dataclasses.replace(spec.quantization, checkpoint=None))
    with pytest.raises(ValueError, match=r"config.json has an fp8 checkpoint with \[32, 32\] blocks but the spec has "
                                         r"no quantization.checkpoint; add 'quantization: \{checkpoint:"):
        check_config(plain, ckpt)
    with pytest.raises(ValueError, match="remove the spec's quantization.checkpoint"):
        check_config(spec, src)
