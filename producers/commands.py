"""Producer commands: submit a JSONL file, follow it, collect results, cancel.

None of them imports torch; they need only Redis and the results store.
"""

from __future__ import annotations

import json
import re
import sys
import time
import uuid
from pathlib import Path
from typing import IO, Any

import click

from vlmq.config.settings import Settings
from vlmq.producers.bulk import SubmitReport, submit_jsonl
from vlmq.producers.client import Client
from vlmq.producers.export import (
    iter_errors,
    iter_results,
    job_summary,
    to_openai_error,
    to_openai_output,
)

__all__ = ["cancel", "results", "status", "submit"]

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_window(text: str | None) -> float | None:
    """'24h', '30m', '2d', '90s' or plain seconds."""
    if not text:
        return None
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not match:
        raise click.BadParameter(
            "use e.g. 24h, 30m, 2d or seconds", param_hint="--completion-window"
        )
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


def _client() -> Client:
    return Client(Settings())


def _echo_progress(text: str) -> None:
    click.echo(f"\r{text}\x1b[K", nl=False, err=True)


def _submit_progress(report: SubmitReport) -> None:
    _echo_progress(
        f"enqueued {report.enqueued:,}  skipped {report.skipped:,}  "
        f"bad lines {report.errors:,}  ({report.rate:,.0f}/s)"
    )


def _wait(client: Client, job_id: str, poll_s: float = 1.0) -> dict[str, Any]:
    while True:
        summary = job_summary(client, job_id)
        eta = f"  ETA {summary['eta_s']:.0f}s" if summary.get("eta_s") else ""
        _echo_progress(
            f"{summary['done']:,}/{summary['total']:,} done  "
            f"{summary['counts']['failed']:,} failed  {summary['rate_per_s']:.1f}/s{eta}"
        )
        if summary["state"] not in ("validating", "in_progress", "cancelling"):
            click.echo(err=True)
            return summary
        time.sleep(poll_s)


def write_results(
    client: Client, job_id: str, out: IO[str], errors: IO[str] | None, fmt: str
) -> tuple[int, int]:
    """Succeeded records to ``out``; failures (and bad lines) to ``errors``, or
    to ``out`` as well when no error file is given. Returns (ok, failed)."""
    ok = failed = 0
    for record in iter_results(client, job_id):
        if record.get("status") == "succeeded":
            line = to_openai_output(record) if fmt == "openai" else record
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
            ok += 1
    for record in iter_errors(client, job_id):
        line = to_openai_error(record) if fmt == "openai" else record
        (errors or out).write(json.dumps(line, ensure_ascii=False) + "\n")
        failed += 1
    return ok, failed


def _write_files(client: Client, job_id: str, output: Path, errors: Path | None, fmt: str) -> None:
    with output.open("w", encoding="utf-8") as out:
        if errors is None:
            ok, failed = write_results(client, job_id, out, None, fmt)
        else:
            with errors.open("w", encoding="utf-8") as err:
                ok, failed = write_results(client, job_id, out, err, fmt)
    click.echo(f"{ok:,} results -> {output}; {failed:,} errors -> {errors or output}", err=True)


@click.command("submit")
@click.argument(
    "input_path", metavar="INPUT.jsonl", type=click.Path(dir_okay=False, path_type=Path)
)
@click.option(
    "--job",
    "job_name",
    default=None,
    help="Job id; submitting the same file again with it resumes the job.",
)
@click.option(
    "--priority",
    type=click.Choice(["bulk", "interactive"]),
    default="bulk",
    show_default=True,
    help="interactive: served before every bulk job.",
)
@click.option(
    "--completion-window",
    default="24h",
    show_default=True,
    help="Unfinished tasks expire after this (e.g. 24h, 30m).",
)
@click.option("--webhook", default=None, help="URL called (signed) when the job finishes.")
@click.option("--wait", is_flag=True, help="Follow the job until it finishes.")
@click.option(
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="With --wait: write the results here.",
)
@click.option(
    "--errors",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="With --wait: write failures and bad lines here.",
)
@click.option(
    "--format", "fmt", type=click.Choice(["vlmq", "openai"]), default="vlmq", show_default=True
)
def submit(
    input_path: Path,
    job_name: str | None,
    priority: str,
    completion_window: str,
    webhook: str | None,
    wait: bool,
    output: Path | None,
    errors: Path | None,
    fmt: str,
) -> None:
    """Enqueue every line of a JSONL file (vlmq/HF or OpenAI Batch lines) as one job."""
    client = _client()
    job_id = job_name or uuid.uuid4().hex
    click.echo(job_id)
    with input_path.open(encoding="utf-8") as lines:
        report = submit_jsonl(
            client,
            lines,
            job_id,
            lane=priority,
            completion_window_s=parse_window(completion_window),
            webhook_url=webhook,
            name=job_name,
            base_dir=input_path.resolve().parent,
            on_progress=_submit_progress,
        )
    _submit_progress(report)
    click.echo(err=True)
    if wait:
        summary = _wait(client, job_id)
        click.echo(f"job {job_id}: {summary['state']}", err=True)
        if output is not None:
            _write_files(client, job_id, output, errors, fmt)


@click.command("status")
@click.argument("identifier", metavar="JOB_OR_TASK_ID")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(identifier: str, as_json: bool) -> None:
    """Counts per state, rate and ETA of a job, or the status of one task."""
    client = _client()
    if client.status_db.job_exists(identifier):
        data: dict[str, Any] = {"kind": "job", **job_summary(client, identifier)}
    else:
        data = {"kind": "task", "id": identifier, **client.status_db.task(identifier)}
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True))
        return
    if data["kind"] == "task":
        for key in sorted(data):
            click.echo(f"{key:>14}: {data[key]}")
        return
    counts = "  ".join(f"{k} {v:,}" for k, v in data["counts"].items())
    click.echo(f"job {identifier}: {data['state']}  {data['done']:,}/{data['total']:,} done")
    click.echo(f"  {counts}  bad lines {data['errors']:,}")
    eta = f", ETA {data['eta_s']:.0f}s" if data.get("eta_s") else ""
    click.echo(f"  rate {data['rate_per_s']:.2f}/s{eta}")


@click.command("results")
@click.argument("job_id")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True)
@click.option("--errors", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["vlmq", "openai"]),
    default="vlmq",
    show_default=True,
    help="openai: OpenAI Batch output and error lines.",
)
def results(job_id: str, output: Path, errors: Path | None, fmt: str) -> None:
    """Stream a job's results from the store into JSONL files."""
    client = _client()
    if not client.status_db.job_exists(job_id):
        raise click.ClickException(f"unknown job {job_id}")
    _write_files(client, job_id, output, errors, fmt)


@click.command("cancel")
@click.argument("identifier", metavar="JOB_OR_TASK_ID")
def cancel(identifier: str) -> None:
    """Cancel queued tasks of a job (or one task); running ones finish."""
    cancelled = _client().cancel(identifier)
    click.echo(f"cancelled {cancelled:,} queued tasks")
    sys.exit(0)
