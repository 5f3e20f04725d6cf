"""The step-API call a multi-rank engine sends a rank process (``DistributedCore`` in lockstep,
``DataParallelCore`` per DP rank), run on the rank's own `EngineCore`: the one place its reply
protocol lives."""

from __future__ import annotations

__all__ = ["core_call", "failure_words"]

# the step-API calls that are no request's work: ``graphgen serve``'s loop polls them between steps and
# while idle, so a failure during one is a failure between commands (docs/parallel.md, "Failure")
POLLS = frozenset({"has_work", "stats"})


def failure_words(method: str) -> str:
    """How the sentence of a failure during ``method`` ends: ``during step``, or ``(between commands)``."""
    return "(between commands)" if method in POLLS else f"during {method}"


def core_call(core, method: str, args: tuple):
    """One step-API call on this rank's `EngineCore`: ``("ok", result)``, or ``("invalid", message)``
    when ``add_request`` refused its input (nothing was queued; the calling engine raises it)."""
    if method == "set":
        name, value = args
        setattr(core, name, value)
        return "ok", None
    if method == "add_request":
        req_id, prompt, params, max_tokens, fork_of = args
        try:
            core.add_request(req_id, prompt, params, max_tokens=max_tokens, fork_of=fork_of)
        except ValueError as e:
            return "invalid", str(e)
        return "ok", None
    if method not in ("abort", "step", "has_work", "stats", "shutdown"):
        raise ValueError(f"unknown step-API call {method!r}")
    return "ok", getattr(core, method)(*args)
