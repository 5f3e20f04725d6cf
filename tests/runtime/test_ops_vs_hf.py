"""The CPU reference ops, composed into a full forward over a paged KV cache, against Hugging Face
transformers in float32: prefill, splitfuse (history in the cache) and decode logits at atol=1e-4.
Also the checkpoint loader/writer against transformers' save_pretrained/from_pretrained."""

from __future__ import annotations

import json
import os

import pytest
import torch

import transformers  # noqa: F401  (an extra ./dev installs: a missing one fails, never skips)
import safetensors  # noqa: F401  (an extra ./dev installs: a missing one fails, never skips)

from graphgen.families import FAMILIES, mla_softmax_scale  # noqa: E402
from graphgen.runtime.core import matmul as mm  # noqa: E402
from graphgen.runtime.core import ops as rt  # noqa: E402
from graphgen.runtime.core.attention import seq_runs  # noqa: E402
from graphgen.runtime.core.weights import build_load_time_weight  # noqa: E402
from graphgen.runtime.core.kvcache import kv_cache_shapes  # noqa: E402
from graphgen.runtime.checkpoint.hf import (WeightsError, load_hf_weights,  # noqa: E402
                                      write_random_hf_checkpoint)

import support.hf as hfm  # noqa: E402

ATOL = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 32


# ---------------------------------------------------------------------------------------------
# a minimal paged runner built only from rt.* ops (what generated code does, without the graph)
# ---------------------------------------------------------------------------------------------

class PagedRunner:
    def __init__(self, family: str, dims: dict, weights: dict, seed: int = 0):
        self.family, self.d, self.w = family, dict(dims), weights
        shapes = kv_cache_shapes(family, self.d, NUM_BLOCKS, BLOCK_SIZE)
        self.kv = [tuple(torch.full(s, float("nan")) for s in shapes.values())
                   for _ in range(self.d["num_hidden_layers"])]  # NaN: reading an unwritten slot shows
        # hand out blocks in a scrambled order so a block-table indexing mistake cannot pass
        self.free = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, batch: list[tuple[int, list[int]]]) -> torch.Tensor:
        """batch: (seq_id, new token ids) per sequence; returns the last-token logits [B, V]."""
        ids, pos, slots, seq_lens, q_lens = [], [], [], [], []
        for sid, new in batch:
            start = self.lens.get(sid, 0)
            table = self.tables.setdefault(sid, [])
            for p in range(start, start + len(new)):
                if p // BLOCK_SIZE >= len(table):
                    table.append(self.free.pop())
                slots.append(table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
                pos.append(p)
            ids += new
            self.lens[sid] = start + len(new)
            seq_lens.append(self.lens[sid])
            q_lens.append(len(new))
        width = max(len(self.tables[sid]) for sid, _ in batch) + 1  # +1: padded, never read
        bt = torch.tensor([self.tables[sid] + [0] * (width - len(self.tables[sid])) for sid, _ in batch])
        meta = dict(block_tables=bt, seq_lens=torch.tensor(seq_lens), query_lens=torch.tensor(q_lens))
        last = torch.tensor(q_lens).cumsum(0) - 1
        return self.forward(torch.tensor(ids), torch.tensor(pos), torch.tensor(slots), meta, last)

    def proj(self, *keys):
        """The CPU layout of a dense projection (the generated modules' load-time weight): ``keys``
        merged along the output dim, stored ``[in, out]``."""
        return build_load_time_weight([self.w[k] for k in keys], dim=0, transpose12=False, transpose01=True)

    def forward(self, ids, pos, slots, meta, logits_indices):
        d, w = self.d, self.w
        eps = d["rms_norm_eps"]
        x = rt.embedding(w["model.embed_tokens.weight"], ids)
        if self.family == "qwen3_dense":
            cos, sin = rt.rope_cos_sin(pos, rot_dim=d["head_dim"], theta=d["rope_theta"], scaling=None)
        else:
            cos, sin = rt.rope_cos_sin(pos, rot_dim=d["qk_rope_head_dim"], theta=d["rope_theta"],
                                       scaling=d.get("rope_scaling"))
        for i in range(d["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = rt.rms_norm(x, w[p + "input_layernorm.weight"], eps)
            if self.family == "qwen3_dense":
                a = p + "self_attn."
                q, k, v = rt.qwen3_attn_prolog(
                    h, self.proj(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                    w[a + "q_norm.weight"], w[a + "k_norm.weight"], cos, sin,
                    num_heads=d["num_attention_heads"], num_kv_heads=d["num_key_value_heads"],
                    head_dim=d["head_dim"], eps=eps)
                rt.kv_write(self.kv[i], (k, v), slots)
                o = rt.paged_attention(q, self.kv[i], **meta, scale=d["head_dim"] ** -0.5)
                x = rt.o_proj_residual(o, self.proj(a + "o_proj.weight"), x)
                h = rt.rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
                m = p + "mlp."
                x = rt.swiglu_mlp_residual(h, self.proj(m + "gate_proj.weight", m + "up_proj.weight"),
                                           self.proj(m + "down_proj.weight"), x)
            else:
                x = self._deepseek_layer(i, x, h, cos, sin, slots, meta)
        return rt.lm_head(x, w["model.norm.weight"], eps, w["lm_head.weight"], logits_indices)

    def _deepseek_layer(self, i, x, h, cos, sin, slots, meta):
        d, w, eps = self.d, self.w, self.d["rms_norm_eps"]
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        n, r, v = d["qk_nope_head_dim"], d["qk_rope_head_dim"], d["v_head_dim"]
        # the latent norms use transformers' RMSNorm default eps (1e-6), not rms_norm_eps
        q_nope, q_pe, c_kv, k_pe = rt.mla_prolog(
            h, w[a + "q_a_proj.weight"], w[a + "q_a_layernorm.weight"], w[a + "q_b_proj.weight"],
            w[a + "kv_a_proj_with_mqa.weight"], w[a + "kv_a_layernorm.weight"], cos, sin,
            num_heads=d["num_attention_heads"], qk_nope_head_dim=n, qk_rope_head_dim=r,
            kv_lora_rank=d["kv_lora_rank"], eps=1e-6, interleave=d["rope_interleave"])
        rt.kv_write(self.kv[i], (c_kv, k_pe), slots)
        o = rt.mla_attention(q_nope, q_pe, self.kv[i], w[a + "kv_b_proj.weight"], **meta,
                             num_heads=d["num_attention_heads"], qk_nope_head_dim=n, v_head_dim=v,
                             scale=mla_softmax_scale(FAMILIES["deepseek_v3"].dims_of(d)))
        x = rt.o_proj_residual(o, self.proj(a + "o_proj.weight"), x)
        h = rt.rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        m = p + "mlp."
        if i < d["first_k_dense_replace"]:
            return rt.swiglu_mlp_residual(h, self.proj(m + "gate_proj.weight", m + "up_proj.weight"),
                                          self.proj(m + "down_proj.weight"), x)
        shared = [w.get(m + f"shared_experts.{k}_proj.weight") for k in ("gate", "up", "down")]
        return rt.moe_residual(
            h, w[m + "gate.weight"], w[m + "gate.e_score_correction_bias"], w[m + "experts.gate_proj.weight"],
            w[m + "experts.up_proj.weight"], w[m + "experts.down_proj.weight"], *shared, x,
            top_k=d["num_experts_per_tok"], n_group=d["n_group"], topk_group=d["topk_group"],
            routed_scaling_factor=d["routed_scaling_factor"], norm_topk_prob=d["norm_topk_prob"])


def _close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    err = (ours - ref).abs().max().item()
    assert err <= ATOL, f"{what}: max |ours - HF| = {err:.3g} > {ATOL}"


CASES = {
    "qwen3": ("qwen3_dense", hfm.QWEN3_DIMS),
    # projections big enough for the oneDNN branch (several rows, >= 2^17 weights): qkv, gate/up, down; the
    # case runs with oneDNN chosen on every CPU (`_onednn_for_the_wide_case`)
    "qwen3_wide": ("qwen3_dense", dict(hfm.QWEN3_DIMS, hidden_size=512, intermediate_size=512,
                                       num_attention_heads=8, head_dim=64)),
    "dsv3": ("deepseek_v3", hfm.DSV3_DIMS),
    "dsv3_grouped_yarn": ("deepseek_v3", hfm.DSV3_GROUPED_YARN_DIMS),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    torch.manual_seed(0)
    family, dims = CASES[request.param]
    model, hf_dir = hfm.build_hf_model(family, dims, str(tmp_path_factory.mktemp(request.param)), seed=1)
    return family, dims, model, load_hf_weights(hf_dir)


@pytest.fixture(autouse=True)
def _onednn_for_the_wide_case(request, monkeypatch):
    # oneDNN's numerics against transformers on every CPU, not only where `auto` chooses it (AVX-512)
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("case") == "qwen3_wide":
        monkeypatch.setattr(mm, "_ONEDNN_LINEAR", mm._ONEDNN_OP)


def _prompts(vocab: int, lens: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def test_prefill_batched_prompts(case):
    family, dims, model, weights = case
    runner = PagedRunner(family, dims, weights)
    prompts = _prompts(dims["vocab_size"], [7, 13], seed=2)  # different lengths, not block multiples
    logits = runner.step([(0, prompts[0]), (1, prompts[1])])
    for b, ids in enumerate(prompts):
        ref = hfm.hf_last_logits(model, ids)
        assert ref.std() > 0.1, "degenerate reference logits would make the comparison vacuous"
        _close(logits[b], ref, f"{family} prefill seq {b}")


def test_splitfuse_with_cached_prefix(case):
    family, dims, model, weights = case
    runner = PagedRunner(family, dims, weights, seed=3)
    full, other = _prompts(dims["vocab_size"], [14, 5], seed=4)
    runner.step([(0, full[:6])])  # prefix KV comes from an earlier prefill (ends mid-block)
    # the rest of seq 0 attends to its cached prefix; seq 1 is a fresh prompt in the same batch
    logits = runner.step([(0, full[6:]), (1, other)])
    _close(logits[0], hfm.hf_last_logits(model, full), f"{family} splitfuse (history)")
    _close(logits[1], hfm.hf_last_logits(model, other), f"{family} splitfuse (no history)")


def test_greedy_decode_steps(case):
    family, dims, model, weights = case
    runner = PagedRunner(family, dims, weights, seed=5)
    seqs = _prompts(dims["vocab_size"], [5, 9], seed=6)
    logits = runner.step([(0, seqs[0]), (1, seqs[1])])
    for step in range(3):
        # feed HF's greedy token to both sides, so a near-tie cannot make the two paths diverge
        nxt = [int(hfm.hf_last_logits(model, s).argmax()) for s in seqs]
        seqs = [s + [t] for s, t in zip(seqs, nxt)]
        logits = runner.step([(0, [nxt[0]]), (1, [nxt[1]])])
        for b in range(2):
            _close(logits[b], hfm.hf_last_logits(model, seqs[b]), f"{family} decode step {step} seq {b}")


# ---------------------------------------------------------------------------------------------
# op-level checks that the model tests do not pin down on their own
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def onednn_on(monkeypatch):
    """oneDNN chosen whatever this CPU is (``auto`` takes it only with AVX-512): the op exists in the
    pinned wheel on every x86 CPU, so its branch and its numerics are checked everywhere."""
    # the pinned CPU wheel has oneDNN (None would silently keep MKL everywhere, even when chosen)
    assert mm._ONEDNN_OP is not None
    monkeypatch.setattr(mm, "_ONEDNN_LINEAR", mm._ONEDNN_OP)


def test_matmuls_take_onednn_for_several_rows_of_a_big_weight_and_mkl_otherwise(onednn_on):
    g = torch.Generator().manual_seed(0)
    big, small = torch.randn(512, 384, generator=g), torch.randn(64, 96, generator=g)
    assert big.numel() >= mm._ONEDNN_MIN_WEIGHT > small.numel()
    for rows, w_t, onednn in ((1, big, False), (2, big, True), (64, big, True), (64, small, False)):
        x = torch.randn(rows, w_t.shape[0], generator=g)
        got = mm.matmul_t(x, w_t)
        want = mm._ONEDNN_OP(x, w_t.t(), None, "none", [], "") if onednn else torch.mm(x, w_t)
        assert torch.equal(got, want), (rows, tuple(w_t.shape))   # the branch taken, bit for bit
        ref = (x.double() @ w_t.double()).float()
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)   # and the product, either way
    x = torch.randn(4, 512, generator=g, requires_grad=True)         # autograd: MKL (oneDNN's op has none)
    assert torch.equal(mm.matmul_t(x, big), torch.mm(x, big)) and mm.matmul_t(x, big).requires_grad
    w = big.t().contiguous()                                          # checkpoint layout [out, in]: linear
    for rows, onednn in ((1, False), (8, True)):
        x = torch.randn(rows, 512, generator=g)
        want = mm._ONEDNN_OP(x, w, None, "none", [], "") if onednn else torch.nn.functional.linear(x, w)
        assert torch.equal(mm.linear(x, w), want)
        torch.testing.assert_close(mm.linear(x, w), (x.double() @ w.double().t()).float(), rtol=1e-5, atol=1e-4)


def test_onednn_is_chosen_on_avx512_cpus_only_unless_forced(monkeypatch):
    # auto: oneDNN where torch runs AVX-512 kernels (measured faster), MKL on AVX2-only CPUs (measured slower)
    assert mm._onednn_chosen("auto", "AVX512") and mm._onednn_chosen("auto", "AVX512_BF16")
    assert not mm._onednn_chosen("auto", "AVX2") and not mm._onednn_chosen("auto", "DEFAULT")
    assert mm._onednn_chosen("onednn", "AVX2") and not mm._onednn_chosen("mkl", "AVX512")
    with pytest.raises(ValueError, match="GRAPHGEN_CPU_MATMUL='fast'.*auto, onednn or mkl"):
        mm._onednn_chosen("fast", "AVX2")
    # and this process decided with the variable it started with and its own CPU
    want = mm._onednn_chosen(os.environ.get("GRAPHGEN_CPU_MATMUL", "auto"), torch.backends.cpu.get_cpu_capability())
    assert (mm._ONEDNN_LINEAR is not None) == want
    # with MKL chosen, several rows of a big weight stay on MKL, bit for bit
    monkeypatch.setattr(mm, "_ONEDNN_LINEAR", None)
    x, w_t = torch.randn(64, 512), torch.randn(512, 384)
    assert torch.equal(mm.matmul_t(x, w_t), torch.mm(x, w_t))
    assert torch.equal(mm.linear(x, w_t.t()), torch.nn.functional.linear(x, w_t.t()))


def test_moe_routing_matches_hf_router():
    """Grouped noaux_tc routing vs transformers' router on scores with many group contests."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    torch.manual_seed(0)
    cfg = DeepseekV3Config(hidden_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                           topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    router = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(std=0.3)
    x = torch.randn(64, 16)
    _, ref_w, ref_idx = router(x)
    idx, w = rt._route(x, router.weight, router.e_score_correction_bias, top_k=4, n_group=4,
                       topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    order_ref, order = ref_idx.sort(-1), idx.sort(-1)
    assert torch.equal(order.values, order_ref.values)
    torch.testing.assert_close(w.gather(1, order.indices), ref_w.gather(1, order_ref.indices))


def test_kv_save_and_cache_shapes():
    shapes = kv_cache_shapes("deepseek_v3", hfm.DSV3_DIMS, 6, 4)
    assert list(shapes) == ["ckv", "kpe"] and shapes["ckv"] == (6, 4, 16) and shapes["kpe"] == (6, 4, 8)
    shapes = kv_cache_shapes("qwen3_dense", hfm.QWEN3_DIMS, 6, 4)
    assert list(shapes) == ["k", "v"] and shapes["k"] == (6, 4, 2, 16)
    cache = tuple(torch.randn(s) for s in shapes.values())
    staging = tuple(torch.zeros(3, *s[1:]) for s in shapes.values())
    rt.kv_save(cache, torch.tensor([5, 1]), staging)
    for c, s in zip(cache, staging):
        assert torch.equal(s[0], c[5]) and torch.equal(s[1], c[1]) and not s[2].any()


@pytest.mark.parametrize("q_len", [1, 5, 37])
def test_paged_attention_block_layouts(q_len):
    """Decode rows read runs of consecutive blocks in place, more fragmented tables are gathered:
    one run, two runs and a scattered table (over ``_MAX_RUNS`` runs) all equal torch's own sdpa
    with an explicit causal mask and repeated KV."""
    g = torch.Generator().manual_seed(q_len)
    bs, Hkv, Hq, D, S = 4, 2, 8, 16, 37
    nb = (S + bs - 1) // bs
    k, v, q = torch.randn(S, Hkv, D, generator=g), torch.randn(S, Hkv, D, generator=g), torch.randn(q_len, Hq, D, generator=g)
    mask = torch.ones(q_len, S, dtype=torch.bool).tril(S - q_len)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(Hq // Hkv, 1).transpose(0, 1),
        v.repeat_interleave(Hq // Hkv, 1).transpose(0, 1), attn_mask=mask, scale=0.25).transpose(0, 1)
    layouts = {"one run": torch.arange(nb) + 3, "two runs": torch.cat([torch.arange(5, nb + 3), torch.arange(3, 5)]),
               "scattered": torch.randperm(nb, generator=g) * 2}
    for name, table in layouts.items():
        kc = torch.full((2 * nb + 3, bs, Hkv, D), float("nan"))
        vc = kc.clone()
        rt.kv_write((kc, vc), (k, v), (table[:, None] * bs + torch.arange(bs)).flatten()[:S])
        runs = len(seq_runs(kc, table, S))
        assert runs == {"one run": 1, "two runs": 2, "scattered": 1}[name], (name, runs)
        out = rt.paged_attention(q, (kc, vc), table[None], torch.tensor([S]), torch.tensor([q_len]), scale=0.25)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0, msg=name)


def test_paged_attention_step_plan_follows_in_place_changes():
    """The per-step plan is memoised on the input tensors: a block table changed in place (same
    object) must be planned again, not served from the memo."""
    g = torch.Generator().manual_seed(7)
    bs, H, D, S = 4, 2, 8, 12
    kc, vc = torch.randn(8, bs, H, D, generator=g), torch.randn(8, bs, H, D, generator=g)
    q = torch.randn(1, H, D, generator=g)
    table, seq, ql = torch.tensor([[0, 1, 2]]), torch.tensor([S]), torch.tensor([1])
    first = rt.paged_attention(q, (kc, vc), table, seq, ql, scale=0.3)
    table[0] = torch.tensor([5, 6, 7])  # in place: same tensor object, new blocks
    moved = rt.paged_attention(q, (kc, vc), table, seq, ql, scale=0.3)
    fresh = rt.paged_attention(q, (kc, vc), torch.tensor([[5, 6, 7]]), seq, ql, scale=0.3)
    assert torch.equal(moved, fresh) and not torch.allclose(moved, first)


def test_decode_fast_paths_bit_identical_to_transformers():
    """rms_norm (torch's fused call for float32), the prolog's joint q/k norm, and the prolog's RoPE (`_rope_tables` + roll) are
    bit-identical to transformers' Qwen3RMSNorm and apply_rotary_pos_emb, not merely close; and the
    per-step memos (RoPE tables, kv_write's slots) follow in-place changes of their inputs."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    from graphgen.runtime.core.ops import _rms_unit, _rope_tables, _signed_rope

    g = torch.Generator().manual_seed(3)
    for shape in [(1, 512), (5, 8, 64), (33, 2, 16)]:
        x, w = torch.randn(*shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
        norm = Qwen3RMSNorm(shape[-1], eps=1e-6)
        norm.weight.data.copy_(w)
        assert torch.equal(rt.rms_norm(x, w, 1e-6), norm(x))
        # the prolog's joint q/k norm: the unweighted norm, then each part times its weight
        assert torch.equal(_rms_unit(x, 1e-6).mul_(w), norm(x))
        assert not torch.equal(_rms_unit(x, 1e-5).mul_(w), norm(x))  # negative control: eps is seen
    pos = torch.tensor([0, 7, 2047])
    cos, sin = rt.rope_cos_sin(pos, rot_dim=64, theta=1e6)
    q, k = torch.randn(3, 8, 64, generator=g), torch.randn(3, 2, 64, generator=g)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    c, s = _rope_tables(cos, sin, q.dtype)
    assert torch.equal(_signed_rope(q, c, s), want_q) and torch.equal(_signed_rope(k, c, s), want_k)
    sin.mul_(-1)  # in place: the memo must not serve the old tables
    assert torch.equal(_signed_rope(q, *_rope_tables(cos, sin, q.dtype)),
                       apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)[0])
    cache, slots = (torch.zeros(4, 2, 3),), torch.tensor([1, 2], dtype=torch.int32)
    rt.kv_write(cache, (torch.ones(2, 3),), slots)
    slots[:] = torch.tensor([5, 6])
    rt.kv_write(cache, (2 * torch.ones(2, 3),), slots)
    assert cache[0].view(8, 3)[[1, 2, 5, 6], 0].tolist() == [1, 1, 2, 2]


def test_kv_write_rejects_out_of_range_slot():
    cache = (torch.zeros(2, 4, 3),)
    with pytest.raises((IndexError, RuntimeError)):
        rt.kv_write(cache, (torch.ones(1, 3),), torch.tensor([-1]))  # must not wrap to the last slot


# ---------------------------------------------------------------------------------------------
# checkpoints: our writer loads in transformers; our loader reads transformers' output
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["qwen3_tied", "dsv3_grouped_yarn", "dsv3_no_interleave"])
def test_random_checkpoint_loads_in_transformers(name, tmp_path):
    torch.manual_seed(0)
    family, dims = {"qwen3_tied": ("qwen3_dense", dict(hfm.QWEN3_DIMS, tie_word_embeddings=True)),
                    "dsv3_grouped_yarn": ("deepseek_v3", hfm.DSV3_GROUPED_YARN_DIMS),
                    "dsv3_no_interleave": ("deepseek_v3", dict(hfm.DSV3_DIMS, rope_interleave=False))}[name]
    write_random_hf_checkpoint(str(tmp_path), family, dims, seed=7)
    model, info = hfm.load_hf_model(family, str(tmp_path), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    if family == "deepseek_v3":  # transformers read our config fields as we meant them
        want = "yarn" if dims["rope_scaling"] else "default"
        assert model.config.rope_parameters["rope_type"] == want
        assert model.config.rope_interleave == dims["rope_interleave"]
        assert model.config.n_group == dims["n_group"] and model.config.topk_group == dims["topk_group"]
    weights = load_hf_weights(str(tmp_path))
    if dims["tie_word_embeddings"]:
        assert weights["lm_head.weight"] is weights["model.embed_tokens.weight"]
    # same logits through transformers and through our ops: the config says what the weights mean
    runner = PagedRunner(family, dims, weights)
    prompt = _prompts(dims["vocab_size"], [9], seed=8)[0]
    ref = hfm.hf_last_logits(model, prompt)
    assert ref.std() > 0.1, "random init should give non-degenerate logits"
    _close(runner.step([(0, prompt)])[0], ref, f"{name} random checkpoint")


def test_loader_stacks_experts_from_save_pretrained(case):
    family, dims, model, weights = case
    if family != "deepseek_v3":
        assert weights["lm_head.weight"].shape == (dims["vocab_size"], dims["hidden_size"])
        return
    assert not any(".experts.0." in k for k in weights)  # per-expert keys dropped
    L, E, I, H = dims["first_k_dense_replace"], dims["n_routed_experts"], dims["moe_intermediate_size"], dims["hidden_size"]
    experts = model.model.layers[L].mlp.experts  # transformers fuses gate|up in memory
    gate_up = experts.gate_up_proj.detach()
    assert torch.equal(weights[f"model.layers.{L}.mlp.experts.gate_proj.weight"], gate_up[:, :I])
    assert torch.equal(weights[f"model.layers.{L}.mlp.experts.up_proj.weight"], gate_up[:, I:])
    assert weights[f"model.layers.{L}.mlp.experts.down_proj.weight"].shape == (E, H, I)
    assert torch.equal(weights[f"model.layers.{L}.mlp.experts.down_proj.weight"], experts.down_proj.detach())


def _rewrite(tmp_path, mutate) -> str:
    from safetensors.torch import load_file, save_file

    src = write_random_hf_checkpoint(str(tmp_path / "src"), "deepseek_v3", hfm.DSV3_DIMS, seed=9)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    mutate(tensors)
    save_file(tensors, os.path.join(src, "model.safetensors"))
    return src


def test_loader_names_missing_key(tmp_path):
    key = "model.layers.1.mlp.experts.2.up_proj.weight"
    hf_dir = _rewrite(tmp_path, lambda t: t.pop(key))
    with pytest.raises(WeightsError, match="missing") as e:
        load_hf_weights(hf_dir)
    assert key in str(e.value)


def test_loader_names_wrong_shape(tmp_path):
    key = "model.layers.0.self_attn.kv_b_proj.weight"
    hf_dir = _rewrite(tmp_path, lambda t: t.__setitem__(key, t[key][:-1].clone()))
    with pytest.raises(WeightsError, match="shape") as e:
        load_hf_weights(hf_dir)
    assert key in str(e.value)


def test_loader_reads_sharded_checkpoint(tmp_path):
    from safetensors.torch import load_file, save_file

    src = write_random_hf_checkpoint(str(tmp_path), "qwen3_dense", hfm.QWEN3_DIMS, seed=10)
    whole = load_hf_weights(src)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    os.remove(os.path.join(src, "model.safetensors"))
    keys = sorted(tensors)
    weight_map = {}
    for n, part in enumerate((keys[::2], keys[1::2])):
        fname = f"model-{n + 1:05d}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, os.path.join(src, fname))
        weight_map.update({k: fname for k in part})
    with open(os.path.join(src, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    sharded = load_hf_weights(src)
    assert sorted(sharded) == sorted(whole)
    assert all(torch.equal(sharded[k], whole[k]) for k in whole)
