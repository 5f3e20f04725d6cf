"""Diagnostics: every problem in a spec file names ``file:line:col``, what is wrong, and the fix."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Diagnostic:
    file: str
    line: int  # 1-based
    col: int  # 1-based
    message: str
    fix: str = ""

    def __str__(self) -> str:
        text = f"{self.file}:{self.line}:{self.col}: error: {self.message}"
        if self.fix:
            text += f"\n    fix: {self.fix}"
        return text


class SpecError(Exception):
    """All errors found in one or more spec files (never just the first)."""

    def __init__(self, diagnostics: list[Diagnostic]):
        self.diagnostics = sorted(diagnostics)
        super().__init__("\n".join(str(d) for d in self.diagnostics))
