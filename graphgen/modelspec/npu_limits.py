"""The NPU kernels' documented limits as spec diagnostics (``graphgen validate``).

``graphgen.npu.check.speclimits.check_spec_limits`` says which spec field would make a generated NPU module
call a kernel outside a documented limit (``(field_path, message, source)``); this module turns each
into a :class:`Diagnostic` at that field's ``file:line:col`` -- located the way the loader locates its
own and the compatibility rules' errors -- naming the limit and its source line in the torch-npu docs.

Run by ``graphgen validate`` only, not by ``generate``/``check``: the limits concern the hardware the
NPU target runs on, not whether the generated code is in sync (a spec may generate NPU code for
structure tests while being outside the hardware envelope). Torch-free, like the whole build path.
"""

from __future__ import annotations

from pathlib import Path

from .errors import Diagnostic


def limit_diagnostics(path, spec=None) -> list[Diagnostic]:
    """Every documented NPU kernel limit the spec at ``path`` breaks ([] without ``targets.npu``)."""
    from ..npu.check.speclimits import check_spec_limits
    from .loader import _load, _locate

    loaded, root = _load(Path(path))
    found = check_spec_limits(spec if spec is not None else loaded)
    out = []
    for field_path, message, source in found:
        line, col = _locate(root, field_path)
        out.append(Diagnostic(str(path), line, col, f"{field_path}: NPU kernel limit: {message} (source: {source})",
                              f"change {field_path} to a value inside the documented limit, or remove the npu "
                              f"target (targets.npu) if this spec is not meant for Ascend hardware"))
    return out
