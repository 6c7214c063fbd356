"""What ``vlmq demo`` runs besides the fleet itself: tiny random-weight checkpoints of the real
architectures, built offline (``tiny/``; also ``vlmq build-tiny-model``), and the synthetic
sample media its example requests point at (``media.py``). Worker-side (torch, Pillow, PyAV),
imported only by those commands; the test suite and the benchmarks build on both."""
