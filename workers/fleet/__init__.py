"""The fleet side of a worker: intake from Redis, status, results, the batch loop."""
