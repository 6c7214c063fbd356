"""The frame store under faults, with real processes: a GPU worker serving prepared photos
under a small descriptor limit, a results store that refuses every write, and the frame
store and the results sharing a small volume (docs/reliability.md, the frame store under
faults)."""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.fleet import Processes
from tests.support.samples import save_image
from tests.support.services import wait_until
from vlmq.broker.queues import prepare_backlog
from vlmq.producers.client import Client

pytestmark = pytest.mark.faults

# A GPU worker serving these photos has at most 16 descriptors open (measured: Redis, S3,
# its log); the limit leaves it room for its own work, and none for one per cached photo.
DESCRIPTORS = 64
PHOTOS = 100


@pytest.fixture
def fleet(redis_server: Any, moto_server: Any, tmp_path: Path, checkpoint: Any) -> Any:
    procs = Processes(
        redis_server.url, moto_server, tmp_path, VLMQ_MODEL=str(checkpoint("qwen2_5_vl"))
    )
    yield procs
    procs.stop()


def _photos(media: Path, count: int, size: tuple[int, int] = (64, 48)) -> list[dict[str, Any]]:
    items = []
    for n in range(count):
        save_image(media / f"p{n}.png", size=size, seed=n)
        content = [{"type": "image", "image": str(media / f"p{n}.png")}, "Describe it."]
        items.append(
            {
                "custom_id": f"p{n}",
                "messages": [{"role": "user", "content": content}],
                "max_new_tokens": 2,
            }
        )
    return items


def _wait_job(client: Client, job: str, worker: Any, timeout: float) -> dict[str, Any]:
    """The job's status once it finished; fails at once if ``worker`` exits meanwhile."""

    def finished() -> bool:
        if worker.poll() is not None:
            raise AssertionError(f"the worker exited with {worker.returncode}")
        return bool(client.status(job)["finished"])

    wait_until(finished, timeout=timeout, what="the job to finish")
    return client.status(job)


def test_cached_store_reads_hold_no_descriptor(fleet: Processes) -> None:
    """Every photo prepared ahead is read back from a file:// store and kept in the GPU
    worker's media cache. A mapped read held a descriptor per cached photo, so under a small
    ``ulimit -n`` the reads past the limit failed (the photos were fetched and decoded again),
    then fetches and uploads too: valid tasks failed (media_fetch_failed) and result writes
    stalled."""
    frames = {"VLMQ_MEDIA__FRAME_STORE__URL": f"file://{fleet.workdir / 'frames'}"}
    client = fleet.client()
    job = client.submit_many(_photos(fleet.workdir / "media", PHOTOS))
    prepare = fleet.prepare_worker("prep", frames)

    def prepared() -> bool:
        backlog = prepare_backlog(fleet.redis, fleet.keys, ["image"])
        return not backlog["image"] and not fleet.redis.hlen(fleet.keys.inflight())

    wait_until(prepared, timeout=40, what="every photo prepared")
    assert fleet.terminate(prepare) == 0
    gpu = fleet.model_worker("gpu", env=frames, nofile=DESCRIPTORS)
    status = _wait_job(client, job, gpu, timeout=40)
    records = [client.result(task) for task in client.job_task_ids(job)]
    failed = [(r["custom_id"], r["error"]) for r in records if r["status"] != "succeeded"]
    assert not failed and status["counts"]["succeeded"] == PHOTOS
    assert sum(r["timings"]["frame_store_hits"] for r in records) == PHOTOS
    assert sum(r["timings"]["media_decodes"] for r in records) == 0


def test_a_results_store_that_refuses_every_write_fails_tasks_instead_of_holding_them(
    fleet: Processes,
) -> None:
    """A store that never takes a result (here a job's folder that cannot be made, as a full
    volume refuses every file): the worker retries for the deadline, then fails each task
    alone with ``store_unavailable``. Before, it retried for ever with every lease held: the
    tasks stayed running and the job never finished."""
    results = fleet.workdir / "results"
    client = fleet.client()
    items = [
        {"custom_id": f"t{n}", "messages": [{"role": "user", "content": f"task {n}"}]}
        for n in range(40)
    ]
    job = client.submit_many(items)
    results.mkdir()
    (results / job).write_text("not a folder")  # every result key of the job is under it
    worker = fleet.worker(
        "w",
        env={
            "VLMQ_RESULTS_URL": f"file://{results}",
            "VLMQ_FLEET__STORE_RETRY_DEADLINE_S": "2",
        },
    )
    status = _wait_job(client, job, worker, timeout=40)
    assert status["counts"]["failed"] == len(items)
    assert not fleet.redis.hlen(fleet.keys.inflight())  # no lease left held
    codes = {client.status(t).get("error_code") for t in client.job_task_ids(job)}
    assert codes == {"store_unavailable"}
    assert worker.poll() is None


@contextlib.contextmanager
def _small_volume(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` (root only); skips the test without one."""
    path.mkdir(parents=True)
    try:
        mount = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True,
            check=False,
        )
    except FileNotFoundError:
        pytest.skip("no mount command here: the small volume needs one (and root)")
    if mount.returncode != 0:
        pytest.skip(f"no tmpfs could be mounted here: {mount.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_frame_store_on_the_results_volume_never_stops_results(fleet: Processes) -> None:
    """Results and the frame store (its default location beside them) on one 8 MiB volume,
    and more photos than the volume holds once prepared. The frame store leaves the volume
    its reserve, so every result is stored. Before, the frames (at {results_url}/frames,
    never evicted) filled the volume and no result could be stored: every task stayed
    running with its lease held, and the job never finished."""
    with _small_volume(fleet.workdir / "volume", "8m") as volume:
        client = fleet.client()
        staging = f"{fleet.env['VLMQ_RESULTS_URL']}/media"  # the producer's (on S3)
        job = client.submit_many(_photos(fleet.workdir / "media", 80, size=(320, 240)))
        gpu = fleet.model_worker(
            "gpu",
            env={
                "VLMQ_RESULTS_URL": f"file://{volume}/results",
                "VLMQ_MEDIA__STAGING_URL": staging,
                "VLMQ_MEDIA__FRAME_STORE__KINDS": json.dumps(["image", "video"]),
                "VLMQ_FLEET__STORE_RETRY_DEADLINE_S": "5",
            },
        )
        status = _wait_job(client, job, gpu, timeout=45)
        assert status["counts"]["succeeded"] == 80
        stored = list((volume / "results" / job).glob("*.json"))
        assert len(stored) == 80
