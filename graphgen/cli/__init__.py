"""The ``graphgen`` command line (``graphgen``, ``python -m graphgen``, ``python -m graphgen.cli``).

``main.py`` builds the parser from the command modules (``build``: the torch-free build commands;
``run``: the CPU runtime; ``npu``: ``compile``); ``common.py`` holds the exit codes and error
printing.
"""

from .main import main

__all__ = ["main"]
