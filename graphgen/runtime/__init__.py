"""The CPU runtime: executing generated graphs (the ``runtime`` extra: torch, safetensors, numpy).

Importing any part of it without that extra fails here, with one sentence naming the extra, rather
than deep inside a submodule with a bare ``No module named 'torch'``.
"""

from ..install import require

require("runtime", "graphgen.runtime")
