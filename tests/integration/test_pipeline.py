"""The pipelined worker (issue 11) on real Redis and S3: the same outputs as the serial loop,
cancels of prefetched tasks honoured, prefetch bounded by its byte budget, stage failures
kept to their request."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_fleet_loop import RecordingEngine, Running, _conversation, make_loop
from tests.support.samples import save_image, save_video
from tests.support.services import wait_until
from vlmq.config.schemas import Request
from vlmq.config.settings import (
    BatchPolicy,
    DecodeSettings,
    EngineSettings,
    MediaSettings,
    Settings,
    WorkerSettings,
)
from vlmq.producers.client import Client
from vlmq.workers.demo.tiny import FAMILIES
from vlmq.workers.engine import Engine
from vlmq.workers.engine.interface import Collated, RunOnlyEngine
from vlmq.workers.engine.prepare import Prepared


def _with(settings: Settings, batch_size: int = 8, wait_s: float = 0.02, **worker: Any) -> Settings:
    policies = {
        m: BatchPolicy(max_batch_size=batch_size, max_wait_s=wait_s, token_budget=10**6)
        for m in ("text", "image", "video")
    }
    return settings.model_copy(update={"worker": WorkerSettings(**worker), "batch": policies})


def _finished(client: Client, job: str) -> bool:
    return bool(client.status(job)["finished"])


def _outputs(client: Client, job: str) -> dict[str, Any]:
    records = [client.result(task_id) for task_id in client.job_task_ids(job)]
    return {
        r["custom_id"]: (r["status"], r.get("output"), (r.get("error") or {}).get("code"))
        for r in records
    }


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("media")
    for n in range(3):
        save_image(folder / f"{n}.png", size=(160 + 40 * n, 120), seed=n)
    for n in range(2):
        save_video(folder / f"{n}.mp4", n_frames=16, size=(96, 64), fps=8, seed=10 + n)
    return folder


def _mixed_job(media: Path) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for n in range(3):
        items.append({"custom_id": f"text-{n}", "messages": _conversation("text", n)})
        image = {"type": "image", "image": str(media / f"{n}.png")}
        items.append(
            {
                "custom_id": f"image-{n}",
                "messages": [{"role": "user", "content": [image, f"what is in {n}?"]}],
            }
        )
    two = [{"type": "image", "image": str(media / f"{n}.png")} for n in (0, 2)]
    items.append(
        {"custom_id": "two-images", "messages": [{"role": "user", "content": [*two, "same?"]}]}
    )
    for n in range(2):
        clip = {"type": "video", "video": str(media / f"{n}.mp4"), "fps": 4.0, "max_frames": 8}
        for question in ("what happens?", "what colour?"):  # one clip asked twice: a cache hit
            items.append(
                {
                    "custom_id": f"video-{n}-{question[5]}",
                    "messages": [{"role": "user", "content": [clip, question]}],
                }
            )
    for item in items:
        item["generation"] = {"max_new_tokens": 6}
    return items


@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_on_and_off_give_the_same_outputs(
    settings: Settings, media: Path, family: str, tmp_path: Path, checkpoint: Any
) -> None:
    model = str(checkpoint(family))
    media_settings = MediaSettings(local_roots=[str(media)])
    outputs = []
    for pipeline in (False, True):
        # The producer knows the workers read the folder: paths go in place, unstaged.
        client = Client(settings.model_copy(update={"media": media_settings}))
        engine = Engine(model, EngineSettings(), media_settings).setup()
        job = client.submit_many(_mixed_job(media))
        # Everything is queued before the worker starts and one pull takes a whole class:
        # both loops cut the same micro-batches, so greedy outputs must agree exactly.
        loop = make_loop(_with(settings, batch_size=64, wait_s=0.2, pipeline=pipeline), engine)
        with Running(loop):
            wait_until(partial(_finished, client, job), timeout=120, what="job")
        outputs.append(_outputs(client, job))
        if pipeline:
            assert engine.stats.cache.hits > 0  # the clips asked twice were decoded once
            timings = [client.result(t)["timings"] for t in client.job_task_ids(job)]
            assert any(t.get("media_cache_hits", 0) > 0 for t in timings)
            assert all(
                {"prepare_s", "collate_s", "generate_s", "wait_s"} <= set(t) for t in timings
            )
        engine.close()
    serial, pipelined = outputs
    assert all(status == "succeeded" for status, _, _ in serial.values()), serial
    assert pipelined == serial


class GatedEngine(RecordingEngine):
    """Blocks inside each batch until the test opens the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()

    def run(self, requests: Any, worker: str | None = None, token_budget: int | None = None) -> Any:
        self.entered.set()
        assert self.gate.wait(30)
        return super().run(requests, worker, token_budget)


def test_a_cancel_of_prefetched_work_is_honoured(settings: Settings) -> None:
    client = Client(settings)
    first = client.submit_many([_conversation("text", n) for n in range(2)])
    engine = GatedEngine()
    loop = make_loop(_with(settings, batch_size=2, prefetch_batches=3), engine, ("text",))
    with Running(loop):
        assert engine.entered.wait(30)
        later = client.submit_many([_conversation("text", 10 + n) for n in range(4)])
        later_ids = list(client.job_task_ids(later))
        # Pulled and prepared behind the running batch, not started: still queued.
        wait_until(
            lambda: set(later_ids) <= set(loop.parts.held.tokens()),
            timeout=30,
            what="the later job prefetched",
        )
        assert {s["state"] for s in client.state.tasks.many(later_ids, ("state",))} == {"queued"}
        client.cancel(later)
        engine.gate.set()
        wait_until(lambda: client.status(first)["finished"], timeout=30, what="first job")
        wait_until(
            lambda: not set(later_ids) & set(loop.parts.held.tokens()),
            timeout=30,
            what="the cancelled tasks released",
        )
    assert not set(later_ids) & set(engine.ran)
    assert client.status(later)["counts"]["cancelled"] == 4


class HeavyEngine(RunOnlyEngine):
    """Every request holds ``media_bytes`` of decoded media; generate waits on a gate."""

    def __init__(self, media_bytes: int) -> None:
        super().__init__(GatedEngine())
        self.media_bytes = media_bytes

    def prepare(
        self, request: Request, tenant: str | None = None, prepared_media: bool = False
    ) -> Prepared:
        prepared = super().prepare(request)
        prepared.media_bytes = self.media_bytes
        return prepared


def test_prefetch_stays_within_its_byte_budget(settings: Settings) -> None:
    client = Client(settings)
    job = client.submit_many([_conversation("text", n) for n in range(12)])
    engine = HeavyEngine(media_bytes=100 << 20)
    gated = engine.engine
    assert isinstance(gated, GatedEngine)
    worker = {"prefetch_batches": 8, "prefetch_bytes": 250 << 20}
    loop = make_loop(_with(settings, batch_size=1, **worker), engine, ("text",))
    peaks = {"held": 0, "bytes": 0}
    with Running(loop):
        assert gated.entered.wait(30)
        for _ in range(20):  # the puller has had time to fill all it may
            held = len(loop.parts.held.tokens())
            assert loop.pipeline is not None
            peaks["held"] = max(peaks["held"], held)
            peaks["bytes"] = max(peaks["bytes"], loop.pipeline.depths()["prefetch_bytes"])
            loop.stop_event.wait(0.05)
        gated.gate.set()
        wait_until(lambda: client.status(job)["finished"], timeout=60, what="job")
    # The puller pulls while what it holds is under the budget: three of 100 MiB (the one
    # generating counts too), long before its eight batch slots are used.
    assert peaks["bytes"] <= 300 << 20
    assert 2 <= peaks["held"] <= 3
    assert client.status(job)["counts"]["succeeded"] == 12


class GatedHFEngine(Engine):
    """The HF engine whose generate waits for the test's gate."""

    gate = threading.Event()

    def poll(self, worker: str) -> list[Any]:
        assert self.gate.wait(60)
        return super().poll(worker)


def test_large_images_prefetch_within_the_byte_budget(
    settings: Settings, tmp_path: Path, checkpoint: Any
) -> None:
    for n in range(8):
        save_image(tmp_path / f"big-{n}.png", size=(2000, 1500), seed=n)
    decoded = 2000 * 1500 * 3
    model = str(checkpoint("qwen2_5_vl"))
    # Full-size decode and no cache: every prefetched request holds its 9 MB of pixels.
    media = MediaSettings(
        local_roots=[str(tmp_path)],
        downscale_at_decode=False,
        cache_bytes=0,
    )
    # Static micro-batches: a continuous engine takes rows in while others decode (up to its
    # slots, beyond the prefetch), and this is about what the pipeline holds ahead of it.
    static = EngineSettings(decode=DecodeSettings(inflight=False))
    engine = GatedHFEngine(model, static, media).setup()
    engine.gate = threading.Event()
    client = Client(settings.model_copy(update={"media": media}))  # read in place, unstaged
    items = [
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image", "image": str(tmp_path / f"big-{n}.png")}, "?"],
                }
            ],
            "generation": {"max_new_tokens": 2},
        }
        for n in range(8)
    ]
    job = client.submit_many(items)
    worker = {"prefetch_batches": 8, "prefetch_bytes": 2 * decoded + 1}
    loop = make_loop(_with(settings, batch_size=1, **worker), engine, ("image",))
    peak_bytes = peak_held = 0
    with Running(loop):
        wait_until(lambda: len(loop.parts.held.tokens()) >= 3, timeout=60, what="prefetch")
        for _ in range(20):
            assert loop.pipeline is not None
            peak_bytes = max(peak_bytes, loop.pipeline.depths()["prefetch_bytes"])
            peak_held = max(peak_held, len(loop.parts.held.tokens()))
            loop.stop_event.wait(0.05)
        engine.gate.set()
        wait_until(partial(_finished, client, job), timeout=120, what="job")
    engine.close()
    # Under the budget after two, the third is pulled; then the puller waits: three held of
    # eight allowed slots, the budget overrun by one batch at most.
    assert peak_held == 3
    assert peak_bytes == 3 * decoded
    assert client.status(job)["counts"]["succeeded"] == 8


class BrittleEngine(RunOnlyEngine):
    """Breaks its contract on marked requests: prepare or collate raises."""

    def prepare(
        self, request: Request, tenant: str | None = None, prepared_media: bool = False
    ) -> Prepared:
        if "prepare-bomb" in str(request.messages):
            raise RuntimeError("a bug in prepare")
        return super().prepare(request)

    def collate(self, items: Sequence[Prepared]) -> Collated:
        if threading.current_thread().name.startswith("collate") and len(items) > 1:
            raise RuntimeError("a bug in a collating thread")
        return super().collate(items)


@pytest.mark.parametrize("pipeline", [True, False])
def test_a_stage_that_raises_fails_only_its_request(settings: Settings, pipeline: bool) -> None:
    client = Client(settings)
    items = [{"custom_id": f"ok-{n}", "messages": _conversation("text", n)} for n in range(5)]
    items.append({"custom_id": "bomb", "messages": [{"role": "user", "content": "prepare-bomb"}]})
    job = client.submit_many(items)
    loop = make_loop(_with(settings, pipeline=pipeline), BrittleEngine(RecordingEngine()))
    running = Running(loop)
    with running:
        wait_until(lambda: client.status(job)["finished"], timeout=30, what="job")
        assert running.thread.is_alive()  # nothing an input did stopped the loop
    outputs = _outputs(client, job)
    assert outputs.pop("bomb")[0] == "failed"
    assert {status for status, _, _ in outputs.values()} == {"succeeded"}
