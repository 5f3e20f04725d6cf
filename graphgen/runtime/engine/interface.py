"""What `graphgen.runtime.open_engine` returns, declared: `EngineInterface` over a `StepAPI`.

Every target and layout gives an object with these calls — one process (`Engine`, CPU or NPU), the
ranks of a tensor/context-parallel layout (`graphgen.runtime.parallel.launcher.DistributedEngine`)
and the DP ranks (`DataParallelEngine`) — so a driver (``graphgen run``, ``graphgen serve``, P/D,
the demo, the benchmarks) uses the interface and never asks which class it holds. What differs
between them is answered by the interface itself: ``kv_naming()`` is None where the engine cannot
hand its blocks over (ranks on the embedded host pool, DP groups; tp/cp ranks on Mooncake name every shard), ``observe`` does nothing
where the spans would be in other processes.

`CacheNaming` is how an engine names a prompt's blocks in its pool (the P/D handoff's contract).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence

from .request import RequestOutput, RequestResult
from .sampling import SamplingParams

__all__ = ["EngineInterface", "StepAPI", "CacheNaming", "interface_gaps"]


@dataclass(frozen=True)
class CacheNaming:
    """How an engine names a prompt's blocks: chain digests, pool keys, layout (P/D's handoff)."""

    block_size: int
    layout: str
    digests: Callable[..., list]   # (prompt, salt="") -> chain digest of every full block
    keys: Callable[..., list]      # (prompt, salt="") -> pool key of every full block (one rank: its one shard)
    # a request's LoRA adapter name (None: the base model) -> the salt of its blocks (docs/lora.md)
    salt_of: Callable[[Optional[str]], str] = lambda name: ""
    # several ranks: every distinct KV shard's key function, (prompt, salt="") -> keys (a shard several ranks
    # hold, as MLA's latent, once) and its name as the keys carry it ("r0of2"); (): ``keys`` is the only shard
    shard_keys: tuple = ()
    shards: tuple = ()
    # the keys carry each block's successor token (`pool.keys.mtp_block_keys`): a speculative engine's (--speculative
    # mtp), whose blocks hold the MTP layer's KV too, computed from that token; an engine without speculation never
    # reads them (its keys have no successor), so a handoff says which it is
    lookahead: bool = False

    def handed_off(self, prompt: Sequence[int]) -> int:
        """Blocks a handoff covers: every full block but one holding the last token (recomputed by D)."""
        return (len(prompt) - 1) // self.block_size

    def handoff_keys(self, prompt: Sequence[int], salt: str = "") -> list[list[str]]:
        """The handed-off blocks' pool keys, one list per KV shard (every rank's part of each block); ``salt``:
        the request's LoRA adapter's (`salt_of`)."""
        n = self.handed_off(prompt)
        return [f(prompt, salt)[:n] for f in (self.shard_keys or (self.keys,))]


class StepAPI(Protocol):
    """The step-level API a server drives (`EngineCore`; over ranks `DistributedCore`, `DataParallelCore`):
    requests in, per-step `RequestOutput`s out. Every call from one thread."""

    eos_token_ids: Any  # set: the stop tokens every request gets (the model's EOS) unless it ignores them

    def add_request(self, req_id: Any, prompt_ids: Sequence[int], params: Optional[SamplingParams] = None, *,
                    max_tokens: Optional[int] = None, fork_of: Any = None) -> Any: ...
    def abort(self, req_id: Any, forks: bool = True) -> None: ...
    def step(self) -> list[RequestOutput]: ...
    def has_work(self) -> bool: ...
    def stats(self) -> dict: ...
    def shutdown(self, timeout: Optional[float] = None) -> None: ...


class EngineInterface(Protocol):
    """What `open_engine` returns, for every target and layout (module doc)."""

    spec: Any                  # the ModelSpec it runs (the run's overrides applied)
    max_model_len: int         # prompt + generated tokens one request may have
    core: StepAPI              # the step API
    speculative: bool          # every request decodes speculatively (--speculative mtp: some params refused)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 16, **kwargs: Any
                 ) -> list[RequestResult]: ...
    def drain(self, timeout: Optional[float] = None) -> None: ...
    @property
    def stats(self) -> dict: ...
    def pool_stats(self) -> dict: ...
    def observe(self, observer: Any) -> None: ...
    def kv_naming(self) -> Optional[CacheNaming]: ...
    def kv_pool(self) -> Any: ...
    def saves_in_flight(self) -> int: ...
    def save_report(self) -> Any: ...   # `RanksSaveReport`: every rank's steps' saves, per pool-key shard
    def close(self) -> None: ...
    def __enter__(self) -> "EngineInterface": ...
    def __exit__(self, *exc: Any) -> None: ...


def _members(protocol: type) -> list[str]:
    names = set(getattr(protocol, "__annotations__", {}))
    names.update(n for n, v in vars(protocol).items()
                 if (callable(v) or isinstance(v, property)) and (not n.startswith("_") or n in ("__enter__", "__exit__")))
    return sorted(names)


def interface_gaps(engine: Any, protocol: type = EngineInterface) -> list[str]:
    """The members of ``protocol`` that ``engine`` lacks (none read: a property is looked up on the
    class, an attribute in the instance); ``open_engine`` refuses an engine with gaps, and the
    ``core`` of one is checked against `StepAPI` too."""
    def has(obj: Any, name: str) -> bool:
        return name in getattr(obj, "__dict__", {}) or hasattr(type(obj), name)

    gaps = [m for m in _members(protocol) if not has(engine, m)]
    if protocol is EngineInterface and has(engine, "core"):
        gaps += [f"core.{m}" for m in interface_gaps(getattr(engine, "core"), StepAPI)]
    return gaps
