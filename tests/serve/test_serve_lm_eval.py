"""lm-eval (nobody here wrote it) against the server: its ``local-completions`` model runs a local
multiple-choice task (loglikelihood: ``echo`` + ``logprobs`` + ``max_tokens: 1`` per choice, the
choices sharing their context) and a local generate_until task (greedy, five stop strings), and
per sample its results equal lm-eval's own Hugging Face backend on the same checkpoint:
continuation log-likelihoods within 1e-4, the same is-greedy flags, identical generated strings.
Offline: the tasks read JSONL files next to this module (``lm_eval_tasks/``). lm-eval is imported by
the test, not at collection (seconds of imports every run would pay); a missing extra fails it, never
skips. The server is the one most modules share (conftest): lm-eval's requests need nothing else."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


TASKS = Path(__file__).parent / "lm_eval_tasks"
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """The task YAMLs with their data files' absolute paths (lm-eval reads them relative to the cwd)."""
    out = tmp_path_factory.mktemp("lm_eval_tasks")
    for y in TASKS.glob("*.yaml"):
        text = y.read_text()
        for data in TASKS.glob("*.jsonl"):
            text = text.replace(f"test: {data.name}", f"test: {data}")
        (out / y.name).write_text(text)
    return out


def _evaluate(model: str, model_args: str, task_dir) -> dict:
    import accelerate  # noqa: F401  (the eval extra ./dev installs; lm-eval's hf backend imports it)
    import lm_eval
    from lm_eval.tasks import TaskManager

    for k, v in OFFLINE.items():
        os.environ[k] = v
    res = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["gg_mc", "gg_gen"],
                                  task_manager=TaskManager(include_path=str(task_dir)), log_samples=True,
                                  batch_size=1, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                  fewshot_random_seed=0)
    return {task: sorted(samples, key=lambda s: s["doc_id"]) for task, samples in res["samples"].items()}


def test_lm_eval_local_completions_equals_hf_backend(server, ckpt, task_dir):
    import torch

    torch.set_num_threads(1)
    hf = _evaluate("hf", f"pretrained={ckpt},dtype=float32,device=cpu", task_dir)
    served = _evaluate("local-completions",
                       f"model=tiny_qwen3,base_url={server.base}/v1/completions,tokenizer={ckpt},"
                       f"tokenized_requests=True,num_concurrent=1,max_retries=1", task_dir)

    mc_hf, mc_sv = hf["gg_mc"], served["gg_mc"]
    assert len(mc_hf) == len(mc_sv) == 4
    for a, b in zip(mc_hf, mc_sv):
        assert a["doc_id"] == b["doc_id"]
        lls_hf = [r[0] for r in a["resps"]]  # per choice: [(loglikelihood, is_greedy)]
        lls_sv = [r[0] for r in b["resps"]]
        assert len(lls_hf) == len(lls_sv) == len(a["doc"]["choices"])
        for (ll_a, g_a), (ll_b, g_b) in zip(lls_hf, lls_sv):
            assert abs(float(ll_a) - float(ll_b)) <= 1e-4, (a["doc_id"], ll_a, ll_b)
            assert bool(g_a) == bool(g_b)
    gen_hf, gen_sv = hf["gg_gen"], served["gg_gen"]
    assert len(gen_hf) == len(gen_sv) == 3
    for a, b in zip(gen_hf, gen_sv):
        assert a["filtered_resps"] == b["filtered_resps"], (a["doc_id"], a["filtered_resps"], b["filtered_resps"])
    assert any(x for s in gen_sv for x in s["filtered_resps"])  # something was generated
