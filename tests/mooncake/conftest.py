import pytest

from support.netns import Namespace


@pytest.fixture
def ns(tmp_path):
    """A fresh private network namespace per test (so every port is free in it)."""
    try:
        n = Namespace()
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)     # never a silent skip: CI runs these as root
    n.logdir = str(tmp_path)
    try:
        yield n
    finally:
        n.close()
