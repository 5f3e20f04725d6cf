"""The composition matrix's vocabulary: the features, a launch as the refusals read it, a cell (one row of the
table, `graphgen.composition.table`). Torch-free, and free of the rest of graphgen."""

from __future__ import annotations

import string
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Optional

TARGETS: tuple[str, ...] = ("cpu", "npu")
BOTH = TARGETS
CPU = ("cpu",)
NPU = ("npu",)
CHECKS = ("spec", "launch", "request")


@dataclass(frozen=True)
class Feature:
    """One feature of a launch: its name in the table, a short column label, and how a user turns it on."""
    name: str
    label: str
    how: str


FEATURES: tuple[Feature, ...] = (
    Feature("async_write", "aw", "`--write async` (`pool.write: async`): the save on the save stream"),
    Feature("async_scheduling", "as", "`--async-scheduling` (serve's default): the next step scheduled while one runs"),
    Feature("prefix_cache", "pc", "a prompt whose leading blocks are in the pool (`features: [prefix_cache]`, a "
                                  "write mode other than off): the `splitfuse` variant loads them"),
    Feature("chunked", "ch", "`--chunked-prefill` (the default): a prompt longer than `--max-num-batched-tokens` "
                             "runs in chunks (SplitFuse)"),
    Feature("mtp", "mtp", "`--speculative mtp` on a spec with an `mtp:` section (DeepSeek-V3)"),
    Feature("cp", "cp", "`--cp 2` (`parallel.cp`): context parallel, a prefill split head-tail over the CP ranks"),
    Feature("sp", "sp", "`--sp` with `--tp 2` or more (`parallel.sp`): sequence parallel inside the TP group"),
    Feature("dp", "dp", "`--dp 2` (`parallel.dp`): data-parallel attention groups (DeepSeek: ep = dp x tp)"),
    Feature("tp", "tp", "`--tp 2` (`parallel.tp`): tensor parallel"),
    Feature("ep", "ep", "`--ep 2` with `--tp 2` (`parallel.ep`): expert parallel over the TP ranks (DeepSeek)"),
    Feature("pd", "pd", "`serve --role prefill|decode` (docs/pd.md): the KV handed off through a shared pool"),
    Feature("mooncake", "mc", "`--pool mooncake://HOST:PORT`: Mooncake Store as the pool"),
    Feature("nodes", "nn", "`--nnodes 2`: the ranks of one layout on two nodes (the host pool on node 0)"),
    Feature("w8a8", "w8", "`quantization: {method: w8a8_dynamic}`: int8 weights and activations"),
    Feature("lora", "lo", "`--lora-modules NAME=PATH` (a `lora:` section): per-request adapters"),
    Feature("tools", "tr", "`--tool-call-parser`, `--reasoning-parser` (`features: [function_call, "
                           "reasoning_parser]`): tool calls and reasoning parsed out of chat output"),
    Feature("structured", "so", "a request's `response_format` (json_schema, regex, grammar): output masked by "
                                "llguidance"),
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
    pool: Optional[str] = None  # "host" (the embedded pool), a mooncake:// URL; None: not known here
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
              "pd": self.role != "both", "mooncake": (self.pool or "").startswith("mooncake://"), "nodes": self.nnodes > 1,
              "w8a8": self.w8a8, "lora": self.lora, "tools": self.tools, "structured": self.structured}
        return frozenset(k for k, v in on.items() if v)

    def values(self) -> dict[str, Any]:
        """The fields a sentence template may name (``{tp}``, ``{role}``, ``{ranks}``...)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out.update(world=self.world, ranks=self.ranks, write=self.write or "off", pool=self.pool or "host")
        return out


EXAMPLE_POOL = "mooncake://127.0.0.1:50051"  # an example's Mooncake pool (the refusals never connect to it)


def example_launch(features: tuple[str, ...], target: str = "cpu", extra: tuple[tuple[str, Any], ...] = ()
                   ) -> Launch:
    """The smallest launch with ``features`` on, then ``extra`` (`Launch` fields), on a DeepSeek-V3 spec: tp 2
    where sp, ep or a second node needs ranks; a P/D role on Mooncake with a write mode; under DP attention the
    experts over every group (ep = dp x tp)."""
    on = set(features)
    got: dict[str, Any] = {"target": target}
    flags = {"async_scheduling": "async_scheduling", "prefix_cache": "prefix_cache", "chunked": "chunked",
             "w8a8": "w8a8", "lora": "lora", "tools": "tools", "structured": "structured", "sp": "sp"}
    got.update({field_: True for name, field_ in flags.items() if name in on})
    if "async_write" in on:
        got["write"] = "async"
    if "mtp" in on:
        got.update(mtp=True, speculative=True)
    got.update({name: 2 for name in ("cp", "dp") if name in on})
    if on & {"tp", "sp", "ep", "nodes"}:
        got["tp"] = 2
    if "pd" in on:
        got["role"] = "prefill"
    if on & {"mooncake", "pd"}:
        got["pool"] = EXAMPLE_POOL
    if "nodes" in on:
        got["nnodes"] = 2
    got.update(extra)
    if got.get("write") is None and (got.get("prefix_cache") or got.get("role", "both") != "both"):
        got["write"] = "sync"
    launch = Launch(**got)
    if launch.dp > 1 or "ep" in on:
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
    off: str = ""
    check: str = ""
    path: str = ""
    fix: str = ""
    when: Optional[Callable[[Launch], bool]] = field(default=None, compare=False)
    example: tuple[tuple[str, Any], ...] = ()
    note: str = ""

    @property
    def is_refused(self) -> bool:
        return bool(self.refused)

    @property
    def is_off(self) -> bool:
        return bool(self.off)

    def applies(self, launch: Launch) -> bool:
        """Whether this refusal refuses ``launch`` (a turned-off row: whether the launch runs without the feature)."""
        if not (self.is_refused or self.is_off) or launch.target not in self.targets:
            return False
        if self.when is not None:
            return self.when(launch)
        return set(self.features) <= launch.features

    def sentence(self, launch: Launch) -> str:
        """The refusal as the launch prints it (a spec rule: ``path: message (fix: ...)``, as the rank bring-up
        and the loader render it)."""
        v = launch.values()
        msg = (self.refused or self.off).format(**v)
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


def turned_off(features: tuple[str, ...], targets: tuple[str, ...], sentence: str, *,
               when: Optional[Callable[[Launch], bool]] = None) -> Cell:
    """A combination that starts but runs without one of its features (``sentence`` says which and why; run and
    serve print it as a note): neither runs as asked nor refused, and never silent."""
    return Cell(tuple(features), targets, off=sentence, check="launch", when=when)


def _key(features: tuple[str, ...]) -> tuple[str, ...]:
    """A combination in `FEATURES` order (two rows of the same features compare equal)."""
    return tuple(sorted(features, key=FEATURE_NAMES.index))


def _template_fields(text: str) -> list[str]:
    return [f for _, f, _, _ in string.Formatter().parse(text) if f]


def _check_cell(c: Cell) -> None:
    """One row's own consistency (AssertionError naming the row)."""
    where = f"composition cell {c.features} on {c.targets}"
    assert c.features and all(f in _FEATURE for f in c.features), f"{where}: unknown feature"
    assert len(set(c.features)) == len(c.features), f"{where}: a feature twice"
    assert c.targets and set(c.targets) <= set(TARGETS), f"{where}: unknown target"
    assert sum(map(bool, (c.runs, c.refused, c.off))) == 1, \
        f"{where}: a cell either runs (a test), is refused or turned off (a sentence)"
    if c.is_refused or c.is_off:
        assert c.check in CHECKS, f"{where}: check must be one of {CHECKS}"
        assert (c.check == "spec") == bool(c.path and c.fix), f"{where}: a spec rule (only) has a path and a fix"
        known = set(Launch().values())
        for text in (c.refused or c.off, c.fix):
            bad = set(_template_fields(text)) - known
            assert not bad, f"{where}: the sentence names {sorted(bad)}, not Launch fields"
    else:
        assert "::test_" in c.runs and c.runs.startswith("tests/"), f"{where}: runs names tests/<file>.py::test_..."
