"""An engine process driven by JSON lines on stdin (tests only; the loop and the ``@@{json}``
replies are `support.jsonl`): one ``Engine`` on a pool URL, so two of
these are two instances sharing (or not) a Mooncake master."""
from __future__ import annotations

import logging
import sys
import threading

from support.jsonl import commands, reply


class _CountWarnings(logging.Handler):
    """Counts warnings per logger so a test can check "logged once" (they still reach stderr)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.by_logger: dict[str, int] = {}
        self.count_lock = threading.Lock()

    def emit(self, record):
        with self.count_lock:
            self.by_logger[record.name] = self.by_logger.get(record.name, 0) + 1


def main():
    import faulthandler
    import signal
    faulthandler.register(signal.SIGUSR1)      # a hung test can ask where it hangs
    import torch
    torch.set_num_threads(1)
    from graphgen.runtime import Engine, open_engine
    from graphgen.runtime.core.faults import Faults

    warnings = _CountWarnings()
    logging.getLogger().addHandler(warnings)
    logging.getLogger().addHandler(logging.StreamHandler(sys.stderr))
    eng = None
    for op, cmd in commands():
        if op == "open":
            faults = Faults.parse(cmd["faults"]) if cmd.get("faults") else None
            eng = open_engine(cmd["spec"], cmd["weights"], pool=cmd["pool"], write=cmd.get("write"),
                                   granularity=cmd.get("granularity"), faults=faults, num_blocks=64,
                                   collect_logits=cmd.get("collect_logits", False))
            reply(ok=True)
        elif op == "gen":
            res = eng.generate(cmd["prompts"], cmd.get("n", 4), settle=cmd.get("settle", True))
            if cmd.get("drain", True):
                eng.drain()
            reply(tokens=[r.tokens for r in res], hit=[r.hit_tokens for r in res],
                  variant=[r.variant for r in res],
                  logits=[[s.tolist() for s in r.step_logits] for r in res] if cmd.get("logits") else None)
        elif op == "drain":
            eng.drain()
            reply(ok=True)
        elif op == "stats":
            ranks = getattr(eng, "rank_pool_stats", None)  # ranks: each rank's own pool client
            reply(engine=eng.stats, pool=eng.pool_stats(), warnings=warnings.by_logger,
                  rank_pools=ranks() if ranks else None, rank_engines=getattr(eng, "rank_stats", None))
        else:
            reply(error=f"unknown op {op}")


if __name__ == "__main__":
    main()
