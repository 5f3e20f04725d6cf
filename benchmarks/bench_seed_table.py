"""The seed's results table, replayed row by row at this machine's scale: every configuration the seed
measured, run through ``graphgen serve`` (and ``graphgen route`` for 2P1D), its figure printed beside ours.

The seed (``../shared/seed/README.md``: MindIE-LLM PR #705, Ascend) justifies async write with one table:
DeepSeek-V3.1 and Qwen3-32B, accuracy (GPQA, sync vs async write) and TTFT (GSM8K prompts at 8k and 16k
tokens) for 1, 32 and 64 concurrent requests, no prefix cache vs prefix cache with sync write vs with async
write at a 50 % hit, on CP/SP, DP/TP and 2P1D. Here, per group of rows (the rows the seed measured side by
side):

* **Model**: the same family at tiny dims, random weights (``write_random_hf_checkpoint``, seed 0): tiny
  Qwen3 (``specs/tiny_qwen3.yaml``: 2 layers, hidden 64, 4 query / 2 KV heads x 16, vocab 256) and tiny
  DeepSeek-V3 (``specs/tiny_deepseek_v3.yaml``: 3 layers, one dense then MoE with 8 routed experts, MLA
  with kv_lora_rank 16 + rope 8, hidden 64, vocab 256), both run with the seed hardware's KV layout
  (block size 128, bfloat16 KV). The dims are tiny but the prompts are the seed's (8k and 16k tokens): one
  prefill step is 0.3-6 s of real compute here, not per-step overhead (the run prints the measured step).
* **Layout**: the seed's shape on the command line (``--cp 2 --tp 2 --sp``; ``--dp 2 --tp 2 --ep 4``; 2P1D
  of such instances over Mooncake). Each is tried for real first; where ``graphgen serve`` refuses it, the
  row prints the refusal's sentence, and a row labelled *nearest runnable* runs the closest layout that
  starts today (never presented as the seed's configuration). Once the refused layouts land, the same
  command fills the seed's rows with no change.
* **Settings**, one server each, started together, driven alternately (the order rotated every round,
  the same prompts for every setting in a round): no prefix cache (``--write off``, cold prompts);
  prefix cache with sync write; prefix cache with async write. For the two prefix-cache settings each
  prompt's first half is sent first (its KV saved to the pool), then the full prompt: a 50 % hit, which
  the run checks from each server's ``graphgen_prefix_cache_hit_tokens_total``. Granularity ``forward``
  (the seed's "non-layered" save), async scheduling on (the seed's "async inference", the server's
  default), one request's new tokens per step (``--max-num-batched-tokens`` = half the prompt).
* **A save as slow relative to a step as the seed's**: at 1 concurrent request, TTFT is one prefill, so
  the seed's sync vs async pair gives the save's cost S relative to the rest C of that prefill when async
  hides it: S / C = sync / async - 1 = 1135.4 / 1087.8 - 1 = **4.38 %** (DeepSeek-V3.1) and 1159.8 / 1098.3
  - 1 = **5.60 %** (Qwen3-32B). Per group a calibration server (async, no injected delay, the group's
  layout) measures C0 = the median 1-client TTFT at a 50 % hit; every server of the group then runs with
  ``--faults save_delay=r * C0 / layers`` (one sleep per layer save op: r * C0 per prefill step). The same
  r (the 1-client pair's) is used at 32 and 64 clients: there the seed's own ratios are measured, not set.
  Our real save (a copy into the in-process pool) comes on top of it in sync (printed: the calibration).
* **Clients**: closed-loop streaming clients through the official ``openai`` client (completions, token-id
  prompts, ``stream=True``; TTFT = request sent -> first chunk with a token). At 32 and 64 clients a round is
  one wave (every client one request); at 1 client a round is ``--requests-1`` requests (default 8);
  ``--rounds`` (default 1) repeats every group's settings, order rotated.
* **Ours**: TTFT median and p90 over every request of every round, and the seed's remark's ratios
  (``async / sync - 1``, ``async / no PC - 1``) of the medians (and of the p90s), all measured in this run.
* **Accuracy rows**: no GPQA here and no real checkpoint of either family (see the row), so what is
  measured is what "no accuracy loss" means for a save: a fixed prompt set (``--acc-prompts`` prompts of
  ``--acc-len`` tokens, 50 % pool hit, greedy, ``--acc-tokens`` tokens, top-5 logprobs) sent at the row's
  concurrency to the sync and the async server of the group; printed: how many greedy sequences are
  identical and the largest logprob difference over the positions before any divergence — beside the same
  figures for a second sync server (the control: what two servers of one configuration differ by when 64
  requests share their steps in a different order).

Usage (repo root; as root: the 2P1D rows run ``scripts/pd_cluster.py`` in a private network namespace):
    .venv/bin/python benchmarks/bench_seed_table.py --quick          # ~7 min here: clients 1/4/8
    nice -n 10 .venv/bin/python benchmarks/bench_seed_table.py       # the full table: clients 1/32/64, ~25 min
    .venv/bin/python benchmarks/bench_seed_table.py --quick --rows 1 # one row (the suite's smoke test)
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from bench_serve import Config, ServerProc, ServerRefused, _pct, refusal_sentence, run_load  # noqa: E402

# -- the seed's table ----------------------------------------------------------------------------------------
# S/C of the seed's save, from its 1-concurrent sync vs async pair (module doc)
SAVE_RATIO = {"deepseek": 1135.4 / 1087.8 - 1, "qwen": 1159.8 / 1098.3 - 1}


@dataclasses.dataclass(frozen=True)
class SeedRow:
    n: int  # the row's number in the seed's table (1-based)
    group: str  # the rows the seed measured side by side
    model: str
    kind: str  # accuracy | perf
    config: str  # the seed's configuration column
    figure: str  # the seed's result
    setting: str  # off | sync | async: which of our servers answers the row
    remark: str = ""  # the seed's note
    ratios: tuple = ()  # ((label, setting a, setting b), ...): our a / b - 1 beside the remark


SEED = (
    SeedRow(1, "ds_cpsp", "DeepSeek V3.1", "accuracy", "GPQA; 64 concurrent + CP/SP + async inference + sync write",
            "68.18%", "sync", "baseline"),
    SeedRow(2, "ds_cpsp", "DeepSeek V3.1", "accuracy", "GPQA; same + async write", "71.21%", "async",
            "no accuracy loss"),
    SeedRow(3, "ds_cpsp", "DeepSeek V3.1", "perf", "GSM8K; 1 concurrent + CP/SP + async inference, 8k input",
            "TTFT 1536.9 ms", "off", "no prefix cache"),
    SeedRow(4, "ds_cpsp", "DeepSeek V3.1", "perf", "GSM8K; same + sync write", "TTFT 1135.4 ms", "sync", "baseline"),
    SeedRow(5, "ds_cpsp", "DeepSeek V3.1", "perf", "GSM8K; same + async write", "TTFT 1087.8 ms", "async",
            "-29.2% vs no prefix cache at 50% hit; -4.2% vs sync",
            (("vs no PC", "async", "off"), ("vs sync", "async", "sync"))),
    SeedRow(6, "ds_dptp", "DeepSeek V3.1", "perf", "GSM8K; 64 concurrent + DP/TP, 8k, sync write", "TTFT 2228.9 ms",
            "sync", "baseline"),
    SeedRow(7, "ds_dptp", "DeepSeek V3.1", "perf", "GSM8K; same, async write", "TTFT 2036.0 ms", "async",
            "-8.65% vs sync", (("vs sync", "async", "sync"),)),
    SeedRow(8, "ds_2p1d", "DeepSeek V3.1", "perf", "GSM8K; 2P1D + 32 concurrent + DP/TP, 16k, sync write",
            "TTFT 6109.5 ms", "sync", "baseline"),
    SeedRow(9, "ds_2p1d", "DeepSeek V3.1", "perf", "GSM8K; same, async write", "TTFT 5880.6 ms", "async",
            "-3.75% vs sync", (("vs sync", "async", "sync"),)),
    SeedRow(10, "qwen_acc", "Qwen3-32B", "accuracy", "GPQA; 64 concurrent + async inference + async write", "62.12%",
            "async"),
    SeedRow(11, "qwen_8k", "Qwen3-32B", "perf", "GSM8K; 1 concurrent, 8k input", "TTFT 1575.3 ms", "off",
            "no prefix cache"),
    SeedRow(12, "qwen_8k", "Qwen3-32B", "perf", "GSM8K; same + sync write", "TTFT 1159.8 ms", "sync", "baseline"),
    SeedRow(13, "qwen_8k", "Qwen3-32B", "perf", "GSM8K; same + async write", "TTFT 1098.3 ms", "async",
            "-30.3% vs no prefix cache at 50% hit; -5.3% vs sync",
            (("vs no PC", "async", "off"), ("vs sync", "async", "sync"))),
    SeedRow(14, "qwen_16k", "Qwen3-32B", "perf", "GSM8K; 64 concurrent, 16k, sync write", "TTFT 6786.4 ms", "sync",
            "baseline"),
    SeedRow(15, "qwen_16k", "Qwen3-32B", "perf", "GSM8K; same, async write", "TTFT 5969.9 ms", "async",
            "-12.03% vs sync", (("vs sync", "async", "sync"),)),
)


@dataclasses.dataclass(frozen=True)
class Group:
    """One set of servers measured side by side: the seed's layout (``flags``) and, where that is refused
    today, the nearest layout that runs (``nearest``, labelled as such in the table)."""
    name: str
    family: str  # qwen | deepseek
    flags: tuple  # the seed's layout, as graphgen serve flags
    clients: int  # the seed's concurrency
    prompt_len: int
    settings: tuple  # which servers: off / sync / async
    nearest: tuple = None  # flags of the nearest runnable layout, or None
    nearest_why: str = ""
    pd: bool = False  # 2P1D behind graphgen route (scripts/pd_cluster.py)
    accuracy: bool = False  # the group's sync/async servers also answer the accuracy rows
    perf: bool = True


GROUPS = (
    Group("ds_cpsp", "deepseek", ("--cp", "2", "--tp", "2", "--sp"), 1, 8192, ("off", "sync", "async"),
          nearest=("--cp", "2"), nearest_why="CP alone (tp 1, no SP), run only if the seed's CP/SP is refused",
          accuracy=True),
    Group("ds_dptp", "deepseek", ("--dp", "2", "--tp", "2", "--ep", "4"), 64, 8192, ("sync", "async"),
          nearest=("--dp", "2", "--ep", "2"), nearest_why="DP attention at tp 1 inside each DP group"),
    Group("ds_2p1d", "deepseek", ("--dp", "2", "--tp", "2", "--ep", "4"), 32, 16384, ("sync", "async"),
          nearest=(), nearest_why="2P1D of one-rank instances, the cheapest 2P1D beside the seed's dp x tp one",
          pd=True),
    Group("qwen_acc", "qwen", (), 64, 8192, ("sync", "async"), accuracy=True, perf=False),
    Group("qwen_8k", "qwen", (), 1, 8192, ("off", "sync", "async")),
    Group("qwen_16k", "qwen", (), 64, 16384, ("sync", "async")),
)

SPECS = {"qwen": "specs/tiny_qwen3.yaml", "deepseek": "specs/tiny_deepseek_v3.yaml"}
BLOCK_SIZE, KV_DTYPE = 128, "bfloat16"  # the seed hardware's KV layout (Ascend's 128-token blocks)
LM_EVAL_WHY = ("lm-eval accuracy not run: no Qwen3 or DeepSeek-V3 checkpoint ships in a registry package "
               "(the package lists hold hub downloaders, e.g. md-reheader and qwen3-0-6b fetch Qwen3-0.6B at "
               "run time, and GGUF files of other architectures), the hub is unreachable, and GPQA is not "
               "public offline; a random-weight model's accuracy would be chance, not a figure")


def bench_spec_file(family: str, folder: Path) -> str:
    """A copy of the family's tiny spec with the seed hardware's KV layout (and its own name: own pool keys)."""
    import yaml

    doc = yaml.safe_load((REPO / SPECS[family]).read_text())
    doc["kv_cache"] = {"block_size": BLOCK_SIZE, "dtype": KV_DTYPE}
    doc["name"] = f"{doc['name']}_b{BLOCK_SIZE}"
    out = folder / f"{doc['name']}.yaml"
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(out)


# -- the openai client --------------------------------------------------------------------------------------
_CLIENTS: dict = {}
_CLIENTS_LOCK = threading.Lock()


def _client(port: int):
    import openai

    with _CLIENTS_LOCK:
        if port not in _CLIENTS:
            _CLIENTS[port] = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                                           timeout=1800.0)
        return _CLIENTS[port]


MODEL = {"name": "model"}  # the served model's name (the spec's), set per group


def openai_request(port: int, prompt: list[int], max_tokens: int, timeout: float) -> tuple[float, list[float], int]:
    """(ttft_s, inter-token gaps, tokens) of one streamed greedy completion through the openai client."""
    t0 = time.perf_counter()
    stamps = []
    stream = _client(port).completions.create(model=MODEL["name"], prompt=prompt, max_tokens=max_tokens,
                                              temperature=0, stream=True, timeout=timeout)
    for chunk in stream:
        for ch in chunk.choices:
            ids = (ch.model_extra or {}).get("token_ids") or []
            stamps.extend([time.perf_counter()] * len(ids))
    if not stamps:
        raise RuntimeError("no tokens")
    return stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:])], len(stamps)


def openai_logprobs(port: int, prompts: list[list[int]], concurrency: int, max_tokens: int) -> list:
    """Per prompt: (token ids, chosen-token logprobs, top-5 {token: logprob} dicts), greedy, non-streamed,
    ``concurrency`` requests in flight."""
    from concurrent.futures import ThreadPoolExecutor

    def one(p):
        r = _client(port).completions.create(model=MODEL["name"], prompt=p, max_tokens=max_tokens, temperature=0,
                                             logprobs=5)
        ch = r.choices[0]
        return ((ch.model_extra or {}).get("token_ids") or [], list(ch.logprobs.token_logprobs),
                [dict(d) for d in ch.logprobs.top_logprobs])

    with ThreadPoolExecutor(concurrency) as ex:
        return list(ex.map(one, prompts))


# -- one measured wave --------------------------------------------------------------------------------------
def _counter(srv: ServerProc, name: str) -> float:
    return scrape(srv.port).get(name, 0.0)


def scrape(port: int) -> dict:
    """{sample name: value} of a server's /metrics (label-free samples only)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def wait_saves_committed(port: int, timeout_s: float) -> float:
    """Poll ``graphgen_kv_saves_pending`` until no host commit is in flight (the server's ``drain``): an
    async save still committing would make the next prompt's hit smaller than sync's. Seconds waited."""
    t0 = time.perf_counter()
    while scrape(port).get("graphgen_kv_saves_pending", 0.0) > 0:
        if time.perf_counter() - t0 > timeout_s:
            raise RuntimeError(f"saves still pending after {timeout_s:.0f} s")
        time.sleep(0.05)
    return time.perf_counter() - t0


def measure(port: int, prompts: list[list[int]], clients: int, max_tokens: int, warm: bool, budget_s: float,
            drain: bool = True) -> dict:
    """Warm each prompt's first half (when ``warm``: the pool then holds it; with ``drain``, every commit
    landed), then the full prompts; TTFTs."""
    if warm:
        halves = [p[:len(p) // 2] for p in prompts]
        w = run_load(port, halves, clients, 1, budget_s, request=openai_request)
        if w["errors"]:
            raise RuntimeError(f"warm-up failed: {w['errors'][:2]}")
        if drain:
            wait_saves_committed(port, budget_s)
    r = run_load(port, prompts, clients, max_tokens, budget_s, request=openai_request)
    return {"ttft": [x[0] * 1e3 for x in r["results"]], "errors": r["errors"], "wall_s": r["wall_s"]}


def calibrate(spec: str, ckpt: str, flags: tuple, prompts: list[list[int]], common: list[str]) -> tuple:
    """C0: median 1-client TTFT (ms) at a 50 % hit, async, no injected delay, the group's layout; and the
    same with sync (our real save's cost). ServerRefused when the layout is refused."""
    out = {}
    servers = {w: ServerProc(Config(f"calibrate-{w}", w), spec, ckpt, [*common, *flags], granularity="forward")
               for w in ("async", "sync")}
    try:
        for w, srv in servers.items():
            out[w] = measure(srv.port, prompts, 1, 1, True, 1800)["ttft"]
    finally:
        for s in servers.values():
            s.stop()
    return statistics.median(out["async"]), statistics.median(out["sync"])


class Prompts:
    def __init__(self, seed: int, vocab: int):
        self.rng, self.vocab = random.Random(seed), vocab

    def take(self, n: int, length: int) -> list[list[int]]:
        return [[self.rng.randrange(self.vocab) for _ in range(length)] for _ in range(n)]


def run_group(g: Group, args, ckpts: dict, specs: dict, rows, log) -> dict:
    """Every setting of one group, side by side: the seed's layout first, the nearest runnable one where it
    is refused. {"layout": flags run, "refused": the seed layout's sentence or None, "ttft": ..., ...}."""
    from graphgen.modelspec.loader import load_spec

    spec_file, ckpt = specs[g.family], ckpts[g.family]
    spec = load_spec(spec_file)
    MODEL["name"] = spec.name
    clients = args.clients_map[g.clients]
    n = args.prompt_map.get(g.prompt_len, g.prompt_len)
    need_perf = g.perf and any(r.kind == "perf" for r in rows if r.group == g.name)
    need_acc = g.accuracy and any(r.kind == "accuracy" for r in rows if r.group == g.name)
    longest = max(n if need_perf else 0, args.acc_len if need_acc else 0)
    common = ["--max-num-batched-tokens", str(max(n // 2, 16)),
              "--num-blocks", str(max(clients, args.acc_prompts if need_acc else 1, 2)
                                  * (-(-(longest + max(args.max_tokens, args.acc_tokens)) // BLOCK_SIZE) + 1) + 64),
              "--max-num-seqs", "64"]
    gen = Prompts(args.seed * 1009 + sum(map(ord, g.name)), spec.dims.vocab_size)
    res = {"group": g.name, "refused": None, "layout": g.flags, "nearest": False, "clients": clients,
           "prompt_len": n, "perf": need_perf, "accuracy_run": need_acc}
    layouts = [(g.flags, False)] + ([(g.nearest, True)] if g.nearest is not None else [])
    for flags, nearest in layouts:
        try:
            res.update(attempt(g, args, spec, spec_file, ckpt, list(flags), common, clients, n, gen, need_perf,
                               need_acc, log), layout=flags, nearest=nearest)
            break
        except ServerRefused as e:  # refused (one sentence), or it did not start: the next layout is tried
            what = "refused today" if e.is_refusal else "did not start"
            log(f"[{g.name}] {' '.join(flags) or '(one rank)'} {what}: {e.sentence}")
            res["nearest_refused" if nearest else "refused"] = f"**{what}**: {e.sentence}"
        except Exception as e:  # printed in the group's rows: the other rows still run
            log(f"[{g.name}] {' '.join(flags) or '(one rank)'} failed: {type(e).__name__}: {e}")
            res.update(failed=f"{type(e).__name__}: {str(e)[:300]}", layout=flags, nearest=nearest)
            break
    return res


def attempt(g: Group, args, spec, spec_file, ckpt, flags, common, clients, n, gen, need_perf, need_acc, log) -> dict:
    """One layout of a group: calibrate (perf rows), start the settings' servers, measure. ServerRefused
    when a command of this layout is refused."""
    out = {}
    faults = ""
    if need_perf:
        t = time.perf_counter()
        c0, c0_sync = calibrate(spec_file, ckpt, tuple(flags), gen.take(args.calib, n), common)
        r = SAVE_RATIO[g.family]
        delay = r * c0 / 1e3 / spec.dims.num_hidden_layers
        faults = f"save_delay={delay:.6f}"
        out.update(c0_ms=c0, c0_sync_ms=c0_sync, save_ratio=r, save_delay_s=delay, faults=faults)
        log(f"[{g.name}] calibrated {' '.join(flags) or '(one rank)'}: async {c0:.0f} ms, sync {c0_sync:.0f} ms at "
            f"1 client, 50% hit, no injected delay -> {faults} ({time.perf_counter() - t:.0f} s)")
    if g.pd:
        out.update(run_pd(g, args, spec_file, ckpt, flags, common, faults, clients, n, gen, log))
        return out
    settings = g.settings if need_perf else ("sync", "async")
    servers = {}
    try:
        for s in settings:
            servers[s] = ServerProc(Config(s, s, faults), spec_file, ckpt, [*common, *flags], granularity="forward")
        if need_acc:  # the accuracy rows' control: a second sync server
            servers["sync2"] = ServerProc(Config("sync2", "sync", faults), spec_file, ckpt, [*common, *flags],
                                          granularity="forward")
        if need_perf:
            ttft = {s: [] for s in settings}
            hits = {s: [0.0, 0] for s in settings}
            per_round = clients if clients > 1 else args.requests_1
            for rnd in range(args.rounds):
                prompts = gen.take(per_round, n)
                k = rnd % len(settings)
                for s in settings[k:] + settings[:k]:
                    srv = servers[s]
                    before = _counter(srv, "graphgen_prefix_cache_hit_tokens_total")
                    t = time.perf_counter()
                    m = measure(srv.port, prompts, clients, args.max_tokens, s != "off", args.budget)
                    hit = _counter(srv, "graphgen_prefix_cache_hit_tokens_total") - before
                    if m["errors"]:
                        raise RuntimeError(f"{s}: {len(m['errors'])} requests failed: {m['errors'][:2]}")
                    ttft[s] += m["ttft"]
                    hits[s][0] += hit
                    hits[s][1] += len(prompts) * n
                    log(f"[{g.name}] round {rnd + 1}/{args.rounds} {s}: TTFT p50 {_pct(m['ttft'], 50):.0f} ms, "
                        f"p90 {_pct(m['ttft'], 90):.0f} ms, {len(m['ttft'])} requests, hit "
                        f"{hit / (len(prompts) * n):.0%} ({time.perf_counter() - t:.0f} s)")
            out["ttft"] = ttft
            out["hit"] = {s: h / max(tot, 1) for s, (h, tot) in hits.items()}
        if need_acc:
            out["accuracy"] = accuracy(servers, args, gen, log, g.name)
        out["metrics"] = {s: _step_means(srv) for s, srv in servers.items()}
    finally:
        out["exit_codes"] = {s: srv.stop() for s, srv in servers.items()}
    return out


def _step_means(srv: ServerProc) -> dict:
    m = scrape(srv.port)

    def mean(h):
        return 1e3 * m.get(h + "_sum", 0.0) / m[h + "_count"] if m.get(h + "_count") else float("nan")
    return {"forward_ms": mean("graphgen_forward_latency_seconds"), "steps": m.get("graphgen_engine_steps_total", 0)}


def _compare(xs: list, ys: list) -> dict:
    """Greedy sequences identical, and the largest |logprob difference| (chosen tokens and the top-5 both
    list) over the positions before each pair's first divergence."""
    same, maxdiff, positions, first_div = 0, 0.0, 0, []
    for (ta, la, topa), (tb, lb, topb) in zip(xs, ys):
        k = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        if ta == tb:
            same += 1
        else:
            first_div.append(k)
        for i in range(k):
            positions += 1
            maxdiff = max(maxdiff, abs(la[i] - lb[i]))
            # the top-5 are keyed by token text: without a tokenizer several ids render alike, so a dict of
            # fewer than 5 keys merged some; compared only where both hold 5 distinct tokens
            if len(topa[i]) == len(topb[i]) == 5:
                for tok in set(topa[i]) & set(topb[i]):
                    maxdiff = max(maxdiff, abs(topa[i][tok] - topb[i][tok]))
    return {"identical": same, "max_logprob_diff": maxdiff, "positions": positions, "first_divergence": first_div}


def accuracy(servers: dict, args, gen: Prompts, log, name: str) -> dict:
    """The fixed prompt set through the sync and the async server (50 % pool hit): greedy tokens identical?
    the largest |logprob difference| before the first divergence. The control: the same prompts through a
    second sync server (``sync2``): what two runs of one configuration differ by under this concurrency."""
    prompts = gen.take(args.acc_prompts, args.acc_len)
    conc = min(args.clients_map[64], len(prompts))
    out, hit = {}, {}
    for s in ("sync", "async", "sync2"):
        port = servers[s].port
        run_load(port, [p[:len(p) // 2] for p in prompts], conc, 1, args.budget, request=openai_request)
        wait_saves_committed(port, args.budget)  # every server loads the same halves from its pool
        before = scrape(port).get("graphgen_prefix_cache_hit_tokens_total", 0.0)
        out[s] = openai_logprobs(port, prompts, conc, args.acc_tokens)
        hit[s] = (scrape(port).get("graphgen_prefix_cache_hit_tokens_total", 0.0) - before) / (len(prompts) * args.acc_len)
    res = {"prompts": len(prompts), **_compare(out["sync"], out["async"]), "prompt_len": args.acc_len,
           "tokens": args.acc_tokens, "concurrency": conc, "hit": hit, "control": _compare(out["sync"], out["sync2"])}
    c = res["control"]
    log(f"[{name}] accuracy: {res['identical']}/{len(prompts)} greedy sequences identical sync vs async, max |d logprob| "
        f"{res['max_logprob_diff']:.3g} over {res['positions']} positions; control sync vs sync: {c['identical']}/"
        f"{len(prompts)}, {c['max_logprob_diff']:.3g} over {c['positions']}")
    return res


# -- 2P1D ---------------------------------------------------------------------------------------------------
def run_pd(g: Group, args, spec_file, ckpt, flags, common, faults, clients, n, gen: Prompts, log) -> dict:
    """2P1D (two prefill instances, one decode, Mooncake, graphgen route) per setting: P's write is the
    setting, D's async in both (bench_pd's rule); one cluster per (round, setting), order alternated."""
    ttft = {s: [] for s in g.settings}
    tmp = Path(tempfile.mkdtemp(prefix="bench_seed_pd."))
    serve = [f"--serve-arg={a}" for a in [*common, *flags, "--granularity", "forward", "--faults", faults]]
    for rnd in range(args.rounds):
        prompts = gen.take(clients, n)
        pfile = tmp / f"prompts{rnd}.json"
        pfile.write_text(json.dumps(prompts))
        order = list(g.settings) if rnd % 2 == 0 else list(reversed(g.settings))
        for s in order:
            out, logs = tmp / f"{rnd}.{s}.json", tmp / f"logs.{rnd}.{s}"
            then = [sys.executable, __file__, "--pd-load", "--out", str(out), "--prompts-file", str(pfile),
                    "--pd-clients", str(clients), "--max-tokens", str(args.max_tokens), "--budget", str(args.budget),
                    "--model", MODEL["name"]]
            cmd = [sys.executable, str(REPO / "scripts" / "pd_cluster.py"), "--spec", spec_file, "--weights", ckpt,
                   "--prefill", "2", "--decode", "1", "--write", s, "--decode-write", "async", "--router-port", "0",
                   "--store-port", str(50400 + rnd), "--segment", "2GiB", "--log-dir", str(logs), *serve,
                   "--then", *then]
            t = time.perf_counter()
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
            if proc.returncode != 0 or not out.exists():
                for f in sorted(glob.glob(str(logs / "*.log"))):
                    sentence, is_refusal = refusal_sentence(Path(f).read_text(errors="replace"))
                    if is_refusal:  # an instance refused its flags: the layout is refused
                        raise ServerRefused(f"2P1D {s}", sentence)
                raise RuntimeError(f"pd_cluster exited {proc.returncode}: {proc.stderr[-2000:]}")
            got = json.loads(out.read_text())
            if got["errors"]:
                raise RuntimeError(f"{g.name}/{s}: {len(got['errors'])} requests failed: {got['errors'][:2]}")
            ttft[s] += got["ttft"]
            log(f"[{g.name}] round {rnd + 1}/{args.rounds} 2P1D {s}: TTFT p50 {_pct(got['ttft'], 50):.0f} ms, "
                f"p90 {_pct(got['ttft'], 90):.0f} ms, {len(got['ttft'])} requests ({time.perf_counter() - t:.0f} s "
                f"with the cluster's start)")
    return {"ttft": ttft}


def pd_load(args) -> int:
    """(inside pd_cluster's namespace) warm halves, then the full prompts through the router; a JSON of TTFTs."""
    MODEL["name"] = args.model
    port = urlsplit(os.environ["ROUTER_URL"]).port
    prompts = json.loads(Path(args.prompts_file).read_text())
    m = measure(port, prompts, args.pd_clients, args.max_tokens, True, args.budget, drain=False)
    Path(args.out).write_text(json.dumps(m))
    return 0


# -- the table ----------------------------------------------------------------------------------------------
def _ratio_text(ttft: dict, a: str, b: str) -> str:
    pa, pb = _pct(ttft[a], 50), _pct(ttft[b], 50)
    qa, qb = _pct(ttft[a], 90), _pct(ttft[b], 90)
    return f"{(pa / pb - 1) * 100:+.1f}% (p90 {(qa / qb - 1) * 100:+.1f}%)"


def table(results: dict, rows) -> list[str]:
    lines = ["| # | model | kind | the seed's configuration | ours: command-line configuration | seed | ours: "
             "TTFT median / p90 ms (or accuracy) | the seed's remark | ours, measured side by side |",
             "|---|---|---|---|---|---|---|---|---|"]
    groups = {g.name: g for g in GROUPS}
    for row in rows:
        g, res = groups[row.group], results[row.group]
        entries = []  # (our configuration, ours, our ratios)
        if res.get("refused"):
            entries.append((layout_text(g, g.flags, row.setting, res), res["refused"], "–"))
            if g.nearest is not None:
                label = f"*nearest runnable, not the seed's configuration* ({g.nearest_why}): "
                cfg = label + layout_text(g, g.nearest, row.setting, res)
                entries.append((cfg, *((res["nearest_refused"], "–") if res.get("nearest_refused")
                                       else _ours(row, res))))
        else:
            entries.append((layout_text(g, g.flags, row.setting, res), *_ours(row, res)))
        for i, (cfg, ours, ratios) in enumerate(entries):
            first = i == 0
            lines.append(f"| {row.n if first else ''} | {row.model if first else ''} | {row.kind if first else ''} | "
                         f"{row.config if first else '(the same row)'} | {cfg} | {row.figure if first else ''} | "
                         f"{ours} | {row.remark if first else ''} | {ratios} |")
    return lines


def layout_text(g: Group, flags, setting: str, res: dict) -> str:
    lay = " ".join(flags) if flags else "one rank"
    if g.pd:
        return (f"`scripts/pd_cluster.py --prefill 2 --decode 1 --write {setting} --decode-write async`, instances "
                f"`{lay}`; {res['clients']} clients, {res['prompt_len']}-token prompts")
    return f"`serve {lay + ' ' if flags else ''}--write {setting}`{'' if flags else ' (one rank)'}"


def _ours(row: SeedRow, res: dict) -> tuple[str, str]:
    if res.get("failed"):
        return f"**failed in this run**: {res['failed']}", "–"
    if row.kind == "accuracy":
        a = res.get("accuracy")
        if not a:
            return "not measured (row not selected)", "–"
        ours = (f"sync vs async write: **{a['identical']}/{a['prompts']}** greedy sequences identical "
                f"({a['tokens']} tokens each, {a['prompt_len']}-token prompts, pool hit sync {a['hit']['sync']:.0%} / async "
                f"{a['hit']['async']:.0%}, {a['concurrency']} concurrent), max abs logprob difference **{a['max_logprob_diff']:.2g}** over {a['positions']} "
                f"positions" + (f" (first divergences at tokens {a['first_divergence']})" if a["first_divergence"]
                                else "") + f"; control, the same prompts through a second sync server: "
                f"{a['control']['identical']}/{a['prompts']} identical, max abs logprob difference "
                f"{a['control']['max_logprob_diff']:.2g} over {a['control']['positions']} positions"
                + (f" (first divergences at tokens {a['control']['first_divergence']})"
                   if a["control"]["first_divergence"] else "") + "; lm-eval: not run (note a)")
        c = a["control"]
        return ours, (f"sync vs async {a['identical']}/{a['prompts']} identical (max diff {a['max_logprob_diff']:.2g}) "
                      f"beside sync vs sync {c['identical']}/{a['prompts']} ({c['max_logprob_diff']:.2g})")
    t = res["ttft"][row.setting]
    ours = (f"**{_pct(t, 50):.0f}** / {_pct(t, 90):.0f} ({len(t)} requests at {res['clients']} client(s), "
            f"{res['prompt_len']} tokens")
    if "hit" in res:
        ours += f", pool hit {res['hit'][row.setting]:.0%}"
    ours += ")"
    ratios = "; ".join(f"{lbl} {_ratio_text(res['ttft'], a, b)}" for lbl, a, b in row.ratios) or "–"
    return ours, ratios


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="clients 1/4/8 instead of 1/32/64, fewer prompts")
    ap.add_argument("--rows", default="", help="seed rows to run, e.g. 1 or 3-5,11 (default: all; a row runs its "
                                                "whole group)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per group (default 1)")
    ap.add_argument("--requests-1", type=int, default=None, help="requests per round at 1 client (default 8; quick 2)")
    ap.add_argument("--calib", type=int, default=None, help="calibration requests per write mode (default 3; quick 1)")
    ap.add_argument("--max-tokens", type=int, default=8, help="new tokens per measured request")
    ap.add_argument("--acc-prompts", type=int, default=None, help="accuracy prompts (default 64; quick 8)")
    ap.add_argument("--acc-len", type=int, default=None, help="accuracy prompt tokens (default 1024; quick 512)")
    ap.add_argument("--acc-tokens", type=int, default=16, help="accuracy greedy tokens per prompt")
    ap.add_argument("--prompt-scale", type=float, default=1.0,
                    help="scale the seed's 8k/16k prompt lengths (1: the seed's; for a smoke run only)")
    ap.add_argument("--budget", type=float, default=3600.0, help="time bound of one load run (s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write every TTFT and setting here")
    ap.add_argument("--pd-load", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prompts-file", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--pd-clients", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--model", default="model", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.pd_load:
        return pd_load(args)
    q = args.quick
    args.rounds = args.rounds or 1
    args.requests_1 = args.requests_1 or (2 if q else 8)
    args.calib = args.calib or (1 if q else 3)
    args.acc_prompts = args.acc_prompts or (8 if q else 64)
    args.acc_len = args.acc_len or (512 if q else 1024)
    args.clients_map = {1: 1, 32: 4, 64: 8} if q else {1: 1, 32: 32, 64: 64}
    args.prompt_map = {k: max(BLOCK_SIZE * 2, int(k * args.prompt_scale) // BLOCK_SIZE * BLOCK_SIZE)
                       for k in (8192, 16384)}
    wanted = set()
    for part in filter(None, args.rows.split(",")):
        lo, _, hi = part.partition("-")
        wanted.update(range(int(lo), int(hi or lo) + 1))
    rows = [r for r in SEED if not wanted or r.n in wanted]
    if not rows:
        ap.error(f"--rows {args.rows}: no such row (the seed's table has rows 1-{len(SEED)})")
    groups = [g for g in GROUPS if any(r.group == g.name for r in rows)]

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    t_all = time.perf_counter()
    start_up = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    tmp = Path(tempfile.mkdtemp(prefix="bench_seed_table."))
    from graphgen.modelspec.loader import load_spec
    from graphgen.runtime.checkpoint.hf import write_random_hf_checkpoint

    specs, ckpts = {}, {}
    for fam in sorted({g.family for g in groups}):
        specs[fam] = bench_spec_file(fam, tmp)
        spec = load_spec(specs[fam])
        ckpts[fam] = str(write_random_hf_checkpoint(tmp / f"ckpt_{fam}", spec.family, dataclasses.asdict(spec.dims),
                                                    seed=0))
    results = {}
    for g in groups:
        t = time.perf_counter()
        results[g.name] = run_group(g, args, ckpts, specs, rows, log)
        results[g.name]["wall_s"] = time.perf_counter() - t
        log(f"[{g.name}] done in {results[g.name]['wall_s']:.0f} s")
        if args.json:  # after every group: a run cut short keeps what it measured (--render prints it)
            Path(args.json).write_text(json.dumps({"stamp": stamp, "uptime": [start_up], "partial": True,
                                                   "results": results}, indent=1, default=str) + "\n")
    end_up = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    wall = time.perf_counter() - t_all
    print(f"# bench_seed_table — {stamp}, {wall / 60:.1f} min")
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"uptime before: {start_up}")
    print(f"uptime after:  {end_up}")
    print(f"models: tiny Qwen3 (2 layers, hidden 64, 4/2 heads x 16, vocab 256) and tiny DeepSeek-V3 (3 layers, "
          f"MoE 8 experts top-2, MLA kv_lora 16 + rope 8, hidden 64, vocab 256), random weights, block size "
          f"{BLOCK_SIZE}, {KV_DTYPE} KV; every server: graphgen serve --granularity forward --torch-threads 1 "
          f"(async scheduling on), --max-num-batched-tokens = half the prompt; {args.rounds} round(s); clients "
          f"{args.clients_map[1]}/{args.clients_map[32]}/{args.clients_map[64]} for the seed's 1/32/64; prompts "
          f"{args.prompt_map[8192]}/{args.prompt_map[16384]} tokens for the seed's 8k/16k; {args.max_tokens} new "
          f"tokens; the openai client, streaming")
    print("save: r = S/C from the seed's 1-concurrent sync/async pair (DeepSeek-V3.1 1135.4/1087.8-1 = "
          f"{SAVE_RATIO['deepseek']:.2%}, Qwen3-32B 1159.8/1098.3-1 = {SAVE_RATIO['qwen']:.2%}); per group "
          "--faults save_delay = r x C0 / layers, C0 = the 1-client async TTFT at a 50% hit with no injected delay:")
    for name, res in results.items():
        if "c0_ms" in res:
            print(f"  {name}: layout {' '.join(res['layout']) or 'one rank'}{' (nearest runnable)' if res['nearest'] else ''}: "
                  f"C0 {res['c0_ms']:.0f} ms (sync, real save only: {res['c0_sync_ms']:.0f} ms, "
                  f"{res['c0_sync_ms'] / res['c0_ms']:.2f}x), {res['faults']} ({res['save_delay_s'] * 1e3:.2f} ms per "
                  f"layer save, {res['save_ratio'] * res['c0_ms']:.0f} ms per prefill step); "
                  + ", ".join(f"{s} forward per step {m['forward_ms']:.0f} ms" for s, m in res.get("metrics", {}).items()
                              if m["forward_ms"] == m["forward_ms"])  # nan: the ranks' server exports no step times
                  + f"; {res['wall_s']:.0f} s")
    print()
    print("\n".join(table(results, rows)))
    if any(r.kind == "accuracy" for r in rows):
        print(f"\n(a) {LM_EVAL_WHY}.")
    if args.json:
        Path(args.json).write_text(json.dumps({"stamp": stamp, "uptime": [start_up, end_up], "wall_s": wall,
                                               "results": results}, indent=1, default=str) + "\n")
    bad = [n for n, r in results.items() for rc in r.get("exit_codes", {}).values() if rc != 0]
    if bad:
        print(f"servers of {bad} did not exit 0", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
