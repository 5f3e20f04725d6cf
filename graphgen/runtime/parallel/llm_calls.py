"""The step-API call a facade sends a rank process (``DistributedLLM`` in lockstep, ``DataParallelLLM`` per
DP rank), run on the rank's own `LLMEngine`: the one place its reply protocol lives."""

from __future__ import annotations

__all__ = ["llm_call"]


def llm_call(llm, method: str, args: tuple):
    """One `DistributedLLM` call on this rank's `LLMEngine`: ``("ok", result)``, or ``("invalid",
    message)`` when ``add_request`` refused its input (nothing was queued; the facade raises it)."""
    if method == "set":
        name, value = args
        setattr(llm, name, value)
        return "ok", None
    if method == "add_request":
        req_id, prompt, params, max_tokens, fork_of = args
        try:
            llm.add_request(req_id, prompt, params, max_tokens=max_tokens, fork_of=fork_of)
        except ValueError as e:
            return "invalid", str(e)
        return "ok", None
    if method not in ("abort", "step", "has_work", "stats", "shutdown"):
        raise ValueError(f"unknown step-API call {method!r}")
    return "ok", getattr(llm, method)(*args)
