"""The lost-replies drill at CI size (tests/support/reply_drill.py): one reply in twenty lost,
on every connection of every process, while bulk and interactive submissions, the API, a
client and two workers run; nothing is applied twice, nothing is lost, nothing cancelled runs.
The full-size figures: ``python -m bench.faults --drill replies`` (docs/reliability.md)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.fleet import Processes
from tests.support.reply_drill import run_reply_drill
from tests.support.replydrop import ReplyDropProxy


@pytest.fixture
def fleet(redis_server: Any, moto_server: Any, tmp_path: Path) -> Iterator[Processes]:
    processes = Processes(redis_server.url, moto_server, tmp_path)
    yield processes
    processes.stop()


def test_one_reply_in_twenty_lost_everywhere_changes_nothing(
    fleet: Processes, redis_server: Any, tmp_path: Path
) -> None:
    with ReplyDropProxy(redis_server.port) as proxy:
        figures = run_reply_drill(fleet, proxy, tmp_path)
    assert figures.replies_dropped >= 10, figures  # the drill did lose replies
    assert figures.violations == [], figures.violations[:20]
    assert (figures.writes_applied_twice, figures.results_lost, figures.cancelled_that_ran) == (
        0,
        0,
        0,
    )
