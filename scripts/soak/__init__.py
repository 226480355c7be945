"""Helpers of ``scripts/dp_soak.py``: the request plan, the per-rank driver, the CPU fakes."""
