"""The node ids this pytest run collected (tests/conftest.py stores them before ``-m``/``-k`` deselect): a test
that names other tests (tests/test_composition.py) checks them against what pytest itself found."""
from __future__ import annotations

import pytest

COLLECTED = pytest.StashKey[frozenset]()
