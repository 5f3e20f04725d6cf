"""The composition matrix: which features run together on which target, and the one table of refusals.

A *feature* (`FEATURES`) is one thing a launch can turn on: async write, async scheduling, a prefix-cache hit,
chunked prefill, MTP, each parallel dimension, a P/D role, the Mooncake pool, several nodes, W8A8, LoRA,
tool/reasoning parsing, structured output. A *cell* (`Cell`, one frozen row of `CELLS`) is one combination of
them (one to three features) on one or both targets, and says either

- **runs**: the pytest node id of a test that runs the combination on tiny specs and compares its tokens to the
  one-rank / feature-off reference, or
- **refused**: the sentence a launch of it is refused with, and who refuses it: ``spec`` (the spec rules:
  `graphgen validate`, the loader's ``file:line`` errors, and every launch, since a ``--tp``/``--cp`` flag
  bypasses the loader), ``launch`` (``graphgen run``/``serve`` and `open_engine`, before any weight loads) or
  ``request`` (one request, a 400 on the server).

The refused cells *are* the refusal table: `launch_refusal` (run, serve, `open_engine`, the rank bring-up) and
`spec_rules` (the spec loader, `families.parallel.parallel_rules`) read them, and nothing else refuses a
combination of these features. Lifting a refusal is a change of its row here (``refused(...)`` →
``runs(..., "tests/...::test_x")``) plus the runtime's code; ``graphgen generate`` renders the table into
``docs/composition.md`` and ``graphgen check`` fails while that file is stale. A combination with no row is
*untested*: every check accepts it and no test runs it (the doc lists them; nothing claims they work).

Torch-free and import-free of the rest of graphgen (the build path renders it; every runtime asks it).
"""

from __future__ import annotations

from .doc import Verdict, markdown, verdict
from .launch import (BOTH, CHECKS, CPU, FEATURE_NAMES, FEATURES, NPU, TARGETS, Cell, Feature, Launch, example_launch,
                     refused, runs, turned_off)
from .table import (ASYNC_SCHEDULING_DP, CELLS, PD_SHARED_POOL, SEED,
                    SeedCombo, launch_notes, launch_refusal, refusals, sentence_of, spec_rules)

__all__ = ["ASYNC_SCHEDULING_DP", "BOTH", "CELLS", "CHECKS", "CPU", "FEATURES", "FEATURE_NAMES",
           "NPU", "PD_SHARED_POOL", "SEED",
           "TARGETS", "Cell", "Feature", "Launch", "SeedCombo", "Verdict", "example_launch", "launch_notes",
           "launch_refusal", "markdown", "refusals", "refused", "runs", "turned_off", "sentence_of", "spec_rules",
           "verdict"]
