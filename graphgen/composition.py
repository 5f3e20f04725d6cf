"""The composition matrix: which features run together on which target, and the one table of refusals.

A *feature* (`FEATURES`) is one thing a launch can turn on: async write, async scheduling, a prefix-cache hit,
chunked prefill, MTP, each parallel dimension, a P/D role, the Mooncake pool, several nodes, W8A8, LoRA,
tool/reasoning parsing, structured output. A *cell* (`Cell`, one frozen row of `CELLS`) is one combination of
them (one to three features) on one or both targets, and says either

- **runs**: the pytest node id of a test that runs the combination on tiny specs and compares its tokens to the
  one-rank / feature-off reference, or
- **refused**: the sentence a launch of it is refused with, and who refuses it: ``spec`` (the spec rules:
  `graphgen validate`, the loader's ``file:line`` errors, and every launch, since a ``--tp``/``--cp`` flag
  bypasses the loader), ``launch`` (``graphgen run``/``serve`` and `open_engine`, before any weight loads) or
  ``request`` (one request, a 400 on the server).

The refused cells *are* the refusal table: `launch_refusal` (run, serve, `open_engine`, the rank bring-up) and
`spec_rules` (the spec loader, `families.parallel.parallel_rules`) read them, and nothing else refuses a
combination of these features. Lifting a refusal is a change of its row here (``refused(...)`` →
``runs(..., "tests/...::test_x")``) plus the runtime's code; ``graphgen generate`` renders the table into
``docs/composition.md`` and ``graphgen check`` fails while that file is stale. A combination with no row is
*untested*: every check accepts it and no test runs it (the doc lists them; nothing claims they work).

Torch-free and import-free of the rest of graphgen (the build path renders it; every runtime asks it).
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Iterator, Optional

TARGETS: tuple[str, ...] = ("cpu", "npu")
BOTH = TARGETS
CPU = ("cpu",)
NPU = ("npu",)
CHECKS = ("spec", "launch", "request")


@dataclass(frozen=True)
class Feature:
    """One feature of a launch: its name in the table, a short column label, how a user turns it on, and the
    smallest launch that has it (`Launch` fields; ``sp`` needs ``tp: 2``, a P/D role a shared pool...)."""
    name: str
    label: str
    how: str
    example: tuple[tuple[str, Any], ...]


FEATURES: tuple[Feature, ...] = (
    Feature("async_write", "aw", "`--write async` (`pool.write: async`): the save on the save stream",
            (("write", "async"),)),
    Feature("async_scheduling", "as", "`--async-scheduling` (serve's default): the next step scheduled while one runs",
            (("async_scheduling", True),)),
    Feature("prefix_cache", "pc", "a prompt whose leading blocks are in the pool (`features: [prefix_cache]`, a "
                                  "write mode other than off): the `splitfuse` variant loads them",
            (("prefix_cache", True), ("write", "sync"))),
    Feature("chunked", "ch", "`--chunked-prefill` (the default): a prompt longer than `--max-num-batched-tokens` "
                             "runs in chunks (SplitFuse)", (("chunked", True),)),
    Feature("mtp", "mtp", "`--speculative mtp` on a spec with an `mtp:` section (DeepSeek-V3)",
            (("mtp", True), ("speculative", True))),
    Feature("cp", "cp", "`--cp 2` (`parallel.cp`): context parallel, a prefill split head-tail over the CP ranks",
            (("cp", 2),)),
    Feature("sp", "sp", "`--sp` with `--tp 2` or more (`parallel.sp`): sequence parallel inside the TP group",
            (("sp", True), ("tp", 2))),
    Feature("dp", "dp", "`--dp 2` (`parallel.dp`): data-parallel attention groups (DeepSeek: ep = dp x tp)",
            (("dp", 2),)),
    Feature("tp", "tp", "`--tp 2` (`parallel.tp`): tensor parallel", (("tp", 2),)),
    Feature("ep", "ep", "`--ep 2` with `--tp 2` (`parallel.ep`): expert parallel over the TP ranks (DeepSeek)",
            (("ep", 2), ("tp", 2))),
    Feature("pd", "pd", "`serve --role prefill|decode` (docs/pd.md): the KV handed off through a shared pool",
            (("role", "prefill"), ("pool", "mooncake://127.0.0.1:50051"), ("write", "async"))),
    Feature("mooncake", "mc", "`--pool mooncake://HOST:PORT`: Mooncake Store as the pool",
            (("pool", "mooncake://127.0.0.1:50051"),)),
    Feature("nodes", "nn", "`--nnodes 2`: the ranks of one layout on two nodes (the host pool on node 0)",
            (("nnodes", 2), ("tp", 2), ("pool", "host"))),
    Feature("w8a8", "w8", "`quantization: {method: w8a8_dynamic}`: int8 weights and activations",
            (("w8a8", True),)),
    Feature("lora", "lo", "`--lora-modules NAME=PATH` (a `lora:` section): per-request adapters",
            (("lora", True),)),
    Feature("tools", "tr", "`--tool-call-parser`, `--reasoning-parser` (`features: [function_call, "
                           "reasoning_parser]`): tool calls and reasoning parsed out of chat output",
            (("tools", True),)),
    Feature("structured", "so", "a request's `response_format` (json_schema, regex, grammar): output masked by "
                                "llguidance", (("structured", True),)),
)
FEATURE_NAMES: tuple[str, ...] = tuple(f.name for f in FEATURES)
_FEATURE = {f.name: f for f in FEATURES}


@dataclass(frozen=True)
class Launch:
    """What the refusals read of a launch. A caller fills what it knows; a field left at its default is "not
    set" (``write`` None: not known here, so no write-mode rule fires). ``mtp``: the spec has MTP layers;
    ``speculative``: it decodes with them (``--speculative mtp``)."""
    tp: int = 1
    ep: int = 1
    dp: int = 1
    cp: int = 1
    sp: bool = False
    target: str = "cpu"
    mtp: bool = False
    speculative: bool = False
    write: Optional[str] = None
    role: str = "both"
    pool: str = "host"
    nnodes: int = 1
    prefix_cache: bool = False
    chunked: bool = False
    async_scheduling: bool = False
    w8a8: bool = False
    lora: bool = False
    tools: bool = False
    structured: bool = False

    @classmethod
    def of(cls, par: Any, target: str = "cpu", **known: Any) -> "Launch":
        """A launch of the layout ``par`` (a `graphgen.modelspec.model.Parallel`) on ``target``."""
        return cls(tp=par.tp, ep=par.ep, dp=par.dp, cp=par.cp, sp=par.sp, target=target, **known)

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp

    @property
    def ranks(self) -> int:
        """The rank processes one instance starts, as ``serve`` counts them (max(tp, ep) x cp)."""
        return max(self.tp, self.ep) * self.cp

    @property
    def features(self) -> frozenset[str]:
        """The features this launch turns on."""
        on = {"async_write": self.write == "async", "async_scheduling": self.async_scheduling,
              "prefix_cache": self.prefix_cache, "chunked": self.chunked, "mtp": self.mtp and self.speculative,
              "cp": self.cp > 1, "sp": self.sp, "dp": self.dp > 1, "tp": self.tp > 1, "ep": self.ep > 1,
              "pd": self.role != "both", "mooncake": self.pool.startswith("mooncake://"), "nodes": self.nnodes > 1,
              "w8a8": self.w8a8, "lora": self.lora, "tools": self.tools, "structured": self.structured}
        return frozenset(k for k, v in on.items() if v)

    def values(self) -> dict[str, Any]:
        """The fields a sentence template may name (``{tp}``, ``{role}``, ``{ranks}``...)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out.update(world=self.world, ranks=self.ranks, write=self.write or "off")
        return out


def example_launch(features: tuple[str, ...], target: str = "cpu", extra: tuple[tuple[str, Any], ...] = ()
                   ) -> Launch:
    """The smallest launch with ``features`` on (each feature's example, then ``extra``) on a DeepSeek-V3 spec:
    under DP attention its experts span every group, so ep = dp x tp."""
    got: dict[str, Any] = {"target": target}
    for name in features:
        got.update(_FEATURE[name].example)
    got.update(extra)
    launch = Launch(**got)
    if launch.dp > 1:
        launch = replace(launch, ep=launch.dp * launch.tp)
    return launch


@dataclass(frozen=True)
class Cell:
    """One combination of features on ``targets``: it runs (``runs``: the test that runs it and compares its
    tokens to the reference) or is refused (``refused``: the sentence, a `str.format` template over
    `Launch.values`; ``check`` says who refuses it; a spec rule's ``path`` and ``fix`` go with it). ``when``
    says exactly when a refusal applies (default: every feature of the cell is on); ``example`` are the
    `Launch` fields its test sets beyond the features' own examples; ``seed``: the seed lists this combination."""
    features: tuple[str, ...]
    targets: tuple[str, ...]
    runs: str = ""
    refused: str = ""
    check: str = ""
    path: str = ""
    fix: str = ""
    when: Optional[Callable[[Launch], bool]] = field(default=None, compare=False)
    example: tuple[tuple[str, Any], ...] = ()
    note: str = ""

    @property
    def is_refused(self) -> bool:
        return bool(self.refused)

    def applies(self, launch: Launch) -> bool:
        """Whether this refusal refuses ``launch``."""
        if not self.is_refused or launch.target not in self.targets:
            return False
        if self.when is not None:
            return self.when(launch)
        return set(self.features) <= launch.features

    def sentence(self, launch: Launch) -> str:
        """The refusal as the launch prints it (a spec rule: ``path: message (fix: ...)``, as the rank bring-up
        and the loader render it)."""
        v = launch.values()
        msg = self.refused.format(**v)
        return f"{self.path}: {msg} (fix: {self.fix.format(**v)})" if self.check == "spec" else msg

    def rule(self, launch: Launch) -> tuple[str, str, str]:
        """A spec rule's ``(path, message, fix)`` for ``launch`` (the loader adds the file and line)."""
        v = launch.values()
        return self.path, self.refused.format(**v), self.fix.format(**v)

    def launch(self, target: str) -> Launch:
        """The launch this cell's test makes (`example_launch` of its features, plus ``example``)."""
        return example_launch(self.features, target, self.example)


def runs(features: tuple[str, ...], targets: tuple[str, ...], test: str, note: str = "") -> Cell:
    """A combination that runs: ``test`` (``tests/<file>.py::<name>[<param>]``) runs it on tiny specs."""
    return Cell(tuple(features), targets, runs=test, note=note)


def refused(features: tuple[str, ...], targets: tuple[str, ...], sentence: str, check: str = "launch", *,
            path: str = "", fix: str = "", when: Optional[Callable[[Launch], bool]] = None,
            example: tuple[tuple[str, Any], ...] = ()) -> Cell:
    """A combination refused with ``sentence`` by ``check`` (module doc)."""
    return Cell(tuple(features), targets, refused=sentence, check=check, path=path, fix=fix, when=when,
                example=example)


# ---------------------------------------------------------------------------------------------- the sentences
# Shared by several cells (one sentence, several pairs): lift them together or split the sentence.
SPECULATIVE_ONE_RANK = ("--speculative mtp runs with one rank only so far: the rank runners do not run the drafter's "
                        "steps (docs/mtp.md); run with --tp 1 --ep 1")
MTP_LAYERS_ONE_RANK = ("a spec with MTP layers runs on one rank only so far: its graphs shard the MTP layer like a "
                       "decoder layer (graphgen generate, validate and dry-run take the layout), but the rank runners "
                       "do not load or run it yet (docs/mtp.md); run with --tp 1 --ep 1")
PD_SHARED_POOL = ("--role {role} hands the KV over through a shared pool: it needs --pool mooncake://HOST:PORT (not "
                  "host), a --write other than off, and dp 1 (tp/cp ranks hand off every rank's shard; DP groups do "
                  "not yet) (got --pool {pool}, write {write}, {ranks} rank(s), dp {dp})")
LORA_RANKS = "LoRA adapters are not split over parallel ranks yet (docs/lora.md)"
LORA_RANKS_FIX = "remove the lora: section, or use a parallel layout of one rank"
MTP_SPLIT = "{0} ({{{0}}}) with MTP is not implemented (the MTP layer's draft tokens would need the same split)"


def _spec_with_mtp(name: str) -> Callable[[Launch], bool]:
    return lambda x: x.mtp and getattr(x, name) > 1


# ------------------------------------------------------------------------------------------------- the table
# Order matters only among refusals: the first that applies is the one a launch prints (launch checks before
# spec rules, as before the table: the NPU target's gaps, then the rank runners', then the roles').
CELLS: tuple[Cell, ...] = (
    # --- refused at launch: what only the NPU target lacks (the CPU ranks run it)
    refused(("cp",), NPU, "context parallel (cp > 1) has no NPU lowering yet (the head-tail split and the per-layer "
                          "KV all-gather run on the CPU ranks only); use --target cpu, or run with --cp 1"),
    refused(("sp",), NPU, "sequence parallel (sp) does not run on the NPU target yet (its graphs are lowered, but the "
                          "NPU runner does not pad a step's tokens to a multiple of tp); use --target cpu, or run with "
                          "--no-sp"),
    # --- refused at launch: MTP on the rank runners
    refused(("mtp", "tp"), BOTH, SPECULATIVE_ONE_RANK, when=lambda x: x.speculative and x.tp > 1),
    refused(("mtp", "ep"), BOTH, SPECULATIVE_ONE_RANK, when=lambda x: x.speculative and x.ep > 1),
    refused(("mtp", "dp"), BOTH, SPECULATIVE_ONE_RANK, when=lambda x: x.speculative and x.dp > 1),
    refused(("mtp", "cp"), BOTH, SPECULATIVE_ONE_RANK, when=lambda x: x.speculative and x.cp > 1),
    refused(("mtp", "sp"), BOTH, SPECULATIVE_ONE_RANK, when=lambda x: x.speculative and x.sp and x.world > 1),
    refused(("mtp", "tp"), BOTH, MTP_LAYERS_ONE_RANK, when=lambda x: x.mtp and x.tp > 1,
            example=(("speculative", False),)),
    refused(("mtp", "ep"), BOTH, MTP_LAYERS_ONE_RANK, when=lambda x: x.mtp and x.ep > 1,
            example=(("speculative", False),)),
    # --- refused at launch: P/D roles (serve --role)
    refused(("mtp", "pd"), BOTH, "--speculative mtp does not combine with --role {role} yet (docs/mtp.md)",
            when=lambda x: x.speculative and x.role != "both"),
    refused(("pd",), BOTH, PD_SHARED_POOL, when=lambda x: x.role != "both" and (
        x.write == "off" or x.pool == "host"), example=(("pool", "host"),)),
    refused(("pd", "dp"), BOTH, PD_SHARED_POOL, when=lambda x: x.role != "both" and x.dp > 1),
    # --- refused by the spec rules (graphgen validate; every launch, whose flags bypass the loader)
    refused(("sp", "dp"), BOTH, "sp: true with dp ({dp}) > 1 is not implemented (the MoE's DP all-gather would need "
                                "the tokens gathered over the TP group first)", "spec",
            path="parallel.sp", fix="set sp: false, or dp: 1"),
    refused(("cp", "dp"), BOTH, "cp ({cp}) with dp ({dp}) is not implemented (both would split the MoE's tokens; no "
                                "rank order for it is defined)", "spec", path="parallel.cp", fix="set cp: 1 or dp: 1"),
    refused(("cp", "sp"), BOTH, "cp ({cp}) with sp: true is not implemented (sequence parallelism would split the "
                                "head-tail chunks again)", "spec", path="parallel.cp", fix="set sp: false, or cp: 1"),
    refused(("cp", "mtp"), BOTH, MTP_SPLIT.format("cp"), "spec", path="parallel.cp", fix="set cp: 1, or turn MTP off",
            when=_spec_with_mtp("cp")),
    refused(("dp", "mtp"), BOTH, MTP_SPLIT.format("dp"), "spec", path="parallel.dp", fix="set dp: 1, or turn MTP off",
            when=_spec_with_mtp("dp")),
    refused(("sp", "mtp"), BOTH, "sp with MTP is not implemented (the sequence-parallel pass does not split the MTP "
                                 "layer: its eh_proj would read the embedding's token shard before the all-gather)",
            "spec", path="parallel.sp", fix="set sp: false, or turn MTP off", when=lambda x: x.mtp and x.sp),
    refused(("lora", "tp"), BOTH, LORA_RANKS, "spec", path="lora", fix=LORA_RANKS_FIX),
    refused(("lora", "ep"), BOTH, LORA_RANKS, "spec", path="lora", fix=LORA_RANKS_FIX),
    refused(("lora", "sp"), BOTH, LORA_RANKS, "spec", path="lora", fix=LORA_RANKS_FIX),
    refused(("lora", "dp"), BOTH, LORA_RANKS, "spec", path="lora", fix=LORA_RANKS_FIX),
    refused(("lora", "cp"), BOTH, LORA_RANKS, "spec", path="lora", fix=LORA_RANKS_FIX),
    refused(("lora", "nodes"), BOTH, LORA_RANKS, "spec", path="lora", fix=LORA_RANKS_FIX),
    # --- refused per request (a 400 from serve)
    refused(("mtp", "structured"), BOTH, "structured output (response_format) is not supported with --speculative mtp "
                                         "(docs/mtp.md)", "request"),
)


# ------------------------------------------------------------------------------------------ asking the table
def launch_refusal(launch: Launch) -> Optional[str]:
    """The sentence refusing ``launch`` (the first refused cell that applies: launch checks, then spec rules,
    each rendered as the launch prints it), or None. Request-level cells are the engine's, per request."""
    for check in ("launch", "spec"):
        for cell in CELLS:
            if cell.check == check and cell.applies(launch):
                return cell.sentence(launch)
    return None


def spec_rules(launch: Launch) -> Iterator[tuple[str, str, str]]:
    """``(path, message, fix)`` of every spec rule refusing ``launch``'s combination (the loader and
    `families.parallel.parallel_rules`; the target is not the spec's business: rules hold on every target)."""
    seen = set()
    for cell in CELLS:
        if cell.check == "spec" and cell.applies(replace(launch, target=cell.targets[0])):
            rule = cell.rule(launch)
            if rule not in seen:  # one sentence refusing several pairs (LoRA with tp, ep and sp) is said once
                seen.add(rule)
                yield rule


def sentence_of(features: tuple[str, ...], target: str = "cpu") -> str:
    """The first refusal sentence of exactly this combination (for a check that refuses it outside a
    `Launch`, e.g. one request's fields); KeyError when the table does not refuse it."""
    for cell in CELLS:
        if cell.is_refused and cell.features == tuple(features) and target in cell.targets:
            return cell.refused
    raise KeyError(f"no refused cell {features} on {target}")


# ------------------------------------------------------------------------------------------- the markdown
def _key(features: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(sorted(features, key=FEATURE_NAMES.index))


def cells_of(features: tuple[str, ...], target: str) -> list[Cell]:
    """The rows of this combination on ``target`` (order of the table)."""
    k = _key(features)
    return [c for c in CELLS if _key(c.features) == k and target in c.targets]


def verdict(features: tuple[str, ...], target: str) -> str:
    """``runs``, ``refused`` (some launch of it is refused: a refused row exists) or ``untested``."""
    rows = cells_of(features, target)
    if any(c.is_refused for c in rows):
        return "refused"
    return "runs" if rows else "untested"


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def _template_fields(text: str) -> list[str]:
    return [f for _, f, _, _ in string.Formatter().parse(text) if f]


def markdown() -> str:
    """``docs/composition.md`` (generated: `graphgen generate` writes it, `graphgen check` compares)."""
    runs_rows = [c for c in CELLS if not c.is_refused]
    ref_rows = [c for c in CELLS if c.is_refused]
    num = {id(c): i for i, c in enumerate(runs_rows, 1)}
    num.update({id(c): i for i, c in enumerate(ref_rows, 1)})
    out = ["# The composition matrix: which features run together", "",
           "<!-- generated by `graphgen generate` from graphgen/composition.py (CELLS); `graphgen check` fails "
           "while it is stale; do not edit by hand -->", "",
           "Every cell is one combination of features on one target. **✓n** runs: test *n* of [Runs](#runs) runs "
           "it on tiny specs and compares its tokens with the one-rank (or feature-off) reference. **✗n** is "
           "refused: a launch of it stops with sentence *n* of [Refused](#refused), before anything loads (or, "
           "for a request-level cell, the request gets a 400). **·** is untested: every check accepts it and no "
           "test runs it yet — nothing here claims it works. The diagonal is a feature alone. The refused rows "
           "are the one refusal table the runtimes ask (`graphgen.composition.launch_refusal`, `spec_rules`).",
           "", "The NPU target runs here only through the CPU stand-in (`--target npu --standin`): a ✓ on the NPU "
           "grid is a wiring check on CPU, never an NPU run (docs/npu.md).", "",
           "## Features", "", "| feature | column | how it is turned on |", "|---|---|---|"]
    out += [f"| `{f.name}` | {f.label} | {_md(f.how)} |" for f in FEATURES]
    for target in TARGETS:
        title = "CPU target" if target == "cpu" else "NPU target (`--target npu --standin`; never run on an NPU)"
        out += ["", f"## {title}", "", "| | " + " | ".join(f.label for f in FEATURES) + " |",
                "|---|" + "---|" * len(FEATURES)]
        for i, a in enumerate(FEATURES):
            cells = []
            for j, b in enumerate(FEATURES):
                if j > i:
                    cells.append("")
                    continue
                combo = (a.name,) if i == j else (b.name, a.name)
                rows = cells_of(combo, target)
                bad = [c for c in rows if c.is_refused]
                if bad:
                    cells.append(" ".join(f"✗{num[id(c)]}" for c in bad))
                elif rows:
                    cells.append(" ".join(f"✓{num[id(c)]}" for c in rows))
                else:
                    cells.append("·")
            out.append(f"| **{a.label}** | " + " | ".join(cells) + " |")
        n = {v: sum(verdict(_key((a.name,) if i == j else (b.name, a.name)), target) == v
                    for i, a in enumerate(FEATURES) for j, b in enumerate(FEATURES) if j <= i)
             for v in ("runs", "refused", "untested")}
        out += ["", f"{n['runs']} run, {n['refused']} refused, {n['untested']} untested "
                f"(of {len(FEATURES) * (len(FEATURES) + 1) // 2} cells)."]
    out += ["", "## Runs", "", "| # | combination | target | test |", "|---|---|---|---|"]
    for c in runs_rows:
        note = f" ({_md(c.note)})" if c.note else ""
        out.append(f"| {num[id(c)]} | {' + '.join(c.features)} | {', '.join(c.targets)} | `{c.runs}`{note} |")
    out += ["", "## Refused", "", "Placeholders (`{tp}`, `{role}`...) are the launch's values. A spec rule prints "
            "as `path: sentence (fix: ...)`, with the spec file's line when the loader finds it.", "",
            "| # | combination | target | refused by | sentence |", "|---|---|---|---|---|"]
    for c in ref_rows:
        text = f"`{c.path}`: {c.refused} (fix: {c.fix})" if c.check == "spec" else c.refused
        out.append(f"| {num[id(c)]} | {' + '.join(c.features)} | {', '.join(c.targets)} | {c.check} | {_md(text)} |")
    out += ["", "## The seed's combinations", "",
            "What the seed (MindIE-LLM's async write, `../shared/seed/README.md`) ran together, and where each "
            "stands here.", "", "| the seed | combination | cpu | npu |", "|---|---|---|---|"]
    for s in SEED:
        out.append(f"| {_md(s.what)} | {' + '.join(s.features)} | "
                   + " | ".join(_seed_cell(s.features, t, num) for t in TARGETS) + " |")
    out += ["", "## Lifting a refusal", "",
            "In `graphgen/composition.py`, replace the cell's `refused(...)` row with `runs(features, targets, "
            "\"tests/<file>.py::<test>\")` naming the test that now runs it (tokens against the one-rank "
            "reference, margin-aware: `tests/support/tokens.py`), change the runtime's code, and run `graphgen "
            "generate`. `tests/test_composition.py` then checks that the test exists and that nothing refuses "
            "the combination any more.", ""]
    return "\n".join(out)


def _seed_cell(features: tuple[str, ...], target: str, num: dict[int, int]) -> str:
    v = verdict(features, target)
    rows = cells_of(features, target)
    if v == "refused":
        return "refused " + " ".join(f"✗{num[id(c)]}" for c in rows if c.is_refused)
    if v == "runs":
        return "runs " + " ".join(f"✓{num[id(c)]}" for c in rows)
    return "untested"


@dataclass(frozen=True)
class SeedCombo:
    """A combination the seed ran (its README's list or its results table)."""
    what: str
    features: tuple[str, ...]


SEED: tuple[SeedCombo, ...] = (
    SeedCombo("async write (DeepSeek, Qwen dense)", ("async_write",)),
    SeedCombo("async write + async scheduling", ("async_write", "async_scheduling")),
    SeedCombo("async write + prefix cache", ("async_write", "prefix_cache")),
    SeedCombo("async write + context parallel", ("async_write", "cp")),
    SeedCombo("async write + sequence parallel", ("async_write", "sp")),
    SeedCombo("async write + MTP", ("async_write", "mtp")),
    SeedCombo("async write + function call, reasoning parsing", ("async_write", "tools")),
    SeedCombo("table rows 1-5: CP/SP (DeepSeek V3.1)", ("cp", "sp")),
    SeedCombo("table rows 6-7: DP/TP (DeepSeek V3.1)", ("dp", "tp")),
    SeedCombo("table rows 8-9: 2P1D of DP/TP instances", ("pd", "dp")),
    SeedCombo("table rows 8-9: 2P1D of DP/TP instances", ("pd", "tp")),
    SeedCombo("its deployments: DeepSeek V3.1 with MTP on DP/TP", ("mtp", "dp")),
    SeedCombo("its deployments: DeepSeek V3.1 with MTP on DP/TP", ("mtp", "tp")),
    SeedCombo("its deployments: CP/SP with MTP", ("mtp", "cp")),
    SeedCombo("its deployments: CP/SP with MTP", ("mtp", "sp")),
)


def _check_table() -> None:
    """The table's own consistency (at import: a bad edit fails every command at once, with the row)."""
    for c in CELLS:
        where = f"composition cell {c.features} on {c.targets}"
        assert c.features and all(f in _FEATURE for f in c.features), f"{where}: unknown feature"
        assert len(set(c.features)) == len(c.features), f"{where}: a feature twice"
        assert c.targets and set(c.targets) <= set(TARGETS), f"{where}: unknown target"
        assert bool(c.runs) != bool(c.refused), f"{where}: a cell either runs (a test) or is refused (a sentence)"
        if c.is_refused:
            assert c.check in CHECKS, f"{where}: check must be one of {CHECKS}"
            assert (c.check == "spec") == bool(c.path and c.fix), f"{where}: a spec rule (only) has a path and a fix"
            known = set(Launch().values())
            for text in (c.refused, c.fix):
                bad = set(_template_fields(text)) - known
                assert not bad, f"{where}: the sentence names {sorted(bad)}, not Launch fields"


_check_table()
