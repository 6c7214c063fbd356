"""Fault suites: hostile input (test_bad_input) and failure drills with real processes
(test_faults); their material lives in ``tests.support.faults``."""
