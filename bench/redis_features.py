"""What each of vlmq's features past the guarantees costs Redis per task, by taking it out.

    python -m bench.redis_features [--tasks 2000] [--batch 32] [--write bench/README.md]

For each feature below, a copy of this tree's Lua with that feature's writes taken out (a
named text edit of ``vlmq/broker/lua``; the run stops if the source no longer has the text)
goes through ``bench.redis_phases``'s probe beside the tree as it is: one client, fed tasks,
callgrind's count of the instructions redis-server executes per task (deterministic, so a
feature of 1 % shows). The copies are for measuring only: without a feature vlmq breaks the
guarantee or the surface that feature is for, so no such switch exists in the product.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.common import ablate, ablation_args, command_line, machine, publish
from bench.redis_phases import run_probe, vlmq_total

ROOT = Path(__file__).resolve().parents[1]
MARKER = "redis-features"
# vlmq/'s links to the tree's top-level packages (the copy's vlmq/ keeps them relative).
LINKED = ("config", "examples", "producers", "workers")


@dataclass(frozen=True)
class Edit:
    file: str  # in vlmq/broker/lua
    old: str
    new: str


@dataclass(frozen=True)
class Feature:
    name: str
    what: str  # what vlmq has it for
    edits: tuple[Edit, ...]


FEATURES = (
    Feature(
        "kept replies",
        "a call not safe to repeat keeps its reply for a lost reply's retry",
        (
            Edit(
                "dispatch.lua",
                "if replay_key ~= '' then\n    local kept = keep",
                "if false then\n    local kept = keep",
            ),
        ),
    ),
    Feature(
        "usage",
        "a settle sums each task's tokens, model and GPU time and cost per job and tenant",
        (
            Edit(
                "tasks.lua",
                "  count_groups(sums, groups, ctx.jobs, ARGV[5])\n"
                "  write_sums(sums, ARGV[6], ctx.ttl)\n",
                "",
            ),
            Edit(
                "tasks.lua",
                "if group and held == 1 and moved == 1 then note_usage",
                "if false then note_usage",
            ),
        ),
    ),
    Feature(
        "completion list",
        "a job lists its finished tasks in order, for results read while it runs",
        (
            Edit(
                "tasks.lua",
                "local function push_finished(jobkey, ids, keep, ttl)\n",
                "local function push_finished(jobkey, ids, keep, ttl)\n  if true then return end\n",
            ),
        ),
    ),
    Feature(
        "job upkeep at settle",
        "a settle renews its jobs' TTLs and checks whether each finished",
        (
            Edit(
                "tasks.lua",
                "    if ctx.keep then keep_job(jobkey, ctx.ttl, ctx.refs) end\n"
                "    finish_check(jobkey, job, ctx.t, ctx.events)\n",
                "",
            ),
        ),
    ),
    Feature(
        "origins",
        "a held task's list and tenant zset, so a give-back or reap puts it back where it was",
        (
            Edit(
                "intake.lua",
                "    call_many('HSET', KEYS[3], origins, 2)\n"
                "    if #actives > 0 then call_many('HSET', KEYS[4], actives, 2) end\n",
                "",
            ),
        ),
    ),
    Feature(
        "a task hash's own TTL",
        "a task's status expires on its own, whatever happens to its job",
        (
            Edit(
                "jobs.lua",
                "  redis.call('HSET', key, unpack(args, 1, n))\n"
                "  redis.call('PEXPIREAT', key, common.expire_at)\n",
                "  redis.call('HSET', key, unpack(args, 1, n))\n",
            ),
        ),
    ),
)


def copy_without(feature: Feature, into: Path) -> Path:
    """This tree's vlmq/ under ``into`` with ``feature``'s edits applied; returns the tree."""
    shutil.copytree(ROOT / "vlmq", into / "vlmq", symlinks=True)
    for name in LINKED:
        (into / name).symlink_to(ROOT / name)
    for edit in feature.edits:
        path = into / "vlmq" / "broker" / "lua" / edit.file
        text = path.read_text(encoding="utf-8")
        if text.count(edit.old) != 1:
            raise SystemExit(f"{feature.name}: {edit.file} no longer has the text to take out")
        path.write_text(text.replace(edit.old, edit.new), encoding="utf-8")
    return into


def render(
    whole: dict[str, float],
    without: dict[str, dict[str, float]],
    args: argparse.Namespace,
    command: str,
) -> str:
    base = vlmq_total(whole)
    lines = [
        f"Command: `{command}`",
        "",
        f"Machine: {machine()}. {args.tasks:,} text tasks (fed), batches of {args.batch}, one "
        "client, instructions per task (callgrind) of enqueue + pull + start + settle: "
        f"{base:,.0f} as vlmq is.",
        "",
        "| feature | what it is for | instructions per task | of vlmq's |",
        "| --- | --- | ---: | ---: |",
    ]
    saved_all = 0.0
    for feature in FEATURES:
        saved = base - vlmq_total(without[feature.name])
        saved_all += saved
        lines.append(f"| {feature.name} | {feature.what} | {saved:,.0f} | {saved / base:.1%} |")
    lines.append(f"| **all of them** | | **{saved_all:,.0f}** | **{saved_all / base:.1%}** |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = ablation_args(__doc__, argv)
    features = {feature.name: feature for feature in FEATURES}

    def measure(name: str | None) -> dict[str, float]:
        if name is None:
            return run_probe(ROOT, args.tasks, args.batch, "fed", True)
        with tempfile.TemporaryDirectory() as tmp:
            tree = copy_without(features[name], Path(tmp))
            return run_probe(tree, args.tasks, args.batch, "fed", True)

    whole, without = ablate(list(features), measure)
    command = command_line("bench.redis_features", argv).strip()
    publish(render(whole, without, args, command), args.write, MARKER)


if __name__ == "__main__":
    main()
