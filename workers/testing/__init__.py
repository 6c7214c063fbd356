"""Test doubles, fixtures and offline checkpoints, for tests, benchmarks and the demo.

Product code paths never import this package, with three deliberate exceptions that are entry
points for exactly this material: ``vlmq demo`` (a private redis-server and the example media),
``vlmq build-tiny-model`` (the offline checkpoints) and ``vlmq worker --engine noop`` (the no-op
engine of the queue benchmarks and fault tests). Nothing here is imported at package import time.
"""
