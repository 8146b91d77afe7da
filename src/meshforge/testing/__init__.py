"""Test support shipped with the package: the parity harness (run configs on N gloo processes, compare)."""
