"""The leaves of a call's argument trees, in the order Dynamo flattens them into graph inputs: one home for the
compile cache's input signature (`graphgen.npu.run.compile.input_signature`) and the stand-in's model of
torchair's first-call ``assert_size_stride`` (`graphgen.npu.standin.fakes`), which must walk alike."""
from __future__ import annotations

import dataclasses

__all__ = ["leaves"]


def leaves(tree, path: str = "", out=None) -> list:
    """``(path, leaf)`` of every leaf of ``tree`` (dicts in insertion order, lists, tuples, dataclasses)."""
    out = [] if out is None else out
    if isinstance(tree, dict):
        for k, v in tree.items():
            leaves(v, f"{path}[{k!r}]", out)
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            leaves(v, f"{path}[{i}]", out)
    elif dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        for f in dataclasses.fields(tree):
            leaves(getattr(tree, f.name), f"{path}.{f.name}", out)
    else:
        out.append((path, tree))
    return out
