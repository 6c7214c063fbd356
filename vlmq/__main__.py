"""``python -m vlmq``: the ``vlmq`` command line."""

from vlmq.producers.cli import main

main()
