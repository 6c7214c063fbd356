"""The HTTP API (``vlmq serve``): tasks, jobs, OpenAI-compatible files and batches.

Producer side only; see :func:`producers.api.app.create_app`.
"""
