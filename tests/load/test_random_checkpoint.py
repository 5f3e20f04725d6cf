"""``graphgen checkpoint`` / `write_random_hf_checkpoint` on a model larger than one shard (issue 43 item 1):
it is written shard by shard, holding one shard at a time, as ``save_pretrained`` lays it out (shards of at
most the size, ``model.safetensors.index.json``), with the same values as the one-file checkpoint of the
same seed; a model the disk or the memory here cannot hold is refused before anything is written, in one
sentence naming ``scripts/sparse_checkpoint.py``.

The bounded peak is measured two ways that do not share the writer's bookkeeping: what the writer reports
holding per shard, and this process's resident memory sampled while it writes (``/proc/self/statm``): the
writer before this issue kept every tensor until one ``save_file`` at the end, so its resident growth was
the whole model's size (checked once by hand on it: +173 MiB of this 106 MiB model)."""
from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from graphgen.runtime.checkpoint import hf
from support.inproc import cli_inproc
from support.paths import SPECS

MIB, GIB = 1 << 20, 1 << 30
# Qwen3 at 512 wide, 6 layers: 106 MiB of float32, its largest tensor 4 MiB (no tied embeddings)
MID = {"num_hidden_layers": 6, "hidden_size": 512, "intermediate_size": 2048, "vocab_size": 4096,
       "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64, "rope_theta": 1e6,
       "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
SHARD = 8 * MIB


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeakRss:
    """The largest resident size seen while the block runs (a thread polling every millisecond)."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._poll, daemon=True)
        self._t.start()
        return self

    def _poll(self):
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())

    @property
    def growth(self) -> int:
        return self.peak - self.base


def test_a_sharded_write_holds_one_shard_and_equals_the_one_file_checkpoint(tmp_path):
    plan = hf.plan_random_checkpoint("qwen3_dense", MID, shard_bytes=SHARD)
    total = plan.total_bytes
    assert total > 90 * MIB and len(plan.files) >= 12 and max(t.nbytes for t in plan.tensors) <= SHARD
    held = []
    out = tmp_path / "sharded"
    with _PeakRss() as rss:
        hf.write_random_hf_checkpoint(str(out), "qwen3_dense", MID, seed=5, tokenizer=False, shard_bytes=SHARD,
                                      on_shard=lambda i, p, n: held.append(n))
    assert len(held) == len(plan.files) and max(held) <= SHARD and sum(held) == total
    # measured 27-37 MiB (8 MiB shards, the draws' temporaries, the allocator's free lists); the old writer's
    # 173 MiB, the whole model and more
    assert rss.growth < total / 2, (rss.growth / MIB, total / MIB)
    names = sorted(os.listdir(out))
    assert names == sorted(["config.json", "model.safetensors.index.json", *plan.files]), names
    assert plan.files[0] == f"model-00001-of-{len(plan.files):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == total and set(index["weight_map"].values()) == set(plan.files)
    assert all((out / f).stat().st_size <= SHARD + 64 * 1024 for f in plan.files)  # data + header
    one = hf.write_random_hf_checkpoint(str(tmp_path / "one"), "qwen3_dense", MID, seed=5, tokenizer=False)
    assert sorted(os.listdir(one)) == ["config.json", "model.safetensors"]
    a, b = hf.load_hf_weights(str(out)), hf.load_hf_weights(one)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the values ignore the sharding
    # rewritten as one file: the shards and the index go (the single file would shadow nothing stale)
    hf.write_random_hf_checkpoint(str(out), "qwen3_dense", MID, seed=5, tokenizer=False)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]


def test_mtp_copies_of_a_tensor_in_an_earlier_shard_are_read_back(tmp_path):
    """DeepSeek-V3's MTP layer copies the embedding and the LM head (drawn first, saved shards earlier)."""
    from graphgen.modelspec.loader import load_spec

    import dataclasses

    spec = load_spec(SPECS / "tiny_deepseek_v3_mtp.yaml")
    dims = dataclasses.asdict(spec.dims)
    plan = hf.plan_random_checkpoint(spec.family, dims, mtp_layers=1, shard_bytes=64 * 1024)
    assert len(plan.files) > 3 and any(t.copy_of for t in plan.tensors)
    sharded = hf.write_random_hf_checkpoint(str(tmp_path / "s"), spec.family, dims, mtp_layers=1, tokenizer=False,
                                            shard_bytes=64 * 1024)
    one = hf.write_random_hf_checkpoint(str(tmp_path / "o"), spec.family, dims, mtp_layers=1, tokenizer=False)
    a, b = hf.load_hf_weights(sharded, mtp_layers=1), hf.load_hf_weights(one, mtp_layers=1)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_model_the_disk_or_memory_cannot_hold_is_refused_in_one_sentence(tmp_path, monkeypatch):
    """Qwen3-32B (122 GiB of float32) against injected figures: a disk or a memory too small is refused by
    the CLI and by the writer before anything is written; figures that hold it are no problem."""
    from graphgen.modelspec.loader import load_spec

    import dataclasses

    spec = load_spec(SPECS / "qwen3_32b.yaml")
    plan = hf.plan_random_checkpoint(spec.family, dataclasses.asdict(spec.dims))
    assert 120 * GIB < plan.total_bytes < 125 * GIB
    assert plan.host_peak_bytes < 12 * GIB  # a 5 GB shard and one tensor's draw, never the model
    out = tmp_path / "q32"
    disk = hf.room_problem(plan, str(out), disk_free=60 * GIB, memory_free=20 * GIB)
    assert disk and "122.0 GiB of files where the disk of" in disk and "60.0 GiB free" in disk
    assert "of memory while writing" not in disk and "scripts/sparse_checkpoint.py" in disk
    mem = hf.room_problem(plan, str(out), disk_free=200 * GIB, memory_free=4 * GIB)
    assert mem and "of memory while writing" in mem and "4.0 GiB is available" in mem and "of files" not in mem
    assert hf.room_problem(plan, str(out), disk_free=200 * GIB, memory_free=20 * GIB) is None

    monkeypatch.setattr(hf, "room_for", lambda out_dir: (60 * GIB, 20 * GIB))  # nothing here is written
    res = cli_inproc("checkpoint", "--spec", SPECS / "qwen3_32b.yaml", "--out", out)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("graphgen checkpoint: qwen3_32b: a random checkpoint of this model needs 122.0 GiB")
    assert "scripts/sparse_checkpoint.py CONFIG_JSON OUT_DIR" in line and not out.exists()
    with pytest.raises(hf.CheckpointTooLarge, match="sparse_checkpoint"):
        hf.write_random_hf_checkpoint(str(out), spec.family, dataclasses.asdict(spec.dims))
    assert not out.exists()


def test_the_cli_writes_shards_with_a_line_each(tmp_path):
    res = cli_inproc("checkpoint", "--spec", SPECS / "tiny_deepseek_v3.yaml", "--out", tmp_path / "c",
                     "--shard-gb", "0.0002")
    assert res.returncode == 0, res.stderr
    n = len([f for f in os.listdir(tmp_path / "c") if hf.SHARD_NAME.match(f)])
    assert n > 3 and f"shard {n}/{n} written" in res.stderr and (tmp_path / "c/model.safetensors.index.json").exists()
