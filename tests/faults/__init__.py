"""Fault suites: hostile input (bad_input) and other failure drills."""
