"""Fixtures the fault suites share."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
from celery import Celery

from tests.support.fleet import Processes


@pytest.fixture
def celery_app(fleet: Processes) -> Iterator[Celery]:
    """A web app's Celery app on the test module's ``fleet`` (its broker and backend)."""
    app = fleet.celery_app()
    yield app
    gc.collect()  # results a get() subscribed for unsubscribe while Redis is still up
    app.close()
