"""Preemption drain: how soon a signalled worker's work starts elsewhere; writes the Drain
section of docs/reliability.md.

    python -m bench.drain --drills 10 [--write docs/reliability.md]

Real processes (``tests/support/faults/drain.py``): worker A holds a batch of 8 inside a 60 s
engine call (noop engine), worker B beside it is idle. Each drill signals A and times, on
Redis's clock, the signal to the last of A's tasks starting on B. ``term``: SIGTERM, then
SIGKILL 10 s later if A still lives, as a spot node does (A drains: it hands the batch back in
one call). ``kill``: SIGKILL only (no drain: the batch comes back when its lease lapses and a
reaper puts it back). Both with a 3 s lease and a 0.5 s reap interval, alternating, ``--drills``
of each; lost (not succeeded) and run twice (two workers report its success) are counted.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import asdict
from pathlib import Path

from bench.common import machine, replace_section
from tests.support.faults.drain import Drill, Standby, drill, figures
from tests.support.faults.harness import Harness

MARKER = "drain"
TASKS, ENGINE_S, KILL_AFTER_S, LEASE_S = 8, 60.0, 10.0, 3.0


def run(drills: int) -> dict[str, list[Drill]]:
    results: dict[str, list[Drill]] = {"term": [], "kill": []}
    with Harness(Path(tempfile.mkdtemp(prefix="vlmq-drain-"))) as harness:
        standby = Standby(harness, VLMQ_FLEET__LEASE_S=str(LEASE_S))
        number = 0
        for _ in range(drills):
            for mode in ("term", "kill"):
                number += 1
                outcome = drill(
                    harness,
                    standby,
                    number,
                    mode=mode,
                    tasks=TASKS,
                    engine_s=ENGINE_S,
                    kill_after_s=KILL_AFTER_S,
                    lease_s=LEASE_S,
                )
                print(json.dumps(asdict(outcome)), flush=True)
                results[mode].append(outcome)
    return results


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(results: dict[str, list[Drill]], drills: int) -> str:
    lines = [
        f"Command: `python -m bench.drain --drills {drills}`. Machine: {machine()}. Worker A "
        f"holds a batch of {TASKS} inside a {ENGINE_S:.0f} s engine call (noop engine), worker "
        f"B is idle; lease {LEASE_S:.0f} s, reap every 0.5 s, drain window 25 s. Time: the "
        "signal to the last of A's tasks starting on B, on Redis's clock.",
        "",
        "| signal | drills | median s | min s | max s | lost | run twice | not all started |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    names = {
        "term": f"SIGTERM, SIGKILL {KILL_AFTER_S:.0f} s later (drain)",
        "kill": "SIGKILL only (lease + reap)",
    }
    for mode, label in names.items():
        f = figures(results[mode])
        lines.append(
            f"| {label} | {f['drills']} | {_cell(f['median_s'])} | {_cell(f['min_s'])} | "
            f"{_cell(f['max_s'])} | {f['lost']} | {f['run_twice']} | {f['incomplete']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--drills", type=int, default=10)
    parser.add_argument("--write", default=None, help="docs/reliability.md")
    args = parser.parse_args()
    results = run(args.drills)
    text = table(results, args.drills)
    print(text)
    if args.write:
        replace_section(Path(args.write), MARKER, text)


if __name__ == "__main__":
    main()
