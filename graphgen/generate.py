"""Spec files -> the files under ``generated/`` (the build path: torch-free, deterministic).

For each spec and variant: the golden graph ``<model>/<variant>.graph``, and per enabled target
``<model>/cpu/<variant>.py`` and ``<model>/npu/<mode>/<variant>.py``. Files are written atomically
(temp file + rename) and only when their bytes change; files under the output folder that no spec
produces are removed (only inside the given models' folders when specs are named explicitly).
"""

from __future__ import annotations

import difflib
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

from .ir.text import print_graph
from .lower.compile import compile_spec, display_path
from .modelspec.loader import load_specs
from .modelspec.model import ModelSpec

DEFAULT_SPEC_DIR = Path("specs")
DEFAULT_OUT = Path("generated")
IGNORED_PARTS = ("__pycache__",)


def default_spec_paths(spec_dir: Path = DEFAULT_SPEC_DIR) -> list[Path]:
    return sorted(spec_dir.glob("*.yaml"))


def spec_outputs(spec: ModelSpec, spec_file: str, *, check: bool = False) -> dict[str, str]:
    """Relative path -> file text for one spec (every variant, every enabled target).

    The one intentional difference from the runtimes' ``compile_variant``: the pass contracts run
    unchecked here (``check=False``): they triple the pipeline's time (0.2 s -> 0.8 s for the four
    specs) and the tests run them checked; the verify pass runs either way.
    """
    files: dict[str, str] = {}
    for compiled in compile_spec(spec, spec_file=spec_file, check=check):
        files.setdefault(f"{spec.name}/{compiled.variant}.graph", print_graph(compiled.graph))
        files.update(compiled.sources)
    return files


def build_outputs(spec_paths: Iterable[Path]) -> tuple[dict[str, str], list[str]]:
    """All outputs of the given specs (raises SpecError / PassError) and the model names."""
    spec_paths = list(spec_paths)
    specs = load_specs(spec_paths)
    files: dict[str, str] = {}
    for path, spec in zip(spec_paths, specs):
        files.update(spec_outputs(spec, display_path(path)))
    return files, [s.name for s in specs]


def write_atomic(path: Path, text: str) -> bool:
    """Write ``text`` to ``path`` if it differs; atomic (temp file in the same folder + rename)."""
    data = text.encode("utf-8")
    try:
        if path.read_bytes() == data:
            return False
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def existing_files(out: Path, models: Optional[list[str]] = None) -> set[str]:
    roots = [out / m for m in models] if models is not None else [out]
    found = set()
    for root in roots:
        if not root.exists():
            continue
        for p in root.rglob("*"):
            if p.is_file() and not any(part in IGNORED_PARTS for part in p.parts):
                found.add(p.relative_to(out).as_posix())
    return found


@dataclass
class Report:
    written: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)


def generate(spec_paths: Optional[Iterable[str | Path]] = None, out: Path = DEFAULT_OUT, *,
             dry_run: bool = False) -> Report:
    explicit = spec_paths is not None
    paths = [Path(p) for p in spec_paths] if spec_paths is not None else default_spec_paths()
    files, models = build_outputs(paths)  # everything is computed before anything is written
    out = Path(out)
    report = Report()
    for rel in sorted(files):
        target = out / rel
        if dry_run:
            changed = not target.exists() or target.read_bytes() != files[rel].encode("utf-8")
        else:
            changed = write_atomic(target, files[rel])
        (report.written if changed else report.unchanged).append(rel)
    for rel in sorted(existing_files(out, models if explicit else None) - set(files)):
        report.removed.append(rel)
        if not dry_run:
            (out / rel).unlink()
    if not dry_run:
        _prune_empty_dirs(out)
    return report


def _prune_empty_dirs(out: Path) -> None:
    if not out.exists():
        return
    for d in sorted((p for p in out.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        if not any(d.iterdir()):
            d.rmdir()


@dataclass
class CheckResult:
    stale: list[str] = field(default_factory=list)  # differ or missing
    orphans: list[str] = field(default_factory=list)
    diff: str = ""

    @property
    def ok(self) -> bool:
        return not self.stale and not self.orphans


def check(spec_paths: Optional[Iterable[str | Path]] = None, out: Path = DEFAULT_OUT,
          extra: Optional[dict[Path, str]] = None) -> CheckResult:
    """Compare what would be generated with what is on disk (nothing is written).

    ``extra`` maps further files (e.g. ``specs/schema.json``) to their expected text.
    """
    explicit = spec_paths is not None
    paths = [Path(p) for p in spec_paths] if spec_paths is not None else default_spec_paths()
    files, models = build_outputs(paths)
    out = Path(out)
    res = CheckResult()
    diffs = []
    expected = {out / rel: text for rel, text in files.items()}
    expected.update(extra or {})
    for path in sorted(expected):
        want = expected[path]
        try:
            have = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            have = None
        if have != want:
            res.stale.append(path.as_posix())
            diffs.append("".join(difflib.unified_diff(
                (have or "").splitlines(keepends=True), want.splitlines(keepends=True),
                fromfile=f"a/{path.as_posix()}" if have is not None else "/dev/null",
                tofile=f"b/{path.as_posix()}")))
    for rel in sorted(existing_files(out, models if explicit else None) - set(files)):
        res.orphans.append((out / rel).as_posix())
    res.diff = "".join(diffs)
    return res
