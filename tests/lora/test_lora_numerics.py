"""Multi-LoRA against transformers + peft (issue 40): two random PEFT adapters (written with ``peft``, pinned), their
requests batched in one step with base-model requests; every step's logits within float32 tolerance of peft's
model on the full sequence; async write on and off give the same tokens; pool keys never cross adapters."""

from __future__ import annotations

import pytest
import torch

from graphgen.modelspec.loader import load_spec
from graphgen.runtime import open_engine
from support.hf import ATOL, build_hf_model, hf_step_logits
from support.lora import SPECS, hf_dims, write_adapter


# per family: (targets, r, alpha, use_rslora) of adapter a and b (b: another rank, rank-stabilized, fewer targets)
ADAPTERS = {
    "qwen3_dense": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 4, 8, False,
                    ["q_proj", "v_proj", "down_proj"], 8, 4, True),
    # MLA's projections: peft 0.21 on transformers 5 maps gate/up/down_proj names on a MoE model onto the
    # experts' parameters (target_parameters, refused: tests/lora/test_bad_adapters.py), the dense layer's MLP
    # with them; the MLP's LoRA is proven on Qwen3 (the same swiglu op)
    "deepseek_v3": (["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"],
                    4, 8, False, ["q_b_proj", "kv_a_proj_with_mqa", "o_proj"], 8, 4, True),
}


@pytest.fixture(scope="module", params=["qwen3_dense", "deepseek_v3"])
def setup(request, tmp_path_factory):
    family = request.param
    spec = load_spec(SPECS[family])
    tmp = tmp_path_factory.mktemp(f"lora_{family}")
    base, ckpt = build_hf_model(family, hf_dims(spec), str(tmp / "base"), seed=3)
    ta, ra, aa, sa, tb, rb, ab, sb = ADAPTERS[family]
    ref_a = write_adapter(base, tmp / "a", ta, ra, aa, sa, seed=1)
    ref_b = write_adapter(base, tmp / "b", tb, rb, ab, sb, seed=2)
    return family, ckpt, tmp, {"a": ref_a, "b": ref_b, None: base}


def _engine(family, ckpt, tmp, **kw):
    return open_engine(SPECS[family], ckpt, lora_modules={"a": str(tmp / "a"), "b": str(tmp / "b")},
                       collect_logits=True, **kw)


def test_adapters_batched_with_base_requests_match_peft(setup):
    family, ckpt, tmp, refs = setup
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 6, 11, 7)]
    loras = ["a", None, "b", "a"]
    tokens = {}
    for write in ("off", "async"):
        with _engine(family, ckpt, tmp, write=write) as eng:
            slots, steps = eng.runner.lora_slots, []
            acquire = slots.acquire
            slots.acquire = lambda adapters: steps.append(list(adapters)) or acquire(adapters)
            results = eng.generate(prompts, 5, batch=True, lora=loras)
            tokens[write] = [r.tokens for r in results]
        # one step held both adapters' rows and a base row (batched over adapters, with the base model)
        assert any(len({a.name for a in step if a is not None}) == 2 and None in step for step in steps), steps
        for r, name in zip(results, loras):
            ref = hf_step_logits(refs[name], r.prompt, r.tokens)
            got = torch.stack([row.reshape(-1) for row in r.step_logits])
            err = (got - ref).abs().max().item()
            assert err <= ATOL, f"{family} adapter {name} (write {write}): max |diff| {err:.3g} > {ATOL}"
    # negative control: the adapters change the logits far beyond the tolerance (a delta left out would show)
    r0 = results[0]
    assert (hf_step_logits(refs[None], r0.prompt, r0.tokens) - hf_step_logits(refs["a"], r0.prompt, r0.tokens)
            ).abs().max().item() > 100 * ATOL
    assert tokens["off"] == tokens["async"]


def test_pool_keys_never_cross_adapters(setup):
    """A under A then B: a miss; A again: a hit; the base model: a miss (write async, the embedded pool)."""
    family, ckpt, tmp, _ = setup
    prompt = list(range(3, 16))  # 13 tokens: 3 full blocks of 4 may hit
    with _engine(family, ckpt, tmp) as eng:
        # one call, one prompt after another: each waits for the saves before it (settle), so a hit never
        # depends on how fast the async save commits
        names = ["a", "b", "a", None, "b"]
        hits = [r.hit_tokens for r in eng.generate([prompt] * len(names), 2, lora=names)]
    assert hits == [0, 0, 12, 0, 12], hits


def test_a_step_batches_at_most_max_loras_adapters(setup):
    """--max-loras 1: the two adapters' rows go to different steps (the base rows join either), and the logits
    still match peft's."""
    family, ckpt, tmp, refs = setup
    prompts = [[3, 1, 4, 1, 5, 9], [2, 7, 1, 8, 2, 8], [1, 6, 1, 8, 0, 3]]
    loras = ["a", "b", None]
    with _engine(family, ckpt, tmp, max_loras=1) as eng:
        steps = []
        acquire = eng.runner.lora_slots.acquire
        eng.runner.lora_slots.acquire = lambda adapters: steps.append(list(adapters)) or acquire(adapters)
        results = eng.generate(prompts, 3, batch=True, lora=loras)
    assert steps and all(len({a.name for a in s if a is not None}) <= 1 for s in steps), steps
    assert {a.name for s in steps for a in s if a is not None} == {"a", "b"}
    for r, name in zip(results, loras):
        got = torch.stack([row.reshape(-1) for row in r.step_logits])
        assert (got - hf_step_logits(refs[name], r.prompt, r.tokens)).abs().max().item() <= ATOL
