"""P/D carries the adapter (issue 40): a prefill instance leases and hands off the keys its prefill saved under
the request's adapter, and a decode instance admits a handoff only under the same adapter (the blocks of
another adapter, or of the base model, hold other KV). In one process, on the engine's own pool (the
cluster itself, with its router and HTTP, is tests/serve/test_pd.py's)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from graphgen.modelspec.loader import load_spec
from graphgen.runtime import open_engine
from graphgen.serve.pd import PD, Handoff
from support.hf import build_hf_model
from support.lora import SPECS, hf_dims, write_adapter

PROMPT = list(range(20, 33))  # 13 tokens: 3 blocks handed off


def test_pd_keys_and_handoffs_carry_the_adapter(tmp_path):
    spec = SPECS["qwen3_dense"]
    base, ckpt = build_hf_model("qwen3_dense", hf_dims(load_spec(spec)), str(tmp_path / "base"), seed=6)
    write_adapter(base, tmp_path / "a", ["q_proj", "v_proj"], 4, 8, False, seed=1)
    write_adapter(base, tmp_path / "b", ["k_proj"], 4, 8, False, seed=2)
    with open_engine(spec, ckpt, lora_modules={"a": str(tmp_path / "a"), "b": str(tmp_path / "b")}) as eng:
        naming = eng.kv_naming()
        pd = PD("prefill", eng.kv_pool(), naming, CollectorRegistry(), lease_timeout_s=5)
        salt = {n: naming.salt_of(n) for n in (None, "a", "b")}
        assert salt[None] == "" and len({salt["a"], salt["b"], ""}) == 3
        keys, lease = pd.lease(PROMPT, salt["a"])
        eng.generate([PROMPT], 1, lora="a")
        eng.drain()
        assert pd._visible_run(keys) == 3  # P waits for exactly the blocks its prefill under "a" saved
        assert pd._visible_run(pd.lease(PROMPT, "")[0]) == 0 and pd._visible_run(pd.lease(PROMPT, salt["b"])[0]) == 0
        handoff = Handoff(tuple(naming.digests(PROMPT, salt["a"])[:3]), 3, naming.layout, lease.lease_id, 0)
        d = PD("decode", eng.kv_pool(), naming, CollectorRegistry(), lease_timeout_s=5)
        assert d.accept(PROMPT, handoff, salt["a"])
        assert not d.accept(PROMPT, handoff, salt["b"]) and not d.accept(PROMPT, handoff, "")
