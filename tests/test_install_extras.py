"""Honest install extras: what each ``pip install`` gives, checked without installing anything.

- The wheel, built once from a copy of the sources (offline: ``pip wheel --no-build-isolation``),
  holds every file of ``graphgen/`` (the NPU manifest included) and the jinja2 frames of the
  top-level ``templates/`` as ``graphgen/lower/templates/``, where the lowering finds them (in a
  checkout it reads ``templates/`` itself).
- An interpreter that sees only that unpacked wheel and the build dependencies (``python -I -S``,
  ``sys.path`` = the wheel + links to networkx/jinja2/PyYAML) generates files byte-identical to
  ``generated/``, checks and validates, and says in one sentence which extra the runtime needs.
- ``graphgen run`` on the embedded pool works in an interpreter that sees only the ``runtime``
  extra's distributions (and what they pull in, from their installed metadata); ``serve`` and
  ``--pool mooncake://`` there name their extra; with torch unseen, ``run`` names ``runtime``.

Modules are hidden by absence, not by a finder that refuses them: ``sys.path`` holds links to the
allowed distributions only, so ``importlib.util.find_spec`` answers None as in a real install.
A full per-extra ``pip install`` in fresh venvs is ``scripts/check_extras.sh`` (opt-in, needs the registry).
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from graphgen.install import EXTRAS, NEEDS

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SPECS = ("tiny_qwen3", "tiny_deepseek_v3_npu")  # a CPU-only spec and one with the NPU target
RUNTIME_SENTENCE = "needs the 'runtime' extra: pip install 'graphgen[runtime]' (missing module: torch)"


# --- which distributions an extra brings, from pyproject.toml and the installed metadata ---------------

def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _req_name(req: str) -> tuple[str, list[str]]:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?", req)
    return _norm(m.group(1)), [e.strip() for e in (m.group(2) or "").split(",") if e.strip()]


def closure(extras: tuple[str, ...]) -> set[str]:
    """graphgen's base dependencies and those of ``extras``, with everything they require (markers
    other than ``extra == ...`` are kept: a superset is safe, the tests hide what is left out)."""
    todo = list(PYPROJECT["project"]["dependencies"])
    for extra in extras:
        todo += PYPROJECT["project"]["optional-dependencies"][extra]
    seen: set[str] = set()
    while todo:
        name, sub = _req_name(todo.pop())
        if name == "graphgen":  # a self-reference: graphgen[runtime]
            for extra in sub:
                todo += PYPROJECT["project"]["optional-dependencies"][extra]
            continue
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        todo += [r for r in reqs if not re.search(r"\bextra\s*==", r)]
    return seen


def link_site(dists: set[str], into: Path) -> Path:
    """A folder of links to the top-level files of the given installed distributions only."""
    into.mkdir(parents=True)
    for name in sorted(dists):
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        tops = {Path(str(f)).parts[0] for f in dist.files or () if not str(f).startswith("..")}
        for top in tops:
            src = Path(dist.locate_file(top))
            if top.endswith(".pth") or not src.exists() or (into / top).exists():
                continue
            (into / top).symlink_to(src)
    return into


def isolated(path: list[Path], code: str, *args, cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    """``python -I -S`` (no site-packages, no PYTHONPATH, no user site) seeing only ``path``."""
    boot = f"import sys; sys.path[:0] = {[str(p) for p in path]!r}\n{code}"
    return subprocess.run([sys.executable, "-I", "-S", "-c", boot, *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


CLI = "from graphgen.cli import main; sys.exit(main())"


def cli(path, *args, cwd):
    return isolated(path, CLI, *args, cwd=cwd)


def one_sentence(res) -> str:
    """stderr must be one line (no traceback); returns it."""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    return lines[0]


# --- the wheel ---------------------------------------------------------------------------------------

# slow: the module's wheel build (pip wheel of a copy of the sources, ~6 s here) and an isolated
# interpreter per check; the `not slow` lane leaves packaging to ./dev test
WHEEL_SLOW = pytest.mark.slow

@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built once from a copy of the sources (the checkout is left untouched), offline:
    pyproject.toml's own build backend (``[build-system] build-backend``) called in a fresh
    interpreter, as ``pip wheel --no-build-isolation`` calls it (PEP 517 ``build_wheel``), without
    pip's own start-up; with this interpreter's setuptools (a Python 3.11 venv has it; 3.12+ venvs do not)."""
    pytest.importorskip("setuptools", reason="building the wheel offline needs setuptools in this venv")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / f, src / f)
    for folder in ("graphgen", "templates"):
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    build = ("import importlib, sys\n"
             "print(importlib.import_module(sys.argv[1]).build_wheel(sys.argv[2]))")
    res = subprocess.run([sys.executable, "-c", build, PYPROJECT["build-system"]["build-backend"], str(tmp / "dist")],
                         cwd=src, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    (whl,) = (tmp / "dist").glob("graphgen-*.whl")
    return whl


@pytest.fixture(scope="module")
def build_env(wheel, tmp_path_factory) -> list[Path]:
    """sys.path of an install of the wheel alone: the unpacked wheel + the build dependencies."""
    tmp = tmp_path_factory.mktemp("build_env")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp / "site")
    return [tmp / "site", link_site(closure(()), tmp / "deps")]


def _files(folder: str) -> set[str]:
    return {p.relative_to(REPO / folder).as_posix() for p in (REPO / folder).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


@WHEEL_SLOW
def test_wheel_holds_every_package_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    files = {f"graphgen/{f}" for f in _files("graphgen")} | {f"graphgen/lower/templates/{f}" for f in _files("templates")}
    assert {"graphgen/lower/templates/cpu/variant.py.j2", "graphgen/lower/templates/npu/variant.py.j2",
            "graphgen/npu/manifest.json"} <= files
    assert sorted(files - names) == []


def test_pyproject_lists_every_package():
    """setuptools is given the packages by name (it cannot find one mapped from outside graphgen/):
    every folder of graphgen/ with modules, and graphgen.lower.templates with a package per target."""
    found = {".".join(("graphgen", *p.parent.relative_to(REPO / "graphgen").parts)) for p in (REPO / "graphgen").rglob("*.py")}
    found |= {"graphgen.lower.templates"} | {f"graphgen.lower.templates.{p.name}" for p in (REPO / "templates").iterdir()
                                           if p.is_dir() and p.name != "__pycache__"}
    listed = PYPROJECT["tool"]["setuptools"]["packages"]
    assert sorted(found - set(listed)) == [] and sorted(set(listed) - found) == []
    assert PYPROJECT["tool"]["setuptools"]["package-dir"] == {"graphgen.lower.templates": "templates"}


FRAMES = "from graphgen.lower.render import template_dir; print(template_dir())"


@WHEEL_SLOW
def test_lowering_reads_the_frames_of_the_wheel_or_of_the_checkout(build_env, tmp_path):
    res = isolated(build_env, FRAMES, cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.strip() == str(build_env[0] / "graphgen" / "lower" / "templates"), res.stderr
    res = isolated([REPO, build_env[1]], FRAMES, cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.strip() == str(REPO / "templates"), res.stderr


@WHEEL_SLOW
def test_a_wheel_without_its_frames_says_where_it_looked(build_env, tmp_path):
    """Negative control: the same install with graphgen/lower/templates/ gone finds no frames (it
    reads no other folder) and names both places it looked."""
    site = tmp_path / "site"
    shutil.copytree(build_env[0], site, ignore=shutil.ignore_patterns("templates"))
    res = isolated([site, build_env[1]], FRAMES, cwd=tmp_path)
    assert res.returncode == 1 and "LoweringError: the lowering's jinja2 frames are in neither" in res.stderr
    assert str(site / "graphgen" / "lower" / "templates") in res.stderr


@WHEEL_SLOW
def test_build_env_sees_no_optional_module(build_env, tmp_path):
    """The isolation holds: nothing of any extra (nor pytest) is importable there, graphgen comes from the wheel."""
    probe = ("import importlib.util as u, graphgen; print(graphgen.__file__); "
             "print([m for m in sys.argv[1:] if u.find_spec(m) is not None])")
    res = isolated(build_env, probe, "pytest", *(m for mods in EXTRAS.values() for m in mods), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    where, found = res.stdout.splitlines()
    assert where.startswith(str(build_env[0])) and found == "[]"


def _project(tmp_path: Path) -> Path:
    (tmp_path / "specs").mkdir()
    for name in SPECS:
        shutil.copy(REPO / "specs" / f"{name}.yaml", tmp_path / "specs")
    return tmp_path


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@WHEEL_SLOW
def test_wheel_generates_the_repository_files_byte_for_byte(build_env, tmp_path):
    proj = _project(tmp_path)
    res = cli(build_env, "generate", "--out", "out", cwd=proj)  # the default specs/*.yaml of this folder
    assert res.returncode == 0, res.stderr
    for name in SPECS:
        want = _tree(REPO / "generated" / name)
        assert want and _tree(proj / "out" / name) == want, name
    # not a source checkout: the checkout's derived files (specs/schema.json) are not written here
    assert sorted(p.name for p in (proj / "specs").iterdir()) == sorted(f"{n}.yaml" for n in SPECS)
    res = cli(build_env, "check", "--out", "out", cwd=proj)
    assert res.returncode == 0, res.stderr
    (proj / "out" / SPECS[0] / "decode.graph").write_text("tampered\n")  # negative control
    assert cli(build_env, "check", "--out", "out", cwd=proj).returncode == 1
    res = cli(build_env, "validate", *(f"specs/{n}.yaml" for n in SPECS), cwd=proj)
    assert res.returncode == 0 and "NPU kernel limits ok" in res.stdout, res.stderr


@WHEEL_SLOW
def test_wheel_without_specs_says_so(build_env, tmp_path):
    res = cli(build_env, "generate", cwd=tmp_path)
    assert res.returncode == 2
    assert "no specs/*.yaml in this folder: pass --spec FILE" in one_sentence(res)
    assert list(tmp_path.iterdir()) == []


@WHEEL_SLOW
def test_wheel_import_hf_and_schema(build_env, tmp_path):
    cfg = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2, "vocab_size": 300,
           "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "tie_word_embeddings": False, "torch_dtype": "float32"}
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    res = cli(build_env, "import-hf", "hf", "--out", "specs/mine.yaml", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "$schema" not in (tmp_path / "specs" / "mine.yaml").read_text()  # no checkout: no schema to point at
    res = cli(build_env, "schema", cwd=tmp_path)
    assert res.returncode == 0 and res.stdout == (REPO / "specs" / "schema.json").read_text()


@WHEEL_SLOW
def test_wheel_trains_the_same_tokenizer_corpus_as_the_checkout(build_env):
    """The random checkpoints' tokenizer is trained on the package's docstrings: a wheel has them all."""
    from graphgen.runtime.checkpoint.tokenizer import default_corpus

    path = build_env[0] / "graphgen" / "runtime" / "checkpoint" / "tokenizer.py"
    spec = importlib.util.spec_from_file_location("wheel_tokenizer", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    corpus = mod.default_corpus()
    assert len("".join(corpus)) > 50_000 and corpus == default_corpus()


@WHEEL_SLOW
def test_wheel_runtime_commands_name_the_runtime_extra(build_env, tmp_path):
    res = cli(build_env, "run", "--spec", "specs/tiny_qwen3.yaml", "--weights", ".", "--prompt-ids", "1,2",
              cwd=_project(tmp_path))
    assert res.returncode == 2 and one_sentence(res) == f"graphgen run: {RUNTIME_SENTENCE}"
    for code in ("import graphgen.runtime", "from graphgen import Engine"):
        res = isolated(build_env, f"try:\n    {code}\nexcept ImportError as e:\n    print(e)", cwd=tmp_path)
        assert res.returncode == 0 and res.stdout.strip() == f"graphgen.runtime: {RUNTIME_SENTENCE}", res.stderr


# --- the runtime extra alone -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runtime_env(tmp_path_factory) -> list[Path]:
    """sys.path of the checkout's graphgen with only the runtime extra's distributions."""
    return [REPO, link_site(closure(("runtime",)), tmp_path_factory.mktemp("runtime_env") / "site")]


def test_extras_table_agrees_with_pyproject():
    """graphgen/install.py's modules per extra are those of pyproject.toml's distributions."""
    by_dist: dict[str, set[str]] = {}
    for module, dists in md.packages_distributions().items():
        for d in dists:
            by_dist.setdefault(_norm(d), set()).add(module)
    extras = PYPROJECT["project"]["optional-dependencies"]
    for extra, modules in EXTRAS.items():
        reqs = [_req_name(r) for r in extras[extra]]
        assert tuple(sorted(e for n, sub in reqs if n == "graphgen" for e in sub)) == NEEDS.get(extra, ())
        provided = set().union(*(by_dist.get(n, set()) for n, _ in reqs if n != "graphgen"))
        assert set(modules) <= provided, (extra, set(modules) - provided)


def test_runtime_env_hides_every_other_extra(runtime_env, tmp_path):
    hidden = ["fastapi", "uvicorn", "prometheus_client", "mooncake", "xxhash", "openai", "pytest", "jsonschema",
              "transformers", "tokenizers", "matplotlib"]
    probe = "import importlib.util as u; print([m for m in sys.argv[1:] if u.find_spec(m) is not None])"
    res = isolated(runtime_env, probe, "torch", "safetensors", "numpy", *hidden, cwd=tmp_path)
    assert res.stdout.strip() == "['torch', 'safetensors', 'numpy']", res.stderr


@pytest.mark.slow
def test_run_on_the_embedded_pool_needs_only_the_runtime_extra(runtime_env, tmp_path):
    code = ("import dataclasses\n"
            "from graphgen.modelspec.loader import load_spec\n"
            "from graphgen.runtime.checkpoint.hf import write_random_hf_checkpoint\n"
            "spec = load_spec(sys.argv[1])\n"
            "write_random_hf_checkpoint(sys.argv[2], spec.family, dataclasses.asdict(spec.dims), seed=0)\n"
            "from graphgen.cli import main\n"
            "sys.exit(main(['run', '--spec', sys.argv[1], '--weights', sys.argv[2], '--prompt-ids', '1,2,3,4,5',"
            " '--max-new-tokens', '2', '--write', 'async', '--json']))")
    res = isolated(runtime_env, code, REPO / "specs" / "tiny_qwen3.yaml", tmp_path / "ckpt", cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.splitlines()[-1])
    assert len(out["tokens"]) == 2
    assert not (tmp_path / "ckpt" / "tokenizer.json").exists()  # tokenizers is not in the runtime extra


def test_serve_and_mooncake_name_their_extra(runtime_env, tmp_path):
    base = ("--spec", REPO / "specs" / "tiny_qwen3.yaml", "--weights", tmp_path)
    res = cli(runtime_env, "serve", *base, cwd=tmp_path)
    assert res.returncode == 2
    assert one_sentence(res) == ("graphgen serve: needs the 'serve' extra: pip install 'graphgen[serve]' "
                                 "(missing module: fastapi)")
    res = cli(runtime_env, "run", *base, "--prompt-ids", "1", "--pool", "mooncake://127.0.0.1:1", cwd=tmp_path)
    assert res.returncode == 2
    assert one_sentence(res) == ("graphgen run: needs the 'mooncake' extra: pip install 'graphgen[mooncake]' "
                                 "(missing module: mooncake)")


def test_hiding_torch_makes_run_and_compile_name_the_runtime_extra(tmp_path):
    """Negative control of the runtime checks: the same checkout, with only the build dependencies."""
    path = [REPO, link_site(closure(()), tmp_path / "site")]
    res = cli(path, "run", "--spec", REPO / "specs" / "tiny_qwen3.yaml", "--weights", tmp_path,
              "--prompt-ids", "1", cwd=tmp_path)
    assert res.returncode == 2 and one_sentence(res) == f"graphgen run: {RUNTIME_SENTENCE}"
    res = cli(path, "compile", "--target", "npu", "--spec", "specs/tiny_qwen3_npu.yaml", "--variant", "decode",
              "--standin", cwd=REPO)
    assert res.returncode == 2 and one_sentence(res) == f"graphgen compile: {RUNTIME_SENTENCE}"
