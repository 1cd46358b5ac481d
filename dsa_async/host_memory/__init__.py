"""Host memory: the budget, the machine-wide ledger, pool sizing, arenas and extents."""
