"""``n`` / ``best_of`` as forks: children held until their parent's prompt blocks have landed, then
sharing them (one prefill of the prompt; the scheduler's Forks rule, docs/runtime.md item 7).

A child shares the parent's first ``(len(prompt) - 1) // block_size`` blocks — full blocks, never
the one holding the last prompt token, whose logits each child needs from its own computation —
with one `BlockAllocator` reference each, and computes only the rest of its prompt (1 to
``block_size`` tokens: recomputed per child, since no runner has a block copy)."""

from __future__ import annotations

from ..core.kvcache import BlockAllocator
from .request import Request

__all__ = ["Forks"]


class Forks:
    def __init__(self, alloc: BlockAllocator, block_size: int):
        self.alloc = alloc
        self.block_size = block_size
        self.held: list[Request] = []  # children waiting for their parent's prompt blocks

    def shared_blocks(self, parent: Request) -> int:
        return (len(parent.prompt) - 1) // self.block_size

    def can_share(self, child: Request, parent: Request) -> bool:
        return not parent.finished and parent.prompt == child.prompt and self.shared_blocks(parent) > 0

    def hold(self, child: Request, parent: Request) -> None:
        child.fork_parent = parent
        self.held.append(child)

    def take(self, parent: Request) -> list[Request]:
        """The children still held for ``parent``, no longer held."""
        kids = [c for c in self.held if c.fork_parent is parent]
        for c in kids:
            self.held.remove(c)
            c.fork_parent = None
        return kids

    def ready(self, parent: Request, landed_end: int) -> list[Request]:
        """The held children of ``parent`` once a landed step of it reached ``landed_end``: taken
        when that covers the shared blocks (their KV is in the cache), else none."""
        if landed_end < self.shared_blocks(parent) * self.block_size or not any(
                c.fork_parent is parent for c in self.held):
            return []
        return self.take(parent)

    def share(self, parent: Request, children: list[Request]) -> None:
        """``children`` take a reference on each shared block and have those positions cached."""
        n = self.shared_blocks(parent)
        ids = parent.table[:n]
        for c in children:
            self.alloc.share(ids)
            c.fork_parent, c.table, c.shared_blocks = None, list(ids), n
            c.cached = c.computed = n * self.block_size
            c.keys, c.hit_blocks, c.loaded, c.device_blocks = None, 0, [], 0
