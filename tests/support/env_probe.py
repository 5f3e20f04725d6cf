"""A torch-free child body for tests/npu/test_startup.py: reports one variable of the environment it started in."""
import os


def probe(q, name: str) -> None:
    q.put(os.environ.get(name))
