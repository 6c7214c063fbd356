"""The prepare tier with real processes: ``vlmq worker --role prepare`` beside GPU workers
(``vlmq worker`` with a tiny checkpoint), killed with -9 mid-job, started mid-job, with its
frame store unreachable, killed by a medium each time it prepares it, across a Redis restart,
and hearing a Celery revoke alone."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from tests.support.faults import prepare
from tests.support.fleet import Processes
from tests.support.samples import make_video_bytes, save_image
from tests.support.services import wait_until
from vlmq.broker.queues import prepare_backlog
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
    first = prepare.prepare_worker(fleet, "prep-1")
    prepared = fleet.keys.prepared_queue("image", "bulk")
    wait_until(lambda: fleet.redis.llen(prepared) >= 2, timeout=60, what="a first hand-on")
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    assert prepare_backlog(fleet.redis, fleet.keys, ["image", "video"])["image"] > 0
    prepare.prepare_worker(fleet, "prep-2")
    wait_until(
        lambda: prepare.handed_on(fleet) == PHOTOS + CLIPS, timeout=90, what="every task prepared"
    )
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
    prepare.prepare_worker(fleet, "prep-1", env=down)
    wait_until(lambda: client.status(job)["finished"], timeout=120, what="the job")
    assert client.status(job)["counts"]["succeeded"] == PHOTOS + CLIPS
    assert max(r["deliveries"] for r in _records(client, job)) <= 2


def test_media_that_kills_prepare_workers_takes_only_itself_down(
    fleet: Processes, celery_app: Celery
) -> None:
    """A photo whose preparing kills the prepare worker (a decoder crash) takes its batch-mate
    down twice; then each goes alone, the batch-mate is handed on and succeeds, and the killer
    alone dies until it is given up and dead-lettered, FAILURE for its Celery caller: never
    the whole pull for ever, never the batch-mate (issue 37, 3 and 2)."""
    rules = {"VLMQ_FLEET__LEASE_S": "2", "VLMQ_FLEET__MAX_DELIVERIES": "2"}
    found = prepare.killer_in_the_prepare_tier(fleet, celery_app, 1, rules, most_deaths=4)
    assert found["prepare_worker_deaths"] == 4  # the pull twice, then the killer alone twice
    assert found["batch_mates_succeeded"] == 1
    assert (found["killer_celery_state"], found["killer_error"]) == ("FAILURE", "dead_lettered")
    assert "prepared alone" in found["killer_reason"]
    assert found["dead_letters"] == 1


@pytest.mark.private_redis
def test_a_prepare_worker_rides_out_a_redis_restart(fleet: Processes, redis_server: Any) -> None:
    """Redis killed mid-job and started again on its data: the prepare worker retries until
    Redis answers, as a GPU worker does, and prepares what was submitted around the outage
    (issue 37, 4)."""
    found = prepare.redis_restart_under_prepare_workers(fleet, redis_server, 4, outage_s=None)
    assert found["prepare_worker_alive_after"], fleet.log(fleet.procs[0])[-3000:]
    assert (found["succeeded"], found["failed"]) == (8, 0)


def test_a_revoke_only_a_prepare_worker_hears_ends_revoked(
    fleet: Processes, celery_app: Celery
) -> None:
    """The fleet's one Celery-hosted worker is a prepare worker: its cancel of a revoked task
    is the one that moves it, and the task's Celery record reads REVOKED, never PENDING for
    ever (issue 37, 1)."""
    proc = prepare.prepare_worker(fleet, "prep-1", celery=True)
    wait_until(
        lambda: any("prep-1" in name for r in celery_app.control.ping(timeout=0.5) for name in r),
        timeout=30,
        what="the prepare worker's Celery host",
    )
    request = prepare.photo_request(fleet.workdir / "media" / "p0.png", "Describe it.")
    sent = celery_app.send_task(
        "vlmq.generate", kwargs={"request": request}, queue=fleet.keys.queue("image")
    )
    task = fleet.keys.task(sent.id)
    wait_until(lambda: fleet.redis.hget(task, "stage") == "prepared", what="it was prepared")
    replies = celery_app.control.revoke(sent.id, reply=True, timeout=3)
    assert {n: r for reply in replies for n, r in reply.items()} == {
        "celery@prep-1": {"ok": {sent.id: "cancelled"}}
    }
    wait_until(lambda: sent.state != "PENDING", timeout=15, what="its Celery record")
    assert sent.state == "REVOKED"
    assert fleet.redis.hget(task, "state") == "cancelled"
    assert proc.poll() is None
