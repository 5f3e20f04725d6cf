"""``source_hook(variant, source) -> source`` mutations of generated code: the negative controls that
show an event matters (``Engine(..., source_hook=...)``; a rank process applies the same hook)."""
from __future__ import annotations


def _edit_save_waits(variant: str, source: str, edit) -> str:
    """``source`` with every ``rt.wait(ev[...])`` line of the kv_save stream function of the
    mempool_prefill module(s) replaced by ``edit(line)``; everything else (the records, the host's
    wait) stays."""
    if not variant.startswith("mempool_prefill"):
        return source
    out, inside, edited = [], False, 0
    for line in source.splitlines(keepends=True):
        stripped = line.strip()
        if stripped.startswith("def kv_save_stream("):
            inside = True
        elif inside and stripped.startswith("rt.launch("):
            inside = False
        if inside and stripped.startswith("rt.wait(ev["):
            edited += 1
            line = edit(line)
        out.append(line)
    assert edited >= 1, f"{variant}: no save-stream wait found to drop (generated code changed?)"
    return "".join(out)


def drop_save_waits(variant: str, source: str) -> str:
    """Delete every ``rt.wait(ev[...])`` of the kv_save stream function in the mempool_prefill
    module(s)."""
    return _edit_save_waits(variant, source, lambda line: "")


def drop_save_waits_once_armed(variant: str, source: str) -> str:
    """`drop_save_waits`, but each wait is skipped only once the process has set ``rt.drop_save_waits``
    (a probe): one engine runs the unmutated control first, then the mutation (one start, not two)."""
    def guard(line: str) -> str:
        indent = line[:len(line) - len(line.lstrip())]
        return f"{indent}if not getattr(rt, 'drop_save_waits', False): {line.lstrip()}"
    return _edit_save_waits(variant, source, guard)
