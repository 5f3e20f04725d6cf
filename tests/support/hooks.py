"""``source_hook(variant, source) -> source`` mutations of generated code: the negative controls that
show an event matters (``Engine(..., source_hook=...)``; a rank process applies the same hook)."""
from __future__ import annotations


def drop_save_waits(variant: str, source: str) -> str:
    """Delete every ``rt.wait(ev[...])`` of the kv_save stream function in the mempool_prefill
    module(s); everything else (the records, the host's wait) stays."""
    if not variant.startswith("mempool_prefill"):
        return source
    out, inside, dropped = [], False, 0
    for line in source.splitlines(keepends=True):
        stripped = line.strip()
        if stripped.startswith("def kv_save_stream("):
            inside = True
        elif inside and stripped.startswith("rt.launch("):
            inside = False
        if inside and stripped.startswith("rt.wait(ev["):
            dropped += 1
            continue
        out.append(line)
    assert dropped >= 1, f"{variant}: no save-stream wait found to drop (generated code changed?)"
    return "".join(out)
