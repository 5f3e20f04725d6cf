"""Render a graphgen Chrome trace (``--trace FILE`` of ``graphgen run`` / ``graphgen serve``) to a PNG:
one lane per track (scheduler, forward, save, host, server), one bar per span, so the save and the
commit running beside the forward is visible without opening Perfetto.

    python scripts/render_trace.py TRACE.json OUT.png [--window START_MS:END_MS] [--title TEXT]

Needs matplotlib (the ``docs`` extra).
"""

from __future__ import annotations

import argparse
import json
import sys

# span name (before ':') -> colour; anything else is grey
COLOURS = {"step": "#c9c9c9", "schedule": "#4c72b0", "launch": "#1f3a66", "forward": "#55a868",
           "kv_save": "#dd8452", "commit": "#c44e52", "request": "#8172b3"}


def load_spans(doc: dict) -> tuple[list[str], list[tuple[str, str, float, float]]]:
    """(track names in their sort order, spans as (track, name, start_ms, end_ms))."""
    events = doc["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    spans = [(names[e["tid"]], e["name"], e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3)
             for e in events if e.get("ph") == "X"]
    used = {s[0] for s in spans}
    return [names[t] for t in sorted(names) if names[t] in used], spans


def render(doc: dict, out: str, window=None, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    tracks, spans = load_spans(doc)
    if window is not None:
        lo, hi = window
        spans = [(t, n, max(a, lo), min(b, hi)) for t, n, a, b in spans if b > lo and a < hi]
    else:
        lo = min(a for _, _, a, _ in spans)
        hi = max(b for _, _, _, b in spans)
    lanes = list(reversed(tracks))  # first track on top
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(lanes) + 1.1), dpi=100)
    for t, name, a, b in spans:
        kind = name.split(":")[0]
        ax.broken_barh([(a - lo, max(b - a, (hi - lo) * 1e-4))], (lanes.index(t) - 0.38, 0.76),
                       facecolors=COLOURS.get(kind, "#999999"), edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_xlim(0, hi - lo)
    ax.set_xlabel("ms")
    ax.grid(axis="x", alpha=0.3)
    kinds = sorted({n.split(":")[0] for _, n, _, _ in spans}, key=list(COLOURS).index)
    ax.legend(handles=[Patch(color=COLOURS[k], label=k) for k in kinds if k in COLOURS], ncol=len(kinds),
              loc="upper center", bbox_to_anchor=(0.5, -0.32 if len(lanes) > 3 else -0.45), fontsize=8, frameon=False)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("out")
    ap.add_argument("--window", help="START_MS:END_MS of the trace to draw (default: all of it)")
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    window = tuple(float(x) for x in args.window.split(":")) if args.window else None
    with open(args.trace) as f:
        render(json.load(f), args.out, window, args.title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
