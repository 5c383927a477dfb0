"""The numpy formulas behind tools/ref_losses.py (other.py: SDPO, DPO, advantages)."""
