"""`AppState`: everything a route handler of the server reads, in one object (``app.state.serving``)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Optional

from ..trace import NULL, TraceRecorder
from .grammar_worker import GrammarWorker
from .loop import EngineLoop
from .metrics import ServerMetrics
from .protocol import Context

__all__ = ["AppState"]


@dataclass
class AppState:
    engine: Any  # the ServingEngine (serve/engine_api.py)
    loop: EngineLoop
    metrics: ServerMetrics
    ctx: Context  # what request validation needs (serve/protocol.py)
    grammars: GrammarWorker
    tokenizer: Any = None
    trace: TraceRecorder = NULL
    drain_timeout_s: float = 30.0
    max_request_bytes: int = 8 << 20
    pd: Optional[Any] = None  # serve/pd.py PD, or None (several ranks)
    accepting: bool = False  # false before start-up and from the drain on: 503s
    ids: Any = field(default_factory=itertools.count)  # request id numbers

    def drain(self) -> None:
        """Stop accepting (``/health`` 503 from now on) and drain the engine loop while the socket
        still answers (``run_server`` calls it on SIGTERM, from a thread)."""
        self.accepting = False
        self.loop.stop(self.drain_timeout_s)
