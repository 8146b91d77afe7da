"""Test support shipped with the package: the parity harness (`parity.py`) and many jobs in one process group
(`group.py`), both on the one launcher (`meshforge.launch`)."""
