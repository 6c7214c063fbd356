"""Fault material shared by the test suite and ``bench/``: a fleet harness with real processes,
the fault scenarios, and the hostile-input corpus."""
