"""``graphgen route``: the P/D router (`app`); the backend-choosing policies it uses are
`graphgen.balance` (shared with the data-parallel engine). Torch-free: it only moves HTTP."""
