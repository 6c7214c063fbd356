"""The fleet side of a worker process, one module a job.

* ``service.py``: ``WorkerService`` (lifecycle, heartbeat) and ``compose_loop``, which builds
  every collaborator below and hands them to the loop;
* ``loop.py``: ``BatchLoop``, pull → triage → run → settle per modality class, made of parts:
  ``stages.py`` (``Stages``: what each stage does to a pulled batch; ``batches.py``: what
  travels between them), ``static.py`` and ``continuous.py`` (the drivers of the model's
  thread, chosen by the engine's ``capabilities``), ``pipeline.py`` (stage threads running
  ahead), ``watchdog.py`` (lease renewal, stuck detection), ``clock.py`` (stage timing);
* ``intake.py``: the leased batch pull (``Intake``), the shared lease side (``Leases``) and
  what this worker holds (``Held``);
* ``triage.py``: decode, drop, expire, dead-letter, start; ``work.py``: one pulled message and
  the settlements it ends in; ``suspects.py``: who goes alone and who is given up (only
  deaths count), for the batch loop and the prepare tier alike; ``polling.py``: the loops'
  polling, Redis outages ridden out;
* ``prepare_tier.py``: ``PrepareLoop``, a prepare worker's loop (``--role prepare``);
* ``settle.py``: result objects, then terminal statuses and acknowledgements;
* ``housekeeping.py``: the reaper, job expiry, webhook polling; ``webhooks.py``: delivery;
* ``observer.py``: the loop's hooks, implemented by ``metrics.py`` (Prometheus) and
  ``events.py`` (Celery task events for Flower);
* ``celery_app.py``: the Celery host of the loop.

Task and job status and the result stores are the contract both sides share: ``vlmq.config``.
"""
