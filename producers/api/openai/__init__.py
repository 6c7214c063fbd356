"""The OpenAI surface of the API: Files, Batches, chat completions and models, with the
objects the official client parses (``objects.py``) and the answer mapping (``mapping.py``)."""
