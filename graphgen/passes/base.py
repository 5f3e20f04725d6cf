"""Pass infrastructure: a pass is a small class with an executable contract (requires → run → ensures).

``requires(graph, ctx)`` and ``ensures(graph, ctx)`` return the list of violated conditions (empty
when the contract holds). The pass manager runs them around ``run`` in checked mode
(``run_pipeline(..., check=True)``, what tests use) and skips them otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..ir.graph import Graph

if TYPE_CHECKING:
    from ..modelspec.model import ModelSpec, Variant


@dataclass(frozen=True)
class PassContext:
    spec: ModelSpec
    variant_name: str
    spec_file: str = ""

    @property
    def variant(self) -> Variant:
        return self.spec.variants[self.variant_name]


class Pass:
    """Base class. Subclasses set ``name``, implement ``run`` and state their contract as code."""

    name = "pass"

    def requires(self, graph: Graph, ctx: PassContext) -> list[str]:
        return []

    def run(self, graph: Graph, ctx: PassContext) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def ensures(self, graph: Graph, ctx: PassContext) -> list[str]:
        return []


class ContractError(Exception):
    """A pass's precondition (``requires``) or postcondition (``ensures``) does not hold."""

    def __init__(self, which: str, problems: list[str]):
        self.which, self.problems = which, problems
        super().__init__(f"{which} violated:\n" + "\n".join(f"  - {p}" for p in problems))


class PassError(Exception):
    """A pass failed; names the pass and the passes that ran before it."""

    def __init__(self, pass_name: str, before: list[str], graph_name: str, cause: Exception):
        self.pass_name, self.before, self.cause = pass_name, before, cause
        ran = ", ".join(before) or "none"
        super().__init__(f"{graph_name}: pass '{pass_name}' failed (passes run before it: {ran}):\n{cause}")
