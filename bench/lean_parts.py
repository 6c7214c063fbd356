"""What each part of the redesign's model costs Redis per task, by taking it out.

    python -m bench.lean_parts [--tasks 2000] [--batch 32] [--write bench/README.md]

The model of vlmq's redesign (``bench/floor/lean_*.lua``, bench.redis_floor's ``lean``
design) runs once as it is and once per part below with that part taken out of a copy of its
scripts (a named text edit; the run stops if a script no longer has the text), one client,
callgrind's count of the instructions redis-server executes per task in each phase
(deterministic, so a part of 1 % shows). Without a part the model breaks what the part is for:
the copies are for measuring only, to show where a redesigned pull spends.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import bench.redis_floor as floor
from bench.common import ablate, ablation_args, command_line, machine, publish

MARKER = "lean-parts"
PHASES = ("enqueue", "pull", "start", "settle")


@dataclass(frozen=True)
class Part:
    name: str
    what: str  # what the model has it for
    edits: tuple[tuple[str, str], ...]  # (old, new) in lean_pull.lua


PARTS = (
    Part(
        "origins",
        "a held task's list and fair-share zset, for a give-back to put it back",
        (
            (
                "  redis.call('HSET', KEYS[3], unpack(origins))\n"
                "  if #zsets > 0 then redis.call('HSET', KEYS[4], unpack(zsets)) end\n",
                "",
            ),
        ),
    ),
    Part(
        "in-flight copy",
        "a held task's message, for a give-back or reap to queue it again",
        (("  redis.call('HSET', KEYS[1], unpack(inflight))\n", ""),),
    ),
    Part(
        "kept reply",
        "a pull's ids and tokens, for a retry of a call whose reply was lost",
        (("  redis.call('SET', KEYS[7], cjson.encode(keep), 'EX', 60)\n", ""),),
    ),
    Part(
        "live-holder check",
        "a copy of a task that a live holder has is dropped",
        (
            (
                "local leased = redis.call('ZMSCORE', KEYS[2], unpack(ids))",
                "local leased = {}",
            ),
        ),
    ),
    Part(
        "message and status in the rows",
        "the worker gets each task's message and the status it decides on",
        (
            (
                "out[o + 1], out[o + 2], out[o + 3], out[o + 4] = ids[i], raws[i], token, lists[i]",
                "out[o + 1], out[o + 2], out[o + 3], out[o + 4] = ids[i], '', token, ''",
            ),
            (
                "out[o + 5], out[o + 6], out[o + 7], out[o + 8] = state, attempts, job, stamp",
                "out[o + 5], out[o + 6], out[o + 7], out[o + 8] = '', '', '', ''",
            ),
        ),
    ),
    Part(
        "fixed lists",
        "the interactive and prepared lanes, popped before fair share (empty here)",
        (("for i = 8, #KEYS do", "for i = 8, 7 do"),),
    ),
)


def copy_without(part: Part | None, into: Path) -> Path:
    """The model's scripts under ``into``, with ``part``'s edits applied."""
    for script in floor.SCRIPTS.glob("lean_*.lua"):
        shutil.copy(script, into)
    path = into / "lean_pull.lua"
    text = path.read_text(encoding="utf-8")
    for old, new in part.edits if part else ():
        if text.count(old) != 1:
            raise SystemExit(f"{part.name if part else ''}: lean_pull.lua no longer has the text")
        text = text.replace(old, new)
    path.write_text(text, encoding="utf-8")
    return into


def measure(part: Part | None, tasks: int, batch: int) -> dict[str, float]:
    """Instructions per task per phase of the model without ``part`` (None: as it is)."""
    scripts = floor.SCRIPTS
    with tempfile.TemporaryDirectory() as tmp:
        floor.SCRIPTS = copy_without(part, Path(tmp))
        try:
            return floor.run_design("lean", tasks, batch, True)
        finally:
            floor.SCRIPTS = scripts


def render(
    whole: dict[str, float],
    without: dict[str, dict[str, float]],
    args: argparse.Namespace,
    command: str,
) -> str:
    total = sum(whole[p] for p in PHASES)
    lines = [
        f"Command: `{command}`",
        "",
        f"Machine: {machine()}. {args.tasks:,} text tasks, batches of {args.batch}, one client, "
        f"instructions per task (callgrind); the model as it is: {total:,.0f} (pull "
        f"{whole['pull']:,.0f}, settle {whole['settle']:,.0f}).",
        "",
        "| part of the pull | what it is for | pull | settle | both | of the model's |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for part in PARTS:
        out = without[part.name]
        pull, settle = whole["pull"] - out["pull"], whole["settle"] - out["settle"]
        lines.append(
            f"| {part.name} | {part.what} | {pull:,.0f} | {settle:,.0f} | "
            f"{pull + settle:,.0f} | {(pull + settle) / total:.1%} |"
        )
    lines += [
        "",
        "Each run draws its own ids and times, so a phase moves by up to ~600 instructions a task "
        "between runs: a figure that small, or below 0, is no cost.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = ablation_args(__doc__, argv)
    parts = {part.name: part for part in PARTS}

    def measure_part(name: str | None) -> dict[str, float]:
        return measure(parts[name] if name else None, args.tasks, args.batch)

    whole, without = ablate(list(parts), measure_part)
    command = command_line("bench.lean_parts", argv).strip()
    publish(render(whole, without, args, command), args.write, MARKER)


if __name__ == "__main__":
    main()
