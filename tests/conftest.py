"""Test tiers are folders: unit (no services), integration (real Redis / S3
server), e2e (real worker processes). Markers are applied by path."""

from __future__ import annotations

from pathlib import Path

import pytest

TIERS = ("unit", "integration", "e2e")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).parts
        for tier in TIERS:
            if tier in parts:
                item.add_marker(getattr(pytest.mark, tier))
