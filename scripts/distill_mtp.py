"""Distil the MTP layer of a tiny random DeepSeek-V3 on the model's own greedy outputs, so that
speculative decoding with it has an acceptance that means something (issue 18's benchmark).

    python scripts/distill_mtp.py OUT [--spec specs/tiny_deepseek_v3_mtp.yaml] [--steps 300] [--seed 11]

Writes ``OUT/random`` (graphgen's random checkpoint of the spec, ``mtp_layers`` = the spec's; or
``--target DIR``, an existing one) and ``OUT/distilled``: the same target weights, its MTP layer
trained. Both load with ``graphgen run --spec SPEC --weights OUT/... --speculative mtp``.

How (transformers 5.24 is the forward; graphgen's runtime is not used, so the checkpoint it loads
was made by another implementation):

1. the target (``DeepseekV3ForCausalLM``, frozen) decodes greedily from random prompts: sequences
   ``x_0 .. x_{S-1}`` that are its own outputs after the prompt;
2. one full forward gives its last hidden state ``h_t`` (after the final norm: what the MTP layer
   reads, ``docs/mtp.md``) and its logits ``z_t``;
3. transformers' ``MtpModel(main, 1)`` holds the checkpoint's MTP layer (``enorm``, ``hnorm``,
   ``eh_proj``, the decoder layer, ``shared_head.norm`` = its ``post_norm``; embedding and head are
   the target's, frozen); row ``t`` reads ``h_t`` and the embedding of ``x_{t+1}`` and is trained
   to predict ``x_{t+2}``: cross-entropy against the target's own distribution there,
   ``softmax(z_{t+1} / T)`` (T = 0.5), whose argmax is ``x_{t+2}`` (greedy) -- only rows whose
   ``x_{t+2}`` the target generated (not a random prompt token);
4. the trained decoder layer goes back through an ``(L+1)``-layer transformers model's
   ``save_pretrained`` (which writes the experts one key per expert, the published layout) and is
   written as ``model.layers.{L}.*`` with every other tensor unchanged.

Reported: the soft cross-entropy and the top-1 agreement (MTP argmax == ``x_{t+2}``) on held-out
sequences, before and after. One CPU thread by default (a shared machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TINY_MTP_SPEC = ROOT / "specs" / "tiny_deepseek_v3_mtp.yaml"
# MTP layer key suffix (ours, the checkpoint's) -> MtpLayer attribute (transformers')
MTP_OWN = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "shared_head.norm": "post_norm"}


@dataclass(frozen=True)
class DistillResult:
    random_dir: str
    distilled_dir: str
    steps: int
    seconds: float
    train_loss_first: float   # soft cross-entropy of the first training batch
    train_loss_last: float    # ... of the last one
    heldout_loss_before: float
    heldout_loss_after: float
    heldout_top1_before: float  # MTP argmax == x_{t+2} on held-out rows, random head
    heldout_top1_after: float   # ... distilled head
    heldout_rows: int


def _hf_model(ckpt, **kw):
    import torch
    from transformers import DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM.from_pretrained(str(ckpt), local_files_only=True, dtype=torch.float32,
                                                 attn_implementation="eager", **kw).eval()


def _quiet_transformers():
    from transformers.utils import logging

    logging.set_verbosity_error()  # the (L+1)-layer load reports the MTP keys as unexpected, as it should


def _mtp_model(main, ckpt, L):
    """transformers' ``MtpModel(main, 1)`` holding the checkpoint's MTP layer L (the decoder layer via
    an (L+1)-layer load, so the experts go through transformers' own conversion)."""
    import torch
    from safetensors.torch import load_file
    from transformers.modeling_layers import MtpModel

    longer = _hf_model(ckpt, num_hidden_layers=L + 1)
    mtp = MtpModel(main, 1)
    mtp.layers[0].mtp_block.load_state_dict(longer.model.layers[L].state_dict())
    raw = load_file(os.path.join(str(ckpt), "model.safetensors"))
    with torch.no_grad():
        for ours, theirs in MTP_OWN.items():
            getattr(mtp.layers[0], theirs).weight.copy_(raw[f"model.layers.{L}.{ours}.weight"])
    return mtp, longer, raw


def _greedy_sequences(main, n, prompt_lens, seq_len, vocab, gen):
    """``n`` sequences of ``seq_len`` tokens: a random prompt (lengths cycling through
    ``prompt_lens``) and the target's greedy continuation; returns (ids [n, S], prompt lengths)."""
    import torch

    rows, lens = [], []
    per = -(-n // len(prompt_lens))
    for p in prompt_lens:
        prompts = torch.randint(0, vocab, (per, p), generator=gen)
        out = main.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=seq_len - p,
                            min_new_tokens=seq_len - p, do_sample=False, eos_token_id=None, pad_token_id=0)
        rows.append(out)
        lens += [p] * per
    return torch.cat(rows)[:n], torch.tensor(lens[:n])


def _mtp_loss(mtp, ids, hidden, teacher, mask, temperature=1.0):
    """Soft cross-entropy of the MTP rows against the target's distribution (sharpened by
    ``temperature`` < 1: the argmax is what speculative decoding must match), and top-1 hits/rows.
    Row t: hidden[t] and ids[t+1] -> x_{t+2}; teacher[t+1] is the target's logits for it."""
    import torch

    S = ids.shape[1]
    pos = torch.arange(S - 2)[None].expand(ids.shape[0], -1)
    g = mtp.forward_layer(0, hidden[:, :S - 2], pos, None, input_ids=ids[:, 1:S - 1])
    logits = mtp._project_to_logits(g)
    target = torch.softmax(teacher[:, 1:S - 1] / temperature, -1)
    ce = -(target * torch.log_softmax(logits, -1)).sum(-1)
    m = mask[:, :S - 2]
    loss = (ce * m).sum() / m.sum()
    hits = ((logits.argmax(-1) == ids[:, 2:]) & m.bool()).sum().item()
    return loss, hits, int(m.sum().item())


def distill(out_dir, *, spec_path=TINY_MTP_SPEC, target_dir=None, seed: int = 11, steps: int = 1000,
            sequences: int = 1024, heldout: int = 32, seq_len: int = 56, prompt_lens=(8, 16), batch: int = 32,
            lr: float = 1e-2, temperature: float = 0.5, threads: int = 1, log=print) -> DistillResult:
    """Distil; defaults: ~3-5 minutes on one loaded core (held-out top-1 ~0.17 seen at 1500 steps).
    The random head's top-1 is ~1/vocab."""
    import torch
    from safetensors.torch import load_file, save_file

    from graphgen.modelspec.loader import load_spec
    from graphgen.runtime.checkpoint.hf import write_random_hf_checkpoint

    spec = load_spec(spec_path)
    if spec.family != "deepseek_v3" or not spec.mtp_layers:
        raise SystemExit(f"{spec_path}: needs a DeepSeek-V3 spec with an mtp: section (e.g. {TINY_MTP_SPEC.name})")
    _quiet_transformers()
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    try:
        out = Path(out_dir)
        if target_dir is None:
            target_dir = write_random_hf_checkpoint(str(out / "random"), "deepseek_v3", dataclasses.asdict(spec.dims),
                                                    seed=seed, tokenizer=False, mtp_layers=spec.mtp_layers)
        L, V = spec.dims.num_hidden_layers, spec.dims.vocab_size
        main = _hf_model(target_dir)
        for p in main.parameters():
            p.requires_grad_(False)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            ids, plen = _greedy_sequences(main, sequences + heldout, prompt_lens, seq_len, V, gen)
            res = main(input_ids=ids, output_hidden_states=True)
            hidden, teacher = res.hidden_states[-1], res.logits
        # row t predicts x_{t+2}: trained only where the target generated it (t + 2 >= prompt length)
        mask = (torch.arange(seq_len)[None] + 2 >= plen[:, None]).float()
        mask[:, seq_len - 2:] = 0  # x_{t+2} past the sequence
        mtp, longer, raw = _mtp_model(main, target_dir, L)
        params = [p for p in mtp.layers[0].parameters() if p.requires_grad]
        opt = torch.optim.Adam(params, lr=lr)
        tr, ho = slice(0, sequences), slice(sequences, sequences + heldout)

        def evaluate():
            with torch.no_grad():
                loss, hits, rows = _mtp_loss(mtp, ids[ho], hidden[ho], teacher[ho], mask[ho], temperature)
            return loss.item(), hits / rows, rows

        before = evaluate()
        log(f"held-out before: loss {before[0]:.4f}, top-1 agreement {before[1]:.3f} ({before[2]} rows)")
        mtp.train()
        first = last = float("nan")
        order = torch.Generator().manual_seed(seed + 1)
        for step in range(steps):
            pick = torch.randperm(sequences, generator=order)[:batch]
            loss, _, _ = _mtp_loss(mtp, ids[tr][pick], hidden[tr][pick], teacher[tr][pick], mask[tr][pick],
                                  temperature)
            opt.zero_grad()
            loss.backward()
            opt.step()
            last = loss.item()
            first = last if step == 0 else first
            if step % 100 == 99:
                log(f"step {step + 1}: train loss {last:.4f}")
        mtp.eval()
        after = evaluate()
        log(f"held-out after:  loss {after[0]:.4f}, top-1 agreement {after[1]:.3f}")
        distilled = _write_distilled(out / "distilled", target_dir, mtp, longer, raw, L, save_file, load_file)
    finally:
        torch.set_num_threads(old_threads)
    return DistillResult(str(target_dir), str(distilled), steps, time.perf_counter() - t0, first, last,
                         before[0], after[0], before[1], after[1], before[2])


def _write_distilled(out, target_dir, mtp, longer, raw, L, save_file, load_file) -> str:
    """``target_dir``'s files with the MTP layer's tensors replaced by the trained ones."""
    import torch

    prefix = f"model.layers.{L}."
    longer.model.layers[L].load_state_dict(mtp.layers[0].mtp_block.state_dict())
    with tempfile.TemporaryDirectory() as tmp:
        longer.save_pretrained(tmp)  # transformers writes the published per-expert keys back
        saved = load_file(os.path.join(tmp, "model.safetensors"))
    decoder = {k: v for k, v in saved.items() if k.startswith(prefix)}
    missing = [k for k in decoder if k not in raw]
    if missing:
        raise RuntimeError(f"transformers saved MTP decoder keys the checkpoint does not have: {missing[:3]}")
    tensors = dict(raw)
    tensors.update(decoder)
    for ours, theirs in MTP_OWN.items():
        tensors[f"{prefix}{ours}.weight"] = getattr(mtp.layers[0], theirs).weight.detach()
    out.mkdir(parents=True, exist_ok=True)
    for f in os.listdir(target_dir):  # config.json, tokenizer files: unchanged
        if f != "model.safetensors":
            shutil.copy(os.path.join(target_dir, f), out / f)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return str(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder for random/ and distilled/")
    ap.add_argument("--spec", default=str(TINY_MTP_SPEC))
    ap.add_argument("--target", default=None, help="an existing checkpoint of the spec with MTP layers")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--sequences", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    r = distill(args.out, spec_path=args.spec, target_dir=args.target, seed=args.seed, steps=args.steps,
                sequences=args.sequences, threads=args.threads)
    print(json.dumps(dataclasses.asdict(r)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
