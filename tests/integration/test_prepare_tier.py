"""The prepare tier against a real Redis and moto's S3 server: prepare loops and GPU loops
composed as ``vlmq worker --role prepare`` and ``vlmq worker`` compose them, with real
tiny checkpoints and real media."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tests.support.samples import make_video_bytes, save_image
from tests.support.services import wait_until
from tests.support.without_torch import run_without_torch
from vlmq.broker.connection import create_redis
from vlmq.broker.queues import prepare_backlog, queue_depth
from vlmq.config.keys import Keys
from vlmq.config.settings import Settings
from vlmq.producers.client import Client
from vlmq.stores.urls import open_store
from vlmq.workers.engine import Engine
from vlmq.workers.engine.prepare import visual_downscale
from vlmq.workers.fleet.metrics import WorkerMetrics
from vlmq.workers.fleet.observer import LoopObserver
from vlmq.workers.fleet.prepare_tier import PrepareLoop, Targets, model_targets
from vlmq.workers.fleet.service import compose_loop, compose_prepare_loop
from vlmq.workers.media.fleet import fleet_loader

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "internvl")


class Loads(LoopObserver):
    """Counts the media loads a loop reports."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}

    def media_loads(self, modality: str, source: str, count: int) -> None:
        key = (modality, source)
        self.counts[key] = self.counts.get(key, 0) + count


@pytest.fixture
def media(tmp_path: Path) -> Path:
    folder = tmp_path / "media"
    folder.mkdir()
    for n in range(3):
        save_image(folder / f"p{n}.png", size=(160 + 16 * n, 120), seed=n)
    (folder / "c0.mp4").write_bytes(make_video_bytes(n_frames=16, size=(96, 64), fps=8, seed=7))
    return folder


def _settings(settings: Settings, media: Path, model: Path) -> Settings:
    local = settings.media.model_copy(update={"local_roots": [str(media)]})
    return settings.model_copy(update={"media": local, "model": str(model)})


def _gpu(settings: Settings, observers: tuple[LoopObserver, ...] = ()) -> Any:
    loader = fleet_loader(settings)
    engine = Engine(settings.model, settings.engine, loader.settings, loader=loader).setup()
    store = open_store(settings.results_url, settings.s3_endpoint_url)
    modalities = ["image", "video"]
    redis = create_redis(settings)
    return compose_loop(settings, modalities, engine, "gpu-1", redis, store, observers)


def _prepare(settings: Settings, observers: tuple[LoopObserver, ...] = ()) -> PrepareLoop:
    redis = create_redis(settings)
    return compose_prepare_loop(settings, ["image", "video"], "prep-1", redis, observers)


def _requests(media: Path) -> list[dict[str, Any]]:
    photo = [{"type": "image", "image": str(media / f"p{n}.png")} for n in range(3)]
    clip = {"type": "video", "video": str(media / "c0.mp4"), "fps": 4.0, "max_frames": 6}
    return [
        {"messages": [{"role": "user", "content": [photo[0], "Describe it."]}], "custom_id": "a"},
        {
            "messages": [{"role": "user", "content": [photo[1], photo[2], "Diff?"]}],
            "custom_id": "b",
        },
        {"messages": [{"role": "user", "content": [clip, "What happens?"]}], "custom_id": "c"},
    ]


def _drain(loop: Any, client: Client, job: str) -> None:
    """Run a GPU loop until ``job`` has finished, then stop it."""
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        wait_until(lambda: client.status(job)["finished"], timeout=60, what="the job")
    finally:
        loop.stop()
        thread.join(30)
        loop.shutdown(10)


def _outputs(client: Client, job: str) -> dict[str, tuple[str, dict[str, Any]]]:
    out = {}
    for task in client.job_task_ids(job):
        record = client.result(task)
        assert record["status"] == "succeeded", record
        out[record["custom_id"]] = (record["output"], record["timings"])
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_the_targets_from_config_files_are_the_processors(family: str, checkpoint: Any) -> None:
    """The prepare tier keys the frame store with the GPU workers' targets, read torch-free."""
    engine = Engine(str(checkpoint(family))).setup()
    processor = engine.loaded.processor
    assert model_targets(str(checkpoint(family))) == Targets(*visual_downscale(processor))
    engine.close()


# Every family, and both lanes (the lanes differ only in the lists a task moves through).
@pytest.mark.parametrize(
    ("family", "lane"),
    [
        ("qwen2_5_vl", "bulk"),
        ("qwen2_5_vl", "interactive"),
        ("qwen3_vl", "bulk"),
        ("internvl", "interactive"),
    ],
)
def test_prepared_and_direct_give_identical_tokens(
    settings: Settings, media: Path, checkpoint: Any, family: str, lane: str
) -> None:
    settings = _settings(settings, media, checkpoint(family))
    client = Client(settings)
    direct_job = client.submit_many(_requests(media), lane=lane)
    _drain(_gpu(settings), client, direct_job)
    direct = _outputs(client, direct_job)

    # A second tenant: nothing of the first's is in its frame store folder.
    other = Client(settings.model_copy(update={"tenant": "blue"}))
    job = other.submit_many(_requests(media), lane=lane)
    prep_loads = Loads()
    prep = _prepare(settings, (prep_loads,))
    while prep.run_once():
        pass
    keys = Keys()
    assert queue_depth(client.redis, keys, ["image", "video"]) == {"image": 2, "video": 1}
    assert prepare_backlog(client.redis, keys, ["image"])["image"] == 0
    assert prep_loads.counts == {("image", "decoded"): 3, ("video", "decoded"): 1}
    registry = CollectorRegistry()
    _drain(_gpu(settings, (WorkerMetrics(registry),)), other, job)
    prepared = _outputs(other, job)
    assert {k: v[0] for k, v in prepared.items()} == {k: v[0] for k, v in direct.items()}
    for _, timings in prepared.values():
        assert timings["media_decodes"] == 0 and timings["frame_store_hits"] >= 1

    def loads(modality: str, source: str) -> float | None:
        labels = {"modality": modality, "source": source}
        return registry.get_sample_value("vlmq_media_loads_total", labels)

    assert loads("image", "decoded") is None and loads("video", "decoded") is None
    assert loads("image", "frame_store") == 3 and loads("video", "frame_store") == 1


def test_a_task_shows_its_stage_and_hand_on_is_safe_to_repeat(
    settings: Settings, media: Path, checkpoint: Any
) -> None:
    settings = _settings(settings, media, checkpoint("qwen2_5_vl"))
    client = Client(settings)
    task = client.submit(_requests(media)[0]["messages"])
    prep = _prepare(settings)
    intake = prep.parts.intakes["image"]
    pull = intake.pull(4, 30)
    [delivery] = pull.deliveries
    assert client.status(task)["stage"] == "preparing"
    leases = prep.parts.state.leases
    target = Keys().prepared_queue("image", "interactive")
    assert leases.hand_on(target, {task: delivery.token}) == {task: "on"}
    assert leases.hand_on(target, {task: delivery.token}) == {task: "on"}  # a resend
    assert client.redis.llen(target) == 1
    assert client.status(task)["stage"] == "prepared"
    # The GPU worker's pull is the next delivery: the prepare worker is fenced out.
    gpu = _gpu(settings)
    gpu_pull = gpu.parts.intakes["image"].pull(4, 30)
    assert [d.task_id for d in gpu_pull.deliveries] == [task]
    assert gpu_pull.deliveries[0].prepared
    assert leases.hand_on(target, {task: delivery.token}) == {task: "lost"}
    assert gpu_pull.deliveries[0].token == delivery.token + 1
    gpu.parts.state.leases.give_back(gpu.parts.held.tokens() or {task: delivery.token + 1})


def test_a_task_cancelled_while_preparing_is_forgotten(
    settings: Settings, media: Path, checkpoint: Any
) -> None:
    settings = _settings(settings, media, checkpoint("qwen2_5_vl"))
    client = Client(settings)
    task = client.submit(_requests(media)[2]["messages"])
    prep = _prepare(settings)
    [delivery] = prep.parts.intakes["video"].pull(4, 30).deliveries
    assert client.cancel(task)
    target = Keys().prepared_queue("video", "interactive")
    assert prep.parts.state.leases.hand_on(target, {task: delivery.token}) == {task: "ended"}
    assert client.redis.llen(target) == 0
    assert client.redis.hlen(Keys().inflight()) == 0
    assert client.status(task)["state"] == "cancelled"


def test_a_dead_prepare_workers_tasks_go_back_raw(
    settings: Settings, media: Path, checkpoint: Any
) -> None:
    settings = _settings(settings, media, checkpoint("qwen2_5_vl"))
    client = Client(settings)
    job = client.submit_many(_requests(media)[:2])
    prep = _prepare(settings)
    held = prep.parts.intakes["image"].pull(4, 0.2).deliveries  # then it dies
    assert len(held) == 2
    leases = prep.parts.state.leases
    wait_until(lambda: leases.reap() or not client.redis.zcard(Keys().leases()), what="reap")
    assert all(client.status(d.task_id).get("stage") is None for d in held)
    assert prepare_backlog(client.redis, Keys(), ["image"])["image"] == 2
    target = Keys().prepared_queue("image", "bulk")
    late = {d.task_id: d.token for d in held}
    assert set(leases.hand_on(target, late).values()) == {"lost"}
    # A GPU worker prepares them itself, and each runs once.
    _drain(_gpu(settings), client, job)
    assert client.status(job)["counts"]["succeeded"] == 2


def test_media_that_cannot_be_prepared_fails_alone_on_the_gpu(
    settings: Settings, media: Path, checkpoint: Any
) -> None:
    settings = _settings(settings, media, checkpoint("qwen2_5_vl"))
    client = Client(settings)
    bad = [{"type": "image", "image": str(media / "missing.png")}, "Describe it."]
    items = [*_requests(media)[:1], {"messages": [{"role": "user", "content": bad}]}]
    job = client.submit_many(items)
    prep = _prepare(settings)
    while prep.run_once():
        pass
    assert client.redis.llen(Keys().prepared_queue("image", "bulk")) == 2
    _drain(_gpu(settings), client, job)
    counts = client.status(job)["counts"]
    assert counts["succeeded"] == 1 and counts["failed"] == 1


def test_a_running_prepare_loop_stops_and_gives_back(
    settings: Settings, media: Path, checkpoint: Any
) -> None:
    settings = _settings(settings, media, checkpoint("qwen2_5_vl"))
    client = Client(settings)
    job = client.submit_many(_requests(media))
    prep = _prepare(settings)
    thread = threading.Thread(target=prep.run_forever, daemon=True)
    thread.start()
    prepared = [Keys().prepared_queue(m, "bulk") for m in ("image", "video")]
    wait_until(lambda: sum(client.redis.llen(k) for k in prepared) == 3, what="hand-on")
    prep.shutdown(10)
    thread.join(10)
    assert not thread.is_alive() and len(prep.parts.held) == 0
    _drain(_gpu(settings), client, job)
    assert client.status(job)["counts"]["succeeded"] == 3


def test_a_draining_prepare_worker_hands_back_what_it_holds_at_once(
    settings: Settings, media: Path, checkpoint: Any
) -> None:
    """A prepare worker told to go (SIGTERM, a preemption notice) does not finish what it is
    preparing: it hands everything it holds back in one call, no longer 'preparing', and
    its late hand-on is refused; the GPU worker runs every task once."""
    settings = _settings(settings, media, checkpoint("qwen2_5_vl"))
    client = Client(settings)
    job = client.submit_many(_requests(media))
    prep = _prepare(settings)
    intake = prep.parts.intakes["image"]
    pulled = intake.pull(8, 60).deliveries + prep.parts.intakes["video"].pull(8, 60).deliveries
    prep.parts.held.add(pulled)
    assert len(pulled) == 3
    assert prep.drain(settle_s=0.1) == 3
    assert len(prep.parts.held) == 0
    assert client.redis.hlen(Keys().inflight()) == 0
    stages = {t: client.state.tasks.get(t).get("stage") for t in client.job_task_ids(job)}
    assert set(stages.values()) == {None}, stages  # not 'preparing' any more
    late = prep.parts.state.leases.hand_on(
        Keys().prepared_queue("image", "bulk"), {d.task_id: d.token for d in pulled}
    )
    assert set(late.values()) == {"lost"}  # the old holder is fenced out
    _drain(_gpu(settings), client, job)
    assert client.status(job)["counts"]["succeeded"] == 3


_WITHOUT_TORCH = """
from vlmq.broker.connection import create_redis
from vlmq.config.settings import Settings
from vlmq.workers.fleet.service import compose_prepare_loop

settings = Settings()
loop = compose_prepare_loop(settings, ["image", "video"], "prep", create_redis(settings))
while loop.run_once():
    pass
print("prepared without torch")
"""


def test_a_prepare_worker_runs_without_torch(
    settings: Settings, media: Path, checkpoint: Any, tmp_path: Path
) -> None:
    import json

    settings = _settings(settings, media, checkpoint("qwen2_5_vl"))
    client = Client(settings)
    job = client.submit_many(_requests(media))
    done = run_without_torch(
        _WITHOUT_TORCH,
        settings,
        VLMQ_MODEL=settings.model,
        VLMQ_MEDIA__LOCAL_ROOTS=json.dumps([str(media)]),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    keys = Keys()
    assert client.redis.llen(keys.prepared_queue("image", "bulk")) == 2
    assert client.redis.llen(keys.prepared_queue("video", "bulk")) == 1
    assert client.status(job)["counts"]["queued"] == 3
