"""``make test`` and ``make test-quick``: the suite tier by tier, each tier in a pytest run of
its own (with the parallelism measured best for it), then each tier's wall time and the
slowest tests of the whole run.

    python -m tests.tiers [--tiers unit,integration] [--slowest 20] [pytest arguments...]

Every tier runs even when an earlier one failed; the exit status is the first failing tier's.
The tiers share one folder of tiny checkpoints (``VLMQ_TEST_CHECKPOINTS``), so each is built
once per run, and each tier writes its tests' durations into ``VLMQ_TEST_DURATIONS``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Per tier, what its pytest run adds: pytest-xdist's two processes where they measured faster
# on two cores (docs/testing.md): not for unit (torch already keeps both cores busy) nor for
# vllm (one engine keeps both busy), but for the tiers that wait on Redis, S3 and worker
# processes.
TIER_OPTIONS: dict[str, list[str]] = {
    "unit": [],
    "integration": ["-n", "2"],
    "e2e": ["-n", "2"],
    "faults": ["-n", "2"],
    "vllm": [],
}
ALL = tuple(TIER_OPTIONS)
# pytest's exit status when a tier selected no test (a -k that matches nothing in it).
NO_TESTS = 5


@dataclass
class TierRun:
    tier: str
    status: int
    wall_s: float


def _run_tier(tier: str, pytest_args: list[str], env: dict[str, str]) -> TierRun:
    command = [sys.executable, "-m", "pytest", f"tests/{tier}", *TIER_OPTIONS[tier], *pytest_args]
    print(f"\n=== {tier}: {' '.join(command[1:])}", flush=True)
    started = time.monotonic()
    status = subprocess.call(command, cwd=ROOT, env=env)
    return TierRun(tier, status, time.monotonic() - started)


def _durations(folder: Path) -> list[tuple[float, str]]:
    found: list[tuple[float, str]] = []
    for path in folder.glob("*.json"):
        found += [(float(s), n) for n, s in json.loads(path.read_text()).items()]
    return sorted(found, reverse=True)


def _report(runs: list[TierRun], durations: list[tuple[float, str]], slowest: int) -> None:
    if slowest and durations:
        print(f"\n=== the {min(slowest, len(durations))} slowest tests (setup + call + teardown)")
        for spent, nodeid in durations[:slowest]:
            print(f"{spent:8.2f}s  {nodeid}")
    print("\n=== wall time per tier")
    for run in runs:
        outcome = "ok" if run.status in (0, NO_TESTS) else f"FAILED ({run.status})"
        print(f"{run.tier:<12} {run.wall_s:8.1f}s  {outcome}")
    print(f"{'total':<12} {sum(r.wall_s for r in runs):8.1f}s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiers", default=",".join(ALL), help="comma list (default: all)")
    parser.add_argument("--slowest", type=int, default=20, help="how many slowest tests to list")
    args, pytest_args = parser.parse_known_args(argv)
    tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    unknown = set(tiers) - set(ALL)
    if unknown:
        parser.error(f"unknown tiers {sorted(unknown)}; expected some of {', '.join(ALL)}")
    with tempfile.TemporaryDirectory(prefix="vlmq-tests-") as scratch:
        env = dict(os.environ)
        env.setdefault("VLMQ_TEST_CHECKPOINTS", str(Path(scratch) / "checkpoints"))
        env["VLMQ_TEST_DURATIONS"] = str(Path(scratch) / "durations")
        runs = [_run_tier(tier, pytest_args, env) for tier in tiers]
        _report(runs, _durations(Path(env["VLMQ_TEST_DURATIONS"])), args.slowest)
    failed = [r.status for r in runs if r.status not in (0, NO_TESTS)]
    return failed[0] if failed else 0


if __name__ == "__main__":
    sys.exit(main())
