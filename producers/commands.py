"""Producer commands: submit a JSONL file, follow it, collect results, cancel.

None of them imports torch; they need only Redis and the results store.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import IO, Any

import click

from vlmq.broker.state.usage import usage_report
from vlmq.config.errors import InvalidRequest, QuotaExceeded
from vlmq.config.ids import check_id
from vlmq.config.settings import Settings
from vlmq.producers.bulk import SubmitReport, submit_jsonl
from vlmq.producers.client import Client
from vlmq.producers.export import job_summary
from vlmq.producers.failures import reported, this_command
from vlmq.producers.finished import lines_to_come
from vlmq.producers.follow import LineWriter, Sinks, cursor_path, read_once
from vlmq.producers.follow import follow as follow_job
from vlmq.producers.staging import StagingProgress
from vlmq.stores.urls import open_store

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


def _submit_progress(report: SubmitReport, media: StagingProgress | None = None) -> None:
    staged = ""
    if media is not None and media.media:
        staged = (
            f"  media: {media.uploaded:,} uploaded ({media.bytes_uploaded / 2**20:,.1f} MiB),"
            f" {media.already_stored:,} already stored"
        )
    _echo_progress(
        f"read {report.lines:,} lines ({report.rate:,.0f}/s)  valid {report.valid:,}  "
        f"bad {report.errors:,}  enqueued {report.enqueued:,}  skipped {report.skipped:,}" + staged
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
    """Every finished line, in the order they finished: succeeded records to ``out``;
    failures (and bad lines) to ``errors``, or to ``out`` as well when no error file is
    given. Returns (ok, failed)."""
    writer = LineWriter(out.write, errors.write if errors else None, fmt)
    read_once(client, job_id, writer)
    return writer.ok, writer.failed


def _write_files(client: Client, job_id: str, output: Path, errors: Path | None, fmt: str) -> None:
    with output.open("w", encoding="utf-8") as out:
        if errors is None:
            ok, failed = write_results(client, job_id, out, None, fmt)
        else:
            with errors.open("w", encoding="utf-8") as err:
                ok, failed = write_results(client, job_id, out, err, fmt)
    click.echo(f"{ok:,} results -> {output}; {failed:,} errors -> {errors or output}", err=True)


@click.command("submit")
@click.argument("input_path", metavar="INPUT.jsonl|s3://BUCKET/KEY.jsonl")
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
@click.option(
    "--dry-run",
    is_flag=True,
    help="Enqueue nothing: estimate lines, invalid lines, modality mix, tokens and ETA.",
)
@click.option("--json", "as_json", is_flag=True, help="With --dry-run: the estimate as JSON.")
@click.option(
    "--processes",
    type=click.IntRange(0, 64),
    default=0,
    help="Processes validating the file (0: one per core for files over 32 MiB, else one).",
)
@click.option(
    "--allow-media-outside-input-dir",
    "allow_outside",
    is_flag=True,
    help="Let relative media paths lead out of the input file's folder ('..', symlinks).",
)
def submit(
    input_path: str,
    job_name: str | None,
    priority: str,
    completion_window: str,
    webhook: str | None,
    wait: bool,
    output: Path | None,
    errors: Path | None,
    fmt: str,
    dry_run: bool,
    as_json: bool,
    processes: int,
    allow_outside: bool,
) -> None:
    """Enqueue every line of a JSONL file (vlmq/HF or OpenAI Batch lines) as one job.

    The file is validated and staged in one pass (local media uploaded to the media store;
    relative paths resolve against the file's folder and stay inside it), then fed to the
    fleet a window at a time; an object in S3 is read where it is, and the local paths its
    lines name are never read (each such line fails alone)."""
    if dry_run:
        if input_path.startswith("s3://"):
            raise click.ClickException("--dry-run reads a local file")
        _dry_run(Path(input_path), as_json, allow_outside)
        return
    job_id = job_name or uuid.uuid4().hex
    click.echo(job_id)
    # The same file under the same job id resumes the job (what was enqueued is skipped).
    again = this_command() if job_name else this_command("--job", job_id)
    with reported(again, f"job {job_id} is safe (what was enqueued stays enqueued and runs)"):
        _submit(
            input_path,
            job_id,
            job_name,
            priority,
            completion_window,
            webhook,
            processes,
            allow_outside,
            wait,
            output,
            errors,
            fmt,
        )


def _submit(
    input_path: str,
    job_id: str,
    job_name: str | None,
    priority: str,
    completion_window: str,
    webhook: str | None,
    processes: int,
    allow_outside: bool,
    wait: bool,
    output: Path | None,
    errors: Path | None,
    fmt: str,
) -> None:
    client = _client()
    staged: dict[str, StagingProgress] = {}  # the stager's latest snapshot, shown with lines

    def keep(progress: StagingProgress) -> None:
        staged["latest"] = progress

    def show(report: SubmitReport) -> None:
        _submit_progress(report, staged.get("latest"))

    client.stager.on_progress = keep
    client.stager.allow_outside_base = allow_outside

    with _input_lines(client, input_path) as (lines, base_dir):
        try:
            report = submit_jsonl(
                client,
                lines,
                job_id,
                lane=priority,
                completion_window_s=parse_window(completion_window),
                webhook_url=webhook,
                name=job_name,
                base_dir=base_dir,
                on_progress=show,
                stager=client.stager,
                processes=processes or _processes_for(input_path),
                remote_input=input_path.startswith("s3://"),
            )
        except (QuotaExceeded, InvalidRequest) as exc:  # the tenant's quota, a bad job id
            click.echo(err=True)
            raise click.ClickException(f"job {job_id} was not submitted: {exc.message}") from None
    show(report)
    click.echo(err=True)
    if report.validation_error:
        raise click.ClickException(f"job {job_id} failed validation: {report.validation_error}")
    if wait:
        summary = _wait(client, job_id)
        click.echo(f"job {job_id}: {summary['state']}", err=True)
        if output is not None:
            _write_files(client, job_id, output, errors, fmt)


def _processes_for(source: str) -> int:
    """Validation is CPU-bound Python: a big local file is checked by a process per core
    (up to 4; starting one costs ~1 s, so a small file keeps to this one)."""
    path = Path(source)
    big = not source.startswith("s3://") and path.is_file() and path.stat().st_size > 32 * 2**20
    return min(4, os.cpu_count() or 1) if big else 1


@contextlib.contextmanager
def _input_lines(client: Client, source: str) -> Iterator[tuple[Iterator[str], Path | None]]:
    """The lines of a local file (media paths resolve against its folder) or of an object in
    S3, read as a stream; undecodable bytes fail their line alone."""
    if source.startswith("s3://"):
        bucket, _, key = source.removeprefix("s3://").partition("/")
        settings = client.settings
        store = open_store(f"s3://{bucket}", settings.s3_endpoint_url, settings.s3_region)
        if store.size(key) is None:
            raise click.ClickException(f"{source} does not exist")
        yield (raw.decode("utf-8", errors="replace") for _, raw in store.lines(key)), None
        return
    path = Path(source)
    if not path.is_file():
        raise click.ClickException(f"{source} is not a file")
    with path.open(encoding="utf-8", errors="replace") as lines:
        yield lines, path.resolve().parent


def _fleet_rates(settings: Settings) -> Any:
    """The fleet's measured rate from the workers' heartbeats: one read, never a write."""
    from redis import RedisError

    from vlmq.broker.connection import create_redis
    from vlmq.producers.preflight import FleetRates, read_fleet_rates

    redis = create_redis(settings, timeout_s=5.0)
    try:
        return read_fleet_rates(redis, settings)
    except RedisError as exc:
        return FleetRates(reason=f"Redis unreachable ({type(exc).__name__})")
    finally:
        redis.close()


def _dry_run(input_path: Path, as_json: bool, allow_outside: bool = False) -> None:
    """Read the whole file through a Preflight; no job is opened, nothing is enqueued."""
    from vlmq.producers.preflight import Preflight, format_summary

    if not input_path.is_file():
        raise click.ClickException(f"{input_path} is not a file")
    settings = Settings()
    preflight = Preflight(settings, allow_outside_base=allow_outside)
    # Undecodable bytes fail their line alone, as in a real submit.
    with input_path.open(encoding="utf-8", errors="replace") as lines:
        preflight.add_lines(lines, base_dir=input_path.resolve().parent)
    report = preflight.report(_fleet_rates(settings))
    click.echo(json.dumps(report, indent=2, sort_keys=True) if as_json else format_summary(report))


@click.command("status")
@click.argument("identifier", metavar="JOB_OR_TASK_ID")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(identifier: str, as_json: bool) -> None:
    """Counts per state, rate and ETA of a job, or the status of one task."""
    with reported(this_command(), "nothing was changed"):
        _status(identifier, as_json)


def _status(identifier: str, as_json: bool) -> None:
    client = _client()
    if client.state.jobs.exists(identifier):
        data: dict[str, Any] = {"kind": "job", **job_summary(client, identifier)}
    else:
        data = {"kind": "task", "id": identifier, **client.state.tasks.get(identifier)}
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
    if data.get("validation_error"):
        click.echo(f"  failed validation: {data['validation_error']}")
    eta = f", ETA {data['eta_s']:.0f}s" if data.get("eta_s") else ""
    click.echo(f"  rate {data['rate_per_s']:.2f}/s{eta}")
    cost = data.get("cost")
    if cost:
        click.echo(
            f"  cost so far {cost['cost']} {cost['currency']} for {cost['requests']:,} "
            f"requests ({cost['gpu_seconds']:.1f} GPU s), "
            f"{cost['per_1000_requests']} {cost['currency']} per 1,000 requests"
        )


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
@click.option(
    "--after",
    type=click.IntRange(min=0),
    default=None,
    help="Only the lines that finished after the first N (the position an earlier read printed).",
)
@click.option(
    "--follow",
    is_flag=True,
    help="Write lines as they finish until the job has finished; a rerun resumes from "
    "OUTPUT.cursor.",
)
@click.option("--poll", "poll_s", type=float, default=1.0, show_default=True, hidden=True)
def results(
    job_id: str,
    output: Path,
    errors: Path | None,
    fmt: str,
    after: int | None,
    follow: bool,
    poll_s: float,
) -> None:
    """Write a job's finished lines, in the order they finished, into JSONL files (a running
    job's too: the lines finished so far, and how many are still to come)."""
    with reported(this_command(), f"job {job_id} is safe (its results stay stored)"):
        client = _client()
        if not client.state.jobs.exists(job_id):
            raise click.ClickException(f"unknown job {job_id}")
        paths = [output] if errors is None else [output, errors]
        if follow:
            _follow(client, job_id, paths, fmt, after, poll_s)
            return
        with ExitStack() as stack:
            writer = Sinks(stack, paths, None).writer(fmt)
            position, complete = read_once(client, job_id, writer, after or 0)
        click.echo(
            f"{writer.ok:,} results -> {output}; {writer.failed:,} errors -> {errors or output}",
            err=True,
        )
        _echo_position(client, job_id, position, complete)


def _echo_position(client: Client, job_id: str, position: int, complete: bool) -> None:
    if complete:
        click.echo(f"every line of the job read (position {position:,})", err=True)
        return
    click.echo(
        f"{lines_to_come(client, job_id):,} still to come; read on with --after {position}",
        err=True,
    )


def _follow(
    client: Client, job_id: str, paths: list[Path], fmt: str, after: int | None, poll_s: float
) -> None:
    def progress(writer: LineWriter, position: int) -> None:
        _echo_progress(
            f"{writer.ok:,} results, {writer.failed:,} errors written (position {position:,}); "
            f"{lines_to_come(client, job_id):,} still to come"
        )

    try:
        writer, cursor = follow_job(client, job_id, paths, fmt, after, poll_s, progress)
    except KeyboardInterrupt:
        click.echo(err=True)
        raise click.ClickException(
            f"interrupted; rerun with --follow to resume from {cursor_path(paths[0])}"
        ) from None
    except LookupError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(err=True)
    click.echo(
        f"{writer.ok:,} results, {writer.failed:,} errors written this run; "
        f"every line of the job read (position {cursor.position:,})",
        err=True,
    )


@click.command("usage")
@click.option("--tenant", "tenants", multiple=True, help="A tenant (repeat; default: all).")
@click.option("--job", "job_id", default=None, help="One job's usage instead.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def usage(tenants: tuple[str, ...], job_id: str | None, as_json: bool) -> None:
    """Prompt tokens (visual included), completion tokens, requests, model seconds, GPU
    seconds and cost per tenant (or of one job), by model and modality, and per model."""
    if job_id is not None:
        check_id("job id", job_id)
    with reported(this_command(), "nothing was changed"):
        client = _client()
        currency = client.settings.cost.currency
        report = usage_report(client.redis, client.keys, tenants or None, job_id, currency)
    if as_json:
        click.echo(json.dumps(report, indent=2, sort_keys=True))
        return
    sections = [report] if job_id is not None else report["tenants"]
    for section in sections:
        totals = section["totals"]
        click.echo(
            f"{section.get('tenant') or 'job ' + str(job_id)}: {totals['requests']:,} requests, "
            f"{totals['prompt_tokens']:,} prompt + {totals['completion_tokens']:,} completion "
            f"tokens, {totals['model_seconds']:.1f} model s, {totals['gpu_seconds']:.1f} GPU s, "
            f"{totals['cost']} {currency}"
        )
        for row in section["by"]:
            click.echo(
                f"  {row['model']} {row['modality']}: {row['requests']:,} requests, "
                f"{row['prompt_tokens']:,} + {row['completion_tokens']:,} tokens, "
                f"{row['model_seconds']:.1f} s, {row['gpu_seconds']:.1f} GPU s, "
                f"{row['cost']} {currency}"
            )
    if job_id is None and report["models"]:
        click.echo("per model:")
        for row in report["models"]:
            click.echo(
                f"  {row['model']}: {row['requests']:,} requests, "
                f"{row['gpu_seconds']:.1f} GPU s, {row['cost']} {currency}"
            )


@click.command("cancel")
@click.argument("identifier", metavar="JOB_OR_TASK_ID")
def cancel(identifier: str) -> None:
    """Cancel queued tasks of a job (or one task); running ones finish."""
    with reported(this_command(), "what was cancelled stays cancelled; nothing else changed"):
        cancelled = _client().cancel(identifier)
    click.echo(f"cancelled {cancelled:,} queued tasks")
    sys.exit(0)
