"""Grammar compilation off the engine's loop.

A request with a grammar (``response_format``, a forced tool call) is submitted to the engine only
once its grammar is compiled against the tokenizer (`graphgen.runtime.compiled_matcher`, cached by
grammar text): the compile runs on this worker's own thread (llguidance drops the GIL while it
compiles), so the engine keeps stepping the other requests meanwhile, and the request's first step
only copies the compiled matcher. The library's fixed cost — importing it, indexing the tokenizer's
vocabulary (seconds) — is paid at start-up, on the same thread, while the server already answers
(a grammar request that comes first waits behind it; nothing else does).

With several ranks the matcher is built again in each rank's process at the request's first step
(the ranks build their own from the grammar text); the compile here still checks it first.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Optional

from .errors import ApiError

__all__ = ["GrammarWorker"]

log = logging.getLogger("graphgen.serve")


class GrammarWorker:
    def __init__(self, tokenizer_dir: Optional[str], vocab_size: int):
        self.tokenizer_dir, self.vocab_size = tokenizer_dir, vocab_size
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None

    def start(self) -> None:
        """Start the thread and initialise the library on it (when the checkpoint has a tokenizer)."""
        if self.tokenizer_dir is None:
            return
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._pool.submit(self._warm_up)

    def _warm_up(self) -> None:
        from ..runtime import warm_up_grammars

        try:
            warm_up_grammars(self.tokenizer_dir, self.vocab_size)
        except Exception:  # noqa: BLE001 - a grammar request reports its own failure
            log.warning("grammar warm-up failed", exc_info=True)

    async def ready(self, structured, param: str) -> None:
        """Returns once ``structured``'s grammar is compiled (a 400 naming ``param`` if it is not)."""
        if structured is None or self._pool is None:
            return
        from ..runtime import compiled_matcher

        try:
            await asyncio.get_running_loop().run_in_executor(self._pool, compiled_matcher, structured,
                                                             self.vocab_size)
        except ValueError as e:
            raise ApiError(f"'{param}' cannot be compiled for this tokenizer: {e}"[:400], param=param,
                           code="invalid_value") from None

    def stop(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
