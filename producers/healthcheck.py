"""``vlmq healthcheck``: container health probes (Docker HEALTHCHECK, Kubernetes exec probes).

``vlmq healthcheck worker`` passes when a worker process of this host keeps its
entry in the Redis hash ``Keys.workers()`` fresh. A worker writes that entry
(name -> JSON with an ``at`` heartbeat timestamp) when its batch loop starts,
then every ``lease_s / 3`` from the thread that also renews its leases
(``workers/fleet/service.py``). A fresh entry therefore means: the model is
loaded, the loop started, and this process still reaches Redis and renews its
leases. A batch stuck past ``batch_time_limit_s`` exits the process instead.

``vlmq healthcheck api`` passes when ``GET /healthz`` answers 200 with
``{"status": "ok"}``.

Both exit 0 when healthy and 1 otherwise, with one line saying why. Neither
imports torch or the worker package.
"""

from __future__ import annotations

import json
import socket
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import click

__all__ = ["WorkerBeat", "fresh_worker", "healthcheck", "heartbeat_max_age_s", "worker_beats"]


@dataclass(frozen=True)
class WorkerBeat:
    name: str
    at: float
    info: dict[str, Any]


def heartbeat_max_age_s(lease_s: float) -> float:
    """The oldest heartbeat of a live worker: three missed beats (one every lease_s / 3),
    and never under 90 s."""
    return max(90.0, 3 * max(0.5, lease_s / 3))


def worker_beats(entries: dict[str, str]) -> list[WorkerBeat]:
    """Parse the ``{prefix}:workers`` hash (``Keys.workers``); unreadable entries are skipped."""
    beats = []
    for name, raw_info in entries.items():
        try:
            info = json.loads(raw_info)
            at = float(info["at"])
        except (TypeError, ValueError, KeyError):
            continue
        beats.append(WorkerBeat(name=name, at=at, info=info))
    return beats


def _matches(beat: WorkerBeat, hostname: str, name: str | None) -> bool:
    if name is not None:
        return beat.name == name
    # Default worker names are "{modalities}@{hostname}:{pid}".
    return f"@{hostname}:" in beat.name


def fresh_worker(
    beats: list[WorkerBeat],
    hostname: str,
    max_age_s: float,
    now: float,
    name: str | None = None,
) -> tuple[WorkerBeat | None, str]:
    """The freshest matching beat younger than ``max_age_s``, and a reason line."""
    mine = sorted(
        (b for b in beats if _matches(b, hostname, name)), key=lambda b: b.at, reverse=True
    )
    who = f"worker {name!r}" if name else f"a worker on host {hostname!r}"
    if not mine:
        return None, f"unhealthy: no heartbeat from {who}"
    newest = mine[0]
    age = now - newest.at
    if age > max_age_s:
        return None, f"unhealthy: {newest.name} last beat {age:.0f}s ago (max {max_age_s:.0f}s)"
    return newest, f"ok: {newest.name} beat {max(age, 0.0):.1f}s ago"


@click.group("healthcheck")
def healthcheck() -> None:
    """Exit 0 when this container's worker or API is healthy, 1 otherwise."""


@healthcheck.command("worker")
@click.option(
    "--max-age",
    type=float,
    default=None,
    help="Oldest acceptable heartbeat in seconds "
    "[default: max(90, 3 x the heartbeat interval lease_s/3)].",
)
@click.option(
    "--hostname",
    default=None,
    help="Host part of the worker name [default: this host's name].",
)
@click.option("--name", default=None, help="Exact worker name (for workers started with --name).")
@click.option("--timeout", type=float, default=5.0, show_default=True, help="Redis timeout (s).")
def worker(max_age: float | None, hostname: str | None, name: str | None, timeout: float) -> None:
    """A worker on this host has a fresh heartbeat in Redis."""
    from redis import RedisError

    from vlmq.broker.connection import create_redis
    from vlmq.config.keys import Keys
    from vlmq.config.settings import Settings

    settings = Settings()
    if max_age is None:
        max_age = heartbeat_max_age_s(settings.fleet.lease_s)
    redis = create_redis(settings, timeout_s=timeout)
    try:
        entries: dict[str, str] = redis.hgetall(Keys(settings.fleet.key_prefix).workers())  # type: ignore[assignment]
    except RedisError as exc:
        click.echo(f"unhealthy: Redis unreachable ({type(exc).__name__})")
        sys.exit(1)
    finally:
        redis.close()
    beat, reason = fresh_worker(
        worker_beats(entries), hostname or socket.gethostname(), max_age, time.time(), name
    )
    click.echo(reason)
    sys.exit(0 if beat is not None else 1)


@healthcheck.command("api")
@click.option(
    "--url", default="http://127.0.0.1:8000/healthz", show_default=True, help="Liveness URL."
)
@click.option("--timeout", type=float, default=5.0, show_default=True, help="Seconds.")
def api(url: str, timeout: float) -> None:
    """The HTTP API answers its liveness endpoint."""
    if not url.startswith(("http://", "https://")):
        raise click.BadParameter("an http(s) URL", param_hint="--url")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            status = response.status
            body = response.read(4096)
    except urllib.error.HTTPError as exc:
        click.echo(f"unhealthy: {url} answered {exc.code}")
        sys.exit(1)
    except (urllib.error.URLError, OSError) as exc:
        click.echo(f"unhealthy: {url} unreachable ({exc})")
        sys.exit(1)
    try:
        answer = json.loads(body)
    except ValueError:
        answer = None
    if status != 200 or not isinstance(answer, dict) or answer.get("status") != "ok":
        click.echo(f"unhealthy: {url} answered {status}")
        sys.exit(1)
    click.echo(f"ok: {url}")
    sys.exit(0)
