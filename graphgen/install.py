"""What an installation holds: the install extras as the code sees them (and the one sentence a
missing one gets), and whether graphgen runs from a source checkout or from an installed wheel.

``pip install graphgen`` is the torch-free build path (networkx, jinja2, PyYAML). Everything else
is an extra of ``pyproject.toml``; ``EXTRAS`` lists, per extra, the top-level modules the code
imports from it (tests check it against ``pyproject.toml``). An extra that needs another extra
(``serve`` and ``mooncake`` need ``runtime``) lists only its own modules here; ``require`` checks
the chain.

``require`` looks modules up without importing them (``importlib.util.find_spec``), so checking is
cheap and happens before anything heavy loads. A missing module raises :class:`MissingExtra`, an
``ImportError`` whose text is one sentence naming the extra; the CLI prints it and exits 2
(``cli/common.py``). This module imports nothing of graphgen and nothing outside the standard library.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: pathlib is imported where it is used
    import os
    from pathlib import Path

__all__ = ["EXTRAS", "NEEDS", "MissingExtra", "extra_of", "is_checkout", "require", "sentence", "source_checkout"]

EXTRAS: dict[str, tuple[str, ...]] = {
    # executing generated graphs: `graphgen run`, `Engine`, `compile --standin`, the random checkpoints
    "runtime": ("torch", "safetensors", "numpy"),
    # `graphgen serve`: the HTTP app, metrics, and the checkpoint's tokenizer (transformers'
    # AutoTokenizer applies its chat template)
    "serve": ("fastapi", "uvicorn", "prometheus_client", "tokenizers", "transformers", "llguidance", "aiohttp"),
    # `--pool mooncake://`: the Mooncake Store client and its value checksums
    "mooncake": ("mooncake", "xxhash"),
}
# extras that need another extra first (pyproject.toml: serve = ["graphgen[runtime]", ...])
NEEDS: dict[str, tuple[str, ...]] = {"serve": ("runtime",), "mooncake": ("runtime",)}


class MissingExtra(ImportError):
    """An optional dependency is not installed; ``str()`` is the one sentence to show."""

    def __init__(self, extra: str, module: str, who: str = "graphgen"):
        self.extra, self.module, self.who = extra, module, who
        super().__init__(sentence(who, extra, module), name=module)


def sentence(who: str, extra: str, module: str) -> str:
    return (f"{who}: needs the '{extra}' extra: pip install 'graphgen[{extra}]' "
            f"(missing module: {module})")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a finder that refuses the name (or a broken parent) counts as missing
        return False
    except ValueError:   # already imported with no __spec__: it is there
        return True


def require(extra: str, who: str = "graphgen") -> None:
    """Raise :class:`MissingExtra` unless every module of ``extra`` (and of the extras it needs)
    can be imported; ``who`` names the command or module in the sentence."""
    for name in (*NEEDS.get(extra, ()), extra):
        for module in EXTRAS[name]:
            if not _installed(module):
                raise MissingExtra(name, module, who)


def extra_of(module: str) -> str | None:
    """The extra that provides top-level module ``module`` (``torch.fx`` -> ``runtime``), or None."""
    top = module.split(".")[0]
    return next((extra for extra, mods in EXTRAS.items() if top in mods), None)


def is_checkout(folder: str | os.PathLike[str]) -> bool:
    """Whether ``folder`` is the root of a graphgen source checkout (not merely a folder of specs)."""
    from pathlib import Path

    root = Path(folder)
    return all((root / p).is_file() for p in ("pyproject.toml", "graphgen/__init__.py", "specs/schema.json"))


def source_checkout() -> Path | None:
    """The root of the graphgen source checkout this package runs from, or None (an installed
    wheel). The repository's own files (``specs/``, ``docs/``, ``generated/``) exist only there."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    return root if is_checkout(root) else None
