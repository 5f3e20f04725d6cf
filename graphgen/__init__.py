"""graphgen: declarative graph compilation for LLM inference with an asynchronous KV-cache pool.

Importing the package is cheap and torch-free; ``graphgen.Engine`` (the runtime) imports torch on
first use.
"""

__version__ = "0.1.0"
__all__ = ["Engine", "__version__"]


def __getattr__(name):
    if name == "Engine":
        from .runtime.engine.engine import Engine  # noqa: F401  (also graphgen.runtime.Engine)

        return Engine
    raise AttributeError(f"module 'graphgen' has no attribute {name!r}")
