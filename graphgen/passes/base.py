"""Pass infrastructure: a pass is a small class with a contract (requires → run → ensures)."""

from __future__ import annotations

from dataclasses import dataclass

from ..ir.graph import Graph


@dataclass(frozen=True)
class PassContext:
    spec: object  # graphgen.modelspec.model.ModelSpec
    variant_name: str
    spec_file: str = ""

    @property
    def variant(self):
        return self.spec.variants[self.variant_name]


class Pass:
    """Base class. Subclasses set ``name`` and implement ``run``; the docstring is the contract."""

    name = "pass"

    def run(self, graph: Graph, ctx: PassContext) -> None:  # pragma: no cover - interface
        raise NotImplementedError


class PassError(Exception):
    """A pass failed; names the pass and the passes that ran before it."""

    def __init__(self, pass_name: str, before: list[str], graph_name: str, cause: Exception):
        self.pass_name, self.before, self.cause = pass_name, before, cause
        ran = ", ".join(before) or "none"
        super().__init__(f"{graph_name}: pass '{pass_name}' failed (passes run before it: {ran}):\n{cause}")
