"""``graphgen route``: the P/D router (`app`) and the backend-choosing policies (`policy`, shared
with any other router). Torch-free: it only moves HTTP."""
