"""textkit: small text, number and sequence helpers (the source of the repository tasks)."""
