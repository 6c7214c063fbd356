"""``vlmq demo``: the whole fleet on the embedded default, end to end.

A private redis-server, a tiny offline checkpoint, one worker process per
modality class, the bundled example requests submitted through the producer
client, a progress line while they run, then the results, printed and stored
under a local results URL.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click
from redis import Redis

from vlmq.config.jsonl import read_requests
from vlmq.config.keys import Keys
from vlmq.config.settings import Settings
from vlmq.producers.client import Client
from vlmq.producers.examples import make_examples
from vlmq.producers.localredis import LocalRedis

__all__ = ["demo"]

MODALITIES = ("text", "image", "video")


def _vlmq(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "vlmq", *args], env=env)


def _ensure_model(path: Path, family: str) -> None:
    if (path / "config.json").exists():
        return
    click.echo(f"building a tiny offline {family} checkpoint in {path} ...")
    if _vlmq("build-tiny-model", str(path), "--family", family).wait() != 0:
        raise click.ClickException("building the tiny checkpoint failed")


def _worker_env(redis_url: str, results_url: str, model: Path, media: Path) -> dict[str, str]:
    return {
        **os.environ,
        "VLMQ_REDIS_URL": redis_url,
        "VLMQ_RESULTS_URL": results_url,
        "VLMQ_MODEL": str(model),
        "VLMQ_MEDIA__LOCAL_ROOTS": json.dumps([str(media)]),
        "VLMQ_ENGINE__TORCH_THREADS": "1",
    }


def _wait_for_workers(redis: Redis, count: int, procs: list[Any], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while redis.hlen(Keys().workers()) < count:
        if any(p.poll() is not None for p in procs):
            raise click.ClickException("a worker exited during start-up")
        if time.monotonic() > deadline:
            raise click.ClickException("workers did not start in time")
        time.sleep(0.2)


def _progress(client: Client, job_id: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        status = client.status(job_id)
        counts = status["counts"]
        click.echo(
            f"\r  {status['done']}/{status['total']} done  "
            f"(queued {counts['queued']}, running {counts['running']}, "
            f"succeeded {counts['succeeded']}, failed {counts['failed']})   ",
            nl=False,
        )
        if status["finished"]:
            click.echo()
            return status
        if time.monotonic() > deadline:
            raise click.ClickException("the job did not finish in time")
        time.sleep(0.25)


def _print_results(client: Client, job_id: str) -> None:
    for task_id in client.job_task_ids(job_id):
        record = client.result(task_id) or {}
        label = f"{record.get('custom_id')} [{record.get('modality') or '-'}]"
        if record.get("status") == "succeeded":
            usage = record.get("usage", {})
            text = (record.get("output") or "").replace("\n", "\\n")[:60]
            click.echo(
                f"  ok   {label:<34} {usage.get('prompt_tokens'):>4}+"
                f"{usage.get('completion_tokens'):<3} batch={record.get('batch_size')} "
                f"{text!r}"
            )
        else:
            error = record.get("error") or {}
            click.echo(f"  FAIL {label:<34} {error.get('code')}: {error.get('message')}")


@click.command("demo")
@click.option(
    "--family",
    type=click.Choice(["qwen2_5_vl", "qwen3_vl", "internvl"]),
    default="qwen2_5_vl",
    show_default=True,
)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path(".vlmq"),
    show_default=True,
)
@click.option("--timeout", "timeout_s", type=float, default=600.0, show_default=True)
def demo(family: str, workdir: Path, timeout_s: float) -> None:
    """Run the fleet locally on the bundled example requests (Redis, tiny model, 3 workers)."""
    workdir = workdir.resolve()
    model = workdir / "models" / f"tiny-{family}"
    _ensure_model(model, family)
    examples = workdir / "examples"
    requests_file = make_examples(examples)
    results_url = f"file://{workdir / 'results'}"
    server = LocalRedis(workdir / "redis").start()
    click.echo(f"redis-server on {server.url}; results under {results_url}")
    env = _worker_env(server.url, results_url, model, examples)
    workers = [_vlmq("worker", "--modality", m, env=env) for m in MODALITIES]
    try:
        settings = Settings(redis_url=server.url, results_url=results_url)
        client = Client(settings)
        click.echo(f"starting {len(workers)} workers (text, image, video) ...")
        _wait_for_workers(client.redis, len(workers), workers, timeout_s)
        with requests_file.open(encoding="utf-8") as lines:
            parsed = list(read_requests(lines))
        for bad in (p.error for p in parsed if p.error):
            click.echo(f"  line {bad.line}: {bad.message}")
        job_id = client.submit_many([p.request for p in parsed if p.request], name="demo")
        click.echo(f"submitted job {job_id}: {sum(1 for p in parsed if p.request)} requests")
        _progress(client, job_id, timeout_s)
        _print_results(client, job_id)
        click.echo(f"results stored under {results_url}/{job_id}/")
    finally:
        for proc in workers:
            proc.terminate()
        for proc in workers:
            proc.wait(60)
        server.stop()
