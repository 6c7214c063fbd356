"""``vlmq layout``: the task layout in force, what each live worker reads, and the fleet-wide
switch to a newer one (vlmq/broker/layouts.py; docs/deploy.md, Upgrades)."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from vlmq.config.settings import Settings
from vlmq.producers.client import Client
from vlmq.producers.failures import reported, this_command

__all__ = ["layout"]


def _workers_reads(records: dict[str, dict[str, Any]]) -> dict[str, list[int]]:
    """Each live worker's layouts, as its record lists them (none listed: a version older
    than the switch, which reads layout 1)."""
    return {name: list(record.get("layouts") or [1]) for name, record in sorted(records.items())}


@click.command("layout")
@click.option(
    "--raise",
    "raise_to",
    type=int,
    default=None,
    help="Put this layout in force; refused while a live worker does not read it.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def layout(raise_to: int | None, as_json: bool) -> None:
    """The task layout in force and the layouts each live worker reads; with --raise, the
    fleet-wide switch to a newer one (exit 1 when refused)."""
    with reported(this_command(), "the layout in force was not changed"):
        state = Client(Settings()).state
        behind: list[str] = []
        if raise_to is not None:
            _, behind = state.layouts.raise_to(raise_to)
        in_force = state.layouts.in_force()
        workers = _workers_reads(state.workers.all())
    report = {
        "in_force": in_force,
        "this_version_reads": list(state.layouts.reads),
        "workers": workers,
        "behind": behind,
    }
    if as_json:
        click.echo(json.dumps(report, indent=2, sort_keys=True))
    else:
        _echo(report, raise_to)
    sys.exit(1 if behind else 0)


def _echo(report: dict[str, Any], raise_to: int | None) -> None:
    click.echo(f"layout in force: {report['in_force']}")
    click.echo(f"this version reads: {', '.join(map(str, report['this_version_reads']))}")
    if report["in_force"] not in report["this_version_reads"]:
        click.echo(
            f"this version does not read layout {report['in_force']}: update it "
            "(docs/deploy.md, Upgrades)",
            err=True,
        )
    click.echo(f"live workers: {len(report['workers'])}")
    for name, reads in report["workers"].items():
        click.echo(f"  {name}: reads {', '.join(map(str, reads))}")
    if raise_to is None:
        return
    if report["behind"]:
        click.echo(
            f"not raised: {len(report['behind'])} live worker(s) do not read layout {raise_to} "
            f"({', '.join(report['behind'])}); update them, or wait until a stopped one's "
            "record is forgotten",
            err=True,
        )
    elif report["in_force"] > raise_to:
        click.echo(f"layout {report['in_force']} is in force already; layouts are never lowered")
