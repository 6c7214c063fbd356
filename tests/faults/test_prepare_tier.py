"""The prepare tier with real processes: ``vlmq worker --role prepare`` beside GPU workers
(``vlmq worker`` with a tiny checkpoint), killed with -9 mid-job, started mid-job, and with
its frame store unreachable."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from tests.support.fleet import Processes
from tests.support.samples import make_video_bytes, save_image
from tests.support.services import wait_until
from vlmq.config.queues import prepare_backlog
from vlmq.producers.client import Client

pytestmark = pytest.mark.faults

PHOTOS, CLIPS = 10, 2


@pytest.fixture
def fleet(redis_server: Any, moto_server: Any, tmp_path: Path, checkpoint: Any) -> Any:
    procs = Processes(
        redis_server.url,
        moto_server,
        tmp_path,
        VLMQ_MODEL=str(checkpoint("qwen2_5_vl")),
        # One preparing thread, two tasks a pull: a prepare worker is slow enough to kill.
        VLMQ_WORKER__PREPROCESS_WORKERS="1",
    )
    media = tmp_path / "media"
    for n in range(PHOTOS):
        save_image(media / f"p{n}.png", size=(320, 240), seed=n)
    for n in range(CLIPS):
        clip = make_video_bytes(n_frames=24, size=(96, 64), fps=8, seed=100 + n)
        (media / f"c{n}.mp4").write_bytes(clip)
    yield procs
    procs.stop()


def _items(media: Path) -> list[dict[str, Any]]:
    photos = [
        {
            "custom_id": f"p{n}",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": str(media / f"p{n}.png")},
                        "Describe it.",
                    ],
                }
            ],
        }
        for n in range(PHOTOS)
    ]
    clips = [
        {
            "custom_id": f"c{n}",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "video",
                            "video": str(media / f"c{n}.mp4"),
                            "fps": 4.0,
                            "max_frames": 6,
                        },
                        "What happens?",
                    ],
                }
            ],
        }
        for n in range(CLIPS)
    ]
    items: list[dict[str, Any]] = [*photos, *clips]
    for item in items:
        item["max_new_tokens"] = 4
    return items


def _prepare_worker(fleet: Processes, name: str, env: dict[str, str] | None = None) -> Any:
    proc = fleet.start(
        name,
        "--log-level",
        "info",
        "worker",
        "--role",
        "prepare",
        "--no-celery",
        "--name",
        name,
        env=env,
    )
    fleet.wait_registered(name, proc, timeout=60)
    return proc


def _gpu_worker(fleet: Processes, name: str) -> Any:
    proc = fleet.start(
        name,
        "--log-level",
        "info",
        "worker",
        "--modality",
        "image,video",
        "--no-celery",
        "--name",
        name,
    )
    fleet.wait_registered(name, proc, timeout=120)
    return proc


def _records(client: Client, job: str) -> list[dict[str, Any]]:
    return [client.result(task) for task in client.job_task_ids(job)]


def test_a_prepare_worker_killed_mid_job_loses_nothing(fleet: Processes) -> None:
    """kill -9 mid-job: its tasks are reaped back to the raw lists, prepared again at most
    once more, and each ends with one result; the GPU worker decodes nothing."""
    client = fleet.client()
    job = client.submit_many(_items(fleet.workdir / "media"))
    first = _prepare_worker(fleet, "prep-1")
    prepared = fleet.keys.prepared_queue("image", "bulk")
    wait_until(lambda: fleet.redis.llen(prepared) >= 2, timeout=60, what="a first hand-on")
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    assert prepare_backlog(fleet.redis, fleet.keys, ["image", "video"])["image"] > 0
    _prepare_worker(fleet, "prep-2")

    def all_prepared() -> bool:
        backlog = prepare_backlog(fleet.redis, fleet.keys, ["image", "video"])
        return not any(backlog.values()) and not fleet.redis.hlen(fleet.keys.inflight())

    wait_until(all_prepared, timeout=90, what="every task prepared")
    _gpu_worker(fleet, "gpu-1")
    wait_until(lambda: client.status(job)["finished"], timeout=120, what="the job")
    assert client.status(job)["counts"]["succeeded"] == PHOTOS + CLIPS
    records = _records(client, job)
    assert sorted(r["custom_id"] for r in records) == sorted(
        i["custom_id"] for i in _items(fleet.workdir / "media")
    )
    # prep-1's pull, at most one more prepare pull, the GPU worker's.
    assert max(r["deliveries"] for r in records) <= 3
    assert sum(r["timings"]["media_decodes"] for r in records) == 0


def test_gpu_workers_prepare_themselves_when_the_frame_store_is_down(fleet: Processes) -> None:
    """A prepare tier whose frame store cannot be written hands tasks on unprepared; a GPU
    worker already running (preparing raw tasks itself) and the prepare tier starting
    mid-job share the work, and nothing fails."""
    client = fleet.client()
    job = client.submit_many(_items(fleet.workdir / "media"))
    _gpu_worker(fleet, "gpu-1")
    wait_until(lambda: client.status(job)["counts"]["succeeded"] >= 1, timeout=60, what="a result")
    down = {"VLMQ_MEDIA__FRAME_STORE__URL": "s3://no-such-bucket/frames"}
    _prepare_worker(fleet, "prep-1", env=down)
    wait_until(lambda: client.status(job)["finished"], timeout=120, what="the job")
    assert client.status(job)["counts"]["succeeded"] == PHOTOS + CLIPS
    assert max(r["deliveries"] for r in _records(client, job)) <= 2
