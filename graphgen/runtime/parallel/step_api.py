"""`DistributedCore`: `EngineCore`'s step API over lockstep ranks (what ``graphgen serve`` drives on a
`graphgen.runtime.parallel.launcher.DistributedEngine`), one typed command per call
(`graphgen.runtime.parallel.commands`). The DP ranks' is `graphgen.runtime.parallel.data_parallel.DataParallelCore`.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from . import commands as C
from .commands import failure_words

__all__ = ["DistributedCore"]


class DistributedCore:
    """`EngineCore`'s step API over the ranks: ``add_request``, ``abort``, ``step``, ``has_work``,
    ``stats``, ``shutdown`` (and setting ``eos_token_ids``) run on every rank's own ``Engine.core``,
    in the order the caller makes them, so every rank schedules the same steps and issues the same
    collectives; the results are rank 0's.

    What crosses to the ranks is pickled: the `SamplingParams`, from which each rank builds the
    request's sampler (a seeded one draws the same token on every rank; a sampled request without a
    seed would not agree, and the ranks' plan check stops the engine: give it a seed, as the server
    does). The logits every rank samples from are the same (the LM head's all_gather), so greedy rows
    agree. A ``ValueError`` of ``add_request`` (bad input) is raised here, every rank having refused it."""

    def __init__(self, engine: Any):  # the DistributedEngine whose ranks it drives (launcher.py imports this)
        self._engine = engine

    def _call(self, call: C.StepCall):
        status, value = self._engine._command(call, what=call.METHOD, when=failure_words(call))[0]
        if status == "invalid":
            raise ValueError(value)
        return value

    eos_token_ids = property(None, lambda self, ids: self._call(C.SetAttr("eos_token_ids", tuple(ids))))

    def add_request(self, req_id, prompt_ids: Sequence[int], params=None, *, max_tokens: Optional[int] = None,
                    fork_of=None) -> None:
        self._call(C.AddRequest(req_id, [int(t) for t in prompt_ids], params, max_tokens, fork_of))

    def abort(self, req_id, forks: bool = True) -> None:
        self._call(C.Abort(req_id, forks))

    def step(self) -> list:
        return self._call(C.Step())

    def has_work(self) -> bool:
        return self._call(C.HasWork())

    def stats(self) -> dict:
        return self._call(C.CoreStats())

    def shutdown(self, timeout: Optional[float] = None) -> None:
        self._call(C.Shutdown(timeout))
