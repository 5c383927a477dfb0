"""The upstream calls behind tools/ref_upstream.py, one module per upstream (TRL RLVR, verl,
PRIME-RL, TRL DPO/SDPO) and the shared random batches."""
