"""The package's floors, read from the imports in the source (no module is run):

* ``vlmq.config``: the contract, no I/O: it imports no other floor and no client library;
* ``vlmq.broker`` (Redis) and ``vlmq.stores`` (objects): the runtime both sides share, above
  the contract only;
* ``vlmq.producers`` and ``vlmq.workers``: the two sides; no worker module imports a
  producer's (a GPU host runs no producer code, and the producers never need torch)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FLOORS = {
    "config": ROOT / "config",
    "broker": ROOT / "vlmq" / "broker",
    "stores": ROOT / "vlmq" / "stores",
    "producers": ROOT / "producers",
    "workers": ROOT / "workers",
}
# What each floor may import of vlmq, beyond itself.
ALLOWED = {
    "config": set(),
    "broker": {"config", "stores"},
    "stores": {"config"},
    "producers": {"config", "broker", "stores"},
    "workers": {"config", "broker", "stores"},
}
# Imports across floors that are not a layering: the producers' `vlmq examples` writes the
# demo's sample media with the demo's own generator (Pillow and PyAV, no torch), imported lazily.
EXCEPTIONS = {("producers/examples.py", "vlmq.workers.demo.media")}
# Libraries that do I/O: the contract may not import them, even lazily.
IO_LIBRARIES = ("redis", "boto3", "botocore", "kombu", "celery", "httpx", "requests")


def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _floor_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "vlmq" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in FLOORS else None


@pytest.mark.parametrize("floor", sorted(FLOORS))
def test_a_floor_imports_only_the_floors_below_it(floor: str) -> None:
    wrong = []
    for path in sorted(FLOORS[floor].rglob("*.py")):
        for module in _imports(path):
            other = _floor_of(module)
            if other is None or other == floor or other in ALLOWED[floor]:
                continue
            if (str(path.relative_to(ROOT)), module) not in EXCEPTIONS:
                wrong.append(f"{path.relative_to(ROOT)} imports {module}")
    assert wrong == []


def test_the_contract_does_no_io() -> None:
    wrong = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in sorted(FLOORS["config"].rglob("*.py"))
        for module in _imports(path)
        if module.split(".")[0] in IO_LIBRARIES
    ]
    assert wrong == []
