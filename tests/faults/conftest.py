"""Fixtures the fault suites share."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery

from tests.support.faults.harness import Harness
from tests.support.fleet import Processes
from tests.support.services import MotoServer


@pytest.fixture
def harness(tmp_path: Path, moto_server: MotoServer) -> Iterator[Harness]:
    """A drill's harness: its own Redis, a bucket of its own on the session's moto (behind its
    own breakable proxy), its worker processes killed at the end."""
    with Harness(tmp_path, moto=moto_server) as h:
        yield h


@pytest.fixture
def celery_app(fleet: Processes) -> Iterator[Celery]:
    """A web app's Celery app on the test module's ``fleet`` (its broker and backend)."""
    app = fleet.celery_app()
    yield app
    gc.collect()  # results a get() subscribed for unsubscribe while Redis is still up
    app.close()
