"""Helpers shared by the test folders (``pythonpath = ["tests"]`` in pyproject.toml makes this package
importable as ``support``; subprocesses get ``tests/`` on their ``PYTHONPATH`` from ``support.cli``):

- `paths`: the repository root and the shipped tiny specs;
- `cli`: ``graphgen`` in a subprocess (and ``graphgen run --json`` -> tokens);
- `inproc`: the same commands in this interpreter (``cli_inproc``: same return shape, output captured,
  process state restored; see its module doc for what it guarantees);
- `engines`: multi-rank engines shared by a session's tests (the ``rank_engines`` fixture; its rules);
- `hf`: tiny random Hugging Face checkpoints and the transformers references the tests compare to;
- `hooks`: ``source_hook`` mutations of generated code (negative controls);
- `gates`: a gate a rank process's save or put can wait on (a file the test creates);
- `npu_limits`: the NPU kernel-limit cases (one table for the spec check and the CLI);
- `jsonl`: the command loop of the worker processes driven through a pipe;
- `netns`: a private network namespace with Mooncake processes in it;
- `servers`: real ``graphgen serve`` processes, one per distinct set of flags (``ServerFactory``, the
  ``servers`` fixture of tests/serve/conftest.py; docs/testing.md "Servers");
- `chat_ckpt`: a tiny checkpoint trained to answer with a thought and a tool call.

The session-scoped checkpoints themselves are fixtures of ``tests/conftest.py``.
"""
