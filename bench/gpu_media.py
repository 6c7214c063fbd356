"""GPU media check: media work on the GPU worker's device, and the prepare tier feeding it.

    make gpu-wheels                         # here: what the GPU machine lacks, into .whl/
    bash bench/gpu.sh --media               # there: installs .whl/ into a temporary target
    bash bench/gpu.sh --media --cpu-smoke   # the same code on CPU: tiny dims, fp32, < 90 s
    python -m bench.gpu_media --help

In one process, no Redis: a random-weight checkpoint with real dimensions (Qwen2.5-VL-3B by
default, ``vlmq.workers.demo.tiny`` size "real", bf16, built on the GPU by
``bench.gpu_bench.build_checkpoint``) and real-size media made at run time by the prepare
processes while it builds (1080p JPEG photos, 20 s 720p H.264 clips at 30 fps, GOP 60).

(a) **JPEG decode per photo**: the CPU reference (``decode_image``: Pillow, draft + bicubic)
    against ``workers/media/device.py`` on the device: ``NvJpegDecoder.decode`` one photo at a
    time (the loader's path), ``decode_jpegs`` in batches (nvJPEG, resized on the device,
    brought back), and ``decode_jpeg`` alone (full size, left on the device).
(b) **GPU decode vs CPU decode**: pixel error at the processor's target, and greedy tokens of
    the engine on GPU-decoded against CPU-decoded photos (with a second CPU run: the baseline).
(c) **CUDA video decode** against the CPU (PyAV) where torchcodec imports; else skipped, saying
    why, with what the routing rule (``video_route``) decides for these clips.
(d) **Accelerator busy**: the worker preparing its own media on its prepare threads (CPU
    decode; nvJPEG for photos) against media prepared ahead by prepare processes (one per core,
    ``PrepareLoop``'s load into a ``file://`` frame store) and read back by the worker. The
    accelerator is the GPU (real generate) where CUDA is, else the simulated H200-like one.

Medians of ``--repeats`` rounds with their spread; distinct media each round, the media cache
off. A time budget (``--time-budget-s``, default 360 s; gpu.sh stops the run at 405 s, so a
call stays under 7 minutes) skips and names what would not fit; the table (bench/GPU.md,
``<!-- gpu-media -->``; --cpu-smoke: under --workdir) is rewritten after every step, so a run
cut short still leaves what it measured. (e), issue 36's figures: bench/gpu_device_media.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import queue
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.prepare_procs import downscale_json, make_clip, make_photo, prepare_ahead, warm_up

# Torch is imported in functions only: the prepare processes are spawned and import this module.
if TYPE_CHECKING:
    from multiprocessing.pool import Pool

    from vlmq.config.schemas import Request
    from vlmq.config.settings import MediaSettings

__all__ = ["Plan", "Report", "main", "plan_from_args", "render", "run"]

MARKER = "gpu-media"
DEFAULT_WRITE = Path("bench/GPU.md")
SMOKE_ENV = "VLMQ_GPU_MEDIA_CPU_SMOKE"
TENANT = "gpu-media"
PROMPTS = {"image": "What is in the picture?", "video": "What happens in the clip?"}
_DEVICE_LOGGER = "vlmq.workers.media.device"


def _cores() -> int:
    """Cores this process may use (a sandbox may report the host's in ``os.cpu_count``)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 2


GPU_DEFAULTS: dict[str, Any] = {
    "size": "real",
    "device": "cuda",
    "dtype": "bfloat16",
    "photo_size": (1920, 1080),
    "clip_size": (1280, 720),
    "clip_seconds": 20,
    "decode_photos": 64,
    "jpeg_batch": 32,
    "agree": 16,
    "agree_tokens": 32,
    "photos": 32,
    "clips": 8,
    "batch_sizes": {"image": 8, "video": 4},
    "new_tokens": 16,
    "repeats": 3,
    "procs": _cores(),
    "threads": max(1, _cores() - 1),  # the worker's default preprocess_workers
    "time_budget_s": 360.0,
    "workdir": Path(".vlmq/gpu-media"),
}
SMOKE_DEFAULTS: dict[str, Any] = {
    **GPU_DEFAULTS,
    "size": "tiny",
    "device": "cpu",
    "dtype": "float32",
    "photo_size": (480, 270),
    "clip_size": (320, 180),
    "clip_seconds": 2,
    "decode_photos": 4,
    "jpeg_batch": 4,
    "agree": 2,
    "agree_tokens": 4,
    "photos": 4,
    "clips": 2,
    "batch_sizes": {"image": 4, "video": 2},
    "new_tokens": 4,
    "repeats": 2,
    "procs": 2,
    "threads": 1,
    "time_budget_s": 80.0,
    "workdir": Path(".vlmq/gpu-media-smoke"),
}


# ---------------------------------------------------------------------------------------------
# plan and report
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """Everything one run does, resolved from the command line (and --cpu-smoke)."""

    family: str
    size: str
    model: Path | None  # an existing checkpoint; None: build one under the workdir
    device: str
    dtype: str
    photo_size: tuple[int, int]
    clip_size: tuple[int, int]
    clip_seconds: int
    decode_photos: int  # (a) and (b)
    jpeg_batch: int
    agree: int  # (b): requests compared token by token
    agree_tokens: int
    photos: int  # (d): per round
    clips: int  # (d): per round
    batch_sizes: dict[str, int]
    new_tokens: int
    repeats: int
    procs: int  # prepare processes
    threads: int  # the self-preparing worker's prepare threads
    time_budget_s: float
    workdir: Path
    write: Path | None
    smoke: bool
    command: str
    nvdec_only: bool = False  # the NVDEC call (.whl-nvdec): no engine, only (e)'s video
    progress: Path | None = None  # progress lines also go here, line by line ($OUT)

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")


@dataclass
class DecodeRow:
    variant: str
    batch: int
    ms_per_item: list[float]
    fallbacks: int = 0


@dataclass(frozen=True)
class PixelRow:
    what: str
    target: str
    items: int
    mean_abs: float
    p99_abs: int
    max_abs: int
    mismatched: int


@dataclass(frozen=True)
class AgreeRow:
    comparison: str
    requests: int
    identical: int
    prefix: float  # mean share of tokens before the first difference


@dataclass
class VideoRow:
    variant: str
    ms_per_clip: list[float]


@dataclass(frozen=True)
class BusyRun:
    """One workload through one variant of (d)."""

    items: int
    wall_s: float
    generate_s: float
    gpu_cpu_s: float
    decodes: int
    store_hits: int
    prepare_wall_s: float = 0.0
    prepare_cpu_s: float = 0.0

    @property
    def busy(self) -> float:
        return min(1.0, self.generate_s / self.wall_s) if self.wall_s > 0 else 0.0

    @property
    def prepare_cpu_per_item(self) -> float:
        return self.prepare_cpu_s / self.items

    @property
    def cores_per_accelerator(self) -> float:
        """Prepare cores that keep one accelerator busy: its item rate x CPU per item."""
        return self.prepare_cpu_s / max(self.generate_s, 1e-9)


@dataclass
class Report:
    """What a run measured and skipped, rendered as markdown at any point."""

    plan: Plan
    machine: str = ""
    gpu: str = ""
    accelerator: str = ""
    decoder: str = ""
    setups: list[tuple[str, float, str]] = field(default_factory=list)
    decode: list[DecodeRow] = field(default_factory=list)
    pixels: list[PixelRow] = field(default_factory=list)
    agree: list[AgreeRow] = field(default_factory=list)
    video_route: str = ""
    video: list[VideoRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    busy: dict[tuple[str, str], list[BusyRun]] = field(default_factory=dict)
    device_media: list[str] = field(default_factory=list)  # (e): bench/gpu_device_media.py
    skipped: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    finished: bool = False


# ---------------------------------------------------------------------------------------------
# measuring helpers
# ---------------------------------------------------------------------------------------------


def spread(values: Sequence[float], fmt: str = ".2f") -> str:
    """Median (min-max), or the one value."""
    if not values:
        return "-"
    middle = format(statistics.median(values), fmt)
    if len(values) == 1:
        return middle
    return f"{middle} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def agreement(comparison: str, base: list[list[int]], other: list[list[int]]) -> AgreeRow:
    """How far greedy outputs agree, request by request."""
    shares = [
        common_prefix(a, b) / max(len(a), len(b), 1) for a, b in zip(base, other, strict=True)
    ]
    identical = sum(a == b for a, b in zip(base, other, strict=True))
    return AgreeRow(comparison, len(base), identical, statistics.fmean(shares) if shares else 0.0)


class _Warnings(logging.Handler):
    """Counts warnings: the device decoder logs one each time it falls back to the CPU."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


@contextmanager
def counting_fallbacks() -> Iterator[_Warnings]:
    logger = logging.getLogger(_DEVICE_LOGGER)
    handler = _Warnings()
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def pixel_row(what: str, pairs: Sequence[tuple[Any, Any]]) -> PixelRow:
    """Mean, 99th percentile and max absolute error over (reference, other) uint8 images."""
    import numpy as np

    histogram = np.zeros(256, dtype=np.int64)
    mismatched = 0
    target = "-"
    for reference, other in pairs:
        a = np.asarray(reference, dtype=np.int16)
        b = np.asarray(other, dtype=np.int16)
        if a.shape != b.shape:
            mismatched += 1
            continue
        target = f"{a.shape[1]}x{a.shape[0]}"
        histogram += np.bincount(np.abs(a - b).ravel(), minlength=256)
    total = int(histogram.sum())
    if total == 0:
        return PixelRow(what, target, len(pairs), 0.0, 0, 0, mismatched)
    values = np.arange(256)
    cumulative = np.cumsum(histogram)
    return PixelRow(
        what,
        target,
        len(pairs),
        float((histogram * values).sum() / total),
        int(np.searchsorted(cumulative, 0.99 * total)),
        int(values[histogram > 0].max()),
        mismatched,
    )


def media_request(kind: str, path: Path, max_new_tokens: int) -> Request:
    from vlmq.config.schemas import Request

    part = {"type": kind, kind: str(path)}
    content = [part, {"type": "text", "text": PROMPTS[kind]}]
    return Request.model_validate(
        {
            "custom_id": path.stem,
            "messages": [{"role": "user", "content": content}],
            "generation": {"max_new_tokens": max_new_tokens},
        }
    )


def greedy_tokens(engine: Any, requests: Sequence[Request]) -> list[list[int]]:
    """Each request's greedy tokens through the engine's steps; any failure raises."""
    prepared = [engine.prepare(r) for r in requests]
    failed = [p for p in prepared if p.error is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed to prepare: {failed[0].error}")
    tokens: dict[str, list[int]] = {}
    for micro in engine.plan(prepared):
        for outcome in engine.generate(engine.collate(micro)):
            if outcome.completion is None:
                raise RuntimeError(f"generate failed: {outcome.error}")
            tokens[outcome.prepared.request.id] = list(outcome.completion.token_ids)
    return [tokens[r.id] for r in requests]


class Stages:
    """The pipelined worker's stages in one process, without the queue (the shape of
    workers/fleet/pipeline.py): a feeder hands each pulled batch's requests to the prepare
    threads, at most ``prefetch`` batches ahead of generate; a planner waits for a batch, cuts
    its micro-batches and hands them to the same threads to collate; the model thread (the
    caller's) generates them in order."""

    def __init__(
        self,
        accelerator: Any,
        threads: int,
        tenant: str | None,
        prepared_media: bool,
        prefetch: int,
    ) -> None:
        self.accelerator = accelerator
        self.threads = threads
        self.tenant = tenant
        self.prepared_media = prepared_media
        self.slots = threading.Semaphore(prefetch)
        self.planning: queue.Queue[list[Future[Any]] | None] = queue.Queue()
        self.ready: queue.Queue[tuple[Future[Any], bool] | None] = queue.Queue()
        self.prepared: list[Any] = []
        self.pool: ThreadPoolExecutor | None = None

    def run(self, requests: Sequence[Request], batch: int) -> list[Any]:
        """Every request through the stages: the results, in the order generated."""
        results: list[Any] = []
        with ThreadPoolExecutor(self.threads, thread_name_prefix="prepare") as pool:
            self.pool = pool
            stages = [
                threading.Thread(target=self._feed, args=(list(chunks(requests, batch)),)),
                threading.Thread(target=self._plan),
            ]
            for stage in stages:
                stage.start()
            while (entry := self.ready.get()) is not None:
                collated, last_of_batch = entry
                self.accelerator.submit(collated.result())
                results += self.accelerator.poll("gpu-media")
                if last_of_batch:
                    self.slots.release()
            for stage in stages:
                stage.join()
        return results

    def _feed(self, batches: list[Sequence[Request]]) -> None:
        assert self.pool is not None
        try:
            for batch in batches:
                self.slots.acquire()
                prepare = self.accelerator.prepare
                futures = [
                    self.pool.submit(prepare, r, self.tenant, self.prepared_media) for r in batch
                ]
                self.planning.put(futures)
        finally:
            self.planning.put(None)

    def _plan(self) -> None:
        assert self.pool is not None
        try:
            while (futures := self.planning.get()) is not None:
                items = [future.result() for future in futures]  # prepare never raises
                self.prepared += items
                micro = self.accelerator.plan([i for i in items if i.error is None])
                if not micro:
                    self.slots.release()
                for n, items_of in enumerate(micro):
                    collated = self.pool.submit(self.accelerator.collate, items_of)
                    self.ready.put((collated, n == len(micro) - 1))
        finally:
            self.ready.put(None)


def feed(
    accelerator: Any,
    requests: Sequence[Request],
    threads: int,
    batch: int,
    tenant: str | None,
    prepared_media: bool,
) -> BusyRun:
    """``requests`` in pulled batches of ``batch`` through :class:`Stages` with ``threads``
    prepare threads and the worker's GIL switch interval and prefetch: the accelerator's busy
    share of the wall time. ``prepared_media``: the media are read back from the frame store."""
    from vlmq.config.settings import WorkerSettings

    worker = WorkerSettings()
    stats = accelerator.stats
    generate_before = stats.generate_s
    switch = sys.getswitchinterval()
    sys.setswitchinterval(worker.gil_switch_interval_s)  # as the pipelined worker does
    stages = Stages(accelerator, threads, tenant, prepared_media, worker.prefetch_batches)
    cpu = time.process_time()
    started = time.perf_counter()
    try:
        results = stages.run(requests, batch)
        wall = time.perf_counter() - started
        cpu_s = time.process_time() - cpu
    finally:
        sys.setswitchinterval(switch)
    failed = [p.error for p in stages.prepared if p.error is not None]
    failed += [r.error for r in results if r.status != "succeeded"]
    if failed or len(results) != len(requests):
        raise RuntimeError(f"{len(requests) - len(results)} not run, failed: {failed[:1]}")
    return BusyRun(
        items=len(requests),
        wall_s=wall,
        generate_s=stats.generate_s - generate_before,
        gpu_cpu_s=cpu_s,
        decodes=sum(int(p.timings.get("media_decodes", 0)) for p in stages.prepared),
        store_hits=sum(int(p.timings.get("frame_store_hits", 0)) for p in stages.prepared),
    )


def prepare_in_processes(pool: Pool, jobs: list[str]) -> tuple[float, float, int, int]:
    """Prepare every job ahead in the prepare processes: (wall, CPU seconds, decodes, store
    hits)."""
    started = time.perf_counter()
    outcomes = [json.loads(text) for text in pool.map(prepare_ahead, jobs, chunksize=1)]
    wall = time.perf_counter() - started
    return (
        wall,
        sum(o["cpu_s"] for o in outcomes),
        sum(o["decodes"] for o in outcomes),
        sum(o["store_hits"] for o in outcomes),
    )


def decode_only(datas: Sequence[bytes], batch: int, device: str) -> None:
    """Batched ``decode_jpeg`` alone: full size, the images left on the device."""
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    for chunk in chunks(datas, batch):
        encoded = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in chunk]
        decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def torchcodec_frames(data: bytes, reference: Any, device: str) -> Any:
    """The reference's sampled frames decoded by torchcodec on ``device`` and resized there
    to the reference's size (bicubic, antialiased): (N, H, W, 3) uint8 on the host."""
    import torch
    from torchcodec.decoders import VideoDecoder
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2 import functional as tvf

    decoder = VideoDecoder(data, device=device)
    seconds = [(index + 0.5) / reference.fps for index in reference.frame_indices]
    frames = decoder.get_frames_played_at(seconds=seconds).data  # (N, 3, H, W) uint8
    size = [reference.height, reference.width]
    if list(frames.shape[-2:]) != size:
        resized = tvf.resize(frames.float(), size, InterpolationMode.BICUBIC, antialias=True)
        frames = resized.round_().clamp_(0, 255).to(torch.uint8)
    return frames.permute(0, 2, 3, 1).contiguous().cpu().numpy()


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------


@dataclass
class Media:
    """The media paths of one run."""

    decode: list[Path]
    photos: list[list[Path]]  # per round
    clips: list[list[Path]]  # per round


class Runner:
    """Walks the plan under the budget; every step logs, records and survives failures."""

    def __init__(self, plan: Plan) -> None:
        from bench.gpu_bench import Budget, Clock

        self.plan = plan
        self.clock = Clock(progress=plan.progress)
        self.budget = Budget(self.clock, plan.time_budget_s)
        self.report = Report(plan)
        self.engine: Any = None
        self.accelerator: Any = None
        self.device_decoder: Any = None
        self.media_settings: MediaSettings | None = None
        self.targets: tuple[Any, Any] = (None, None)
        self.frames_url = ""
        self._pending_media: tuple[Any, ...] = ()

    # bookkeeping -------------------------------------------------------------------------
    def _skip(self, message: str) -> None:
        self.clock.say(message)
        self.report.skipped.append(message)
        self._publish()

    def _fail(self, what: str, exc: BaseException) -> None:
        traceback.print_exc()
        message = f"{what}: failed: {type(exc).__name__}: {str(exc)[:300]}"
        self.clock.say(message)
        self.report.failed.append(message)
        self._publish()

    def _publish(self) -> None:
        self.report.elapsed_s = self.clock.elapsed()
        if self.plan.write:
            from bench.common import replace_section

            self.plan.write.parent.mkdir(parents=True, exist_ok=True)
            replace_section(self.plan.write, MARKER, render(self.report))

    def _step(self, kind: str, what: str, action: Callable[[], object]) -> bool:
        """Run ``action`` unless the budget refuses it; False when refused or failed."""
        reason = self.budget.refuse([kind], what)
        if reason:
            self._skip(reason)
            return False
        started = time.perf_counter()
        try:
            action()
        except Exception as exc:
            self._fail(what, exc)
            return False
        self.budget.record(kind, time.perf_counter() - started)
        self._publish()
        return True

    # the whole run -------------------------------------------------------------------------
    def run(self) -> Report:
        from bench.common import machine

        plan = self.plan
        self.clock.say(f"plan: {plan.command}")
        self.report.machine = machine()
        self.report.gpu = _gpu_line()
        frames_dir = Path(tempfile.mkdtemp(prefix="vlmq-gpu-media-frames-"))
        self.frames_url = f"file://{frames_dir}"
        pool = multiprocessing.get_context("spawn").Pool(plan.procs, initializer=warm_up)
        try:
            media = self._media(pool)
            if plan.nvdec_only:
                if media is not None and self._wait_media():
                    self._bare_media()
                    self._step("nvdec", "(e) NVDEC video", lambda: self._nvdec(pool, media))
            elif self._engine() and media is not None:
                self._step(
                    "decode", "(a)+(b) JPEG decode and pixel error", lambda: self._decode(media)
                )
                self._step("agree", "(b) greedy agreement", lambda: self._agreement(media))
                self._step("video", "(c) video decode", lambda: self._video(media))
                self._step("device", "(e) photos on the device", lambda: self._photos(media))
                self._step("nvdec", "(e) NVDEC video", lambda: self._nvdec(pool, media))
                self._busy(pool, media)
        finally:
            pool.terminate()
            pool.join()
            shutil.rmtree(frames_dir, ignore_errors=True)
            if self.engine is not None:
                self.engine.close()
        self.report.finished = True
        self._publish()
        return self.report

    # media and the engine --------------------------------------------------------------------
    def _media(self, pool: Pool) -> Media | None:
        """Make the run's media in the prepare processes while the checkpoint is built (the
        wait is in ``_engine``'s shadow); None when making it failed."""
        plan = self.plan
        folder = (plan.workdir / "media").resolve()
        folder.mkdir(parents=True, exist_ok=True)
        (pw, ph), (cw, ch) = plan.photo_size, plan.clip_size

        def photo(seed: int) -> Path:
            return folder / f"photo-{pw}x{ph}-{seed}.jpg"

        def clip(seed: int) -> Path:
            return folder / f"clip-{cw}x{ch}-{plan.clip_seconds}s-{seed}.mp4"

        media = Media(
            decode=[photo(s) for s in range(plan.decode_photos)],
            photos=[
                [photo(1000 + r * plan.photos + i) for i in range(plan.photos)]
                for r in range(plan.repeats)
            ],
            clips=[
                [clip(1000 + r * plan.clips + i) for i in range(plan.clips)]
                for r in range(plan.repeats)
            ],
        )
        photo_args = [
            (str(p), pw, ph, int(p.stem.rsplit("-", 1)[1]))
            for p in media.decode + [p for ps in media.photos for p in ps]
        ]
        clip_args = [
            (str(c), cw, ch, plan.clip_seconds, int(c.stem.rsplit("-", 1)[1]))
            for cs in media.clips
            for c in cs
        ]
        started = time.perf_counter()
        clips_made = pool.starmap_async(make_clip, clip_args, chunksize=1)
        photos_made = pool.starmap_async(make_photo, photo_args, chunksize=4)
        self._pending_media = (clips_made, photos_made, started, len(photo_args), len(clip_args))
        return media

    def _wait_media(self) -> bool:
        clips_made, photos_made, started, n_photos, n_clips = self._pending_media
        try:
            photos_made.get(timeout=max(1.0, self.plan.time_budget_s - self.clock.elapsed()))
            clips_made.get(timeout=max(1.0, self.plan.time_budget_s - self.clock.elapsed()))
        except Exception as exc:
            self._fail("making the media", exc)
            return False
        seconds = time.perf_counter() - started
        plan = self.plan
        detail = (
            f"{n_photos} photos {plan.photo_size[0]}x{plan.photo_size[1]} JPEG q90, {n_clips} "
            f"clips {plan.clip_size[0]}x{plan.clip_size[1]} H.264 {plan.clip_seconds} s 30 fps "
            f"GOP 60, on {plan.procs} processes (kept under {plan.workdir}/media)"
        )
        self.report.setups.append(("media", seconds, detail))
        self.clock.say(f"media ready after {seconds:.1f} s: {detail}")
        return True

    def _engine(self) -> bool:
        """Build (or take) the checkpoint, wait for the media, load the engine."""
        path = self._checkpoint()
        if not self._wait_media() or path is None:
            return False
        try:
            self._load(path)
        except Exception as exc:
            self._fail("loading the engine", exc)
            return False
        return True

    def _checkpoint(self) -> Path | None:
        from bench.gpu_bench import build_checkpoint, model_name

        plan = self.plan
        if plan.model is not None:
            self.report.setups.append(("checkpoint", 0.0, f"given: {plan.model}"))
            return plan.model
        out = (plan.workdir / "models" / f"{plan.family}-{plan.size}-{plan.dtype}").resolve()
        self.clock.say(f"checkpoint {out} ({plan.size} dims, {plan.dtype}, {plan.device})")
        try:
            built = build_checkpoint(out, plan.family, plan.size, plan.device, plan.dtype)
        except Exception as exc:
            if not plan.cuda:
                self._fail("building the checkpoint", exc)
                return None
            # One chance on a lent GPU: the slower CPU build rather than no figures.
            self._fail(f"building the checkpoint on {plan.device} (building on the CPU)", exc)
            try:
                built = build_checkpoint(out, plan.family, plan.size, "cpu", plan.dtype)
            except Exception as cpu_exc:
                self._fail("building the checkpoint on the CPU", cpu_exc)
                return None
        how = "reused" if built.reused else "built"
        detail = (
            f"{model_name(plan.family, plan.size)} dimensions, random weights, {plan.dtype}: "
            f"{_params(built.params)} params, {built.gib:.2f} GiB safetensors ({how})"
        )
        self.report.setups.append(("checkpoint", built.build_s, detail))
        self.clock.say(f"checkpoint {how} in {built.build_s:.1f} s: {detail}")
        return out

    def _load(self, path: Path) -> None:
        from vlmq.config.settings import EngineSettings, FrameStoreSettings, MediaSettings
        from vlmq.stores.urls import open_store
        from vlmq.workers.engine import Engine
        from vlmq.workers.engine.noop import (
            DECODE_STEP_S,
            PREFILL_BASE_S,
            PREFILL_TOKEN_S,
            SimulatedAccelerator,
        )
        from vlmq.workers.engine.prepare import visual_downscale
        from vlmq.workers.media import MediaLoader
        from vlmq.workers.media.prepared.framestore import FrameStore

        plan = self.plan
        media = MediaSettings(
            local_roots=[str(plan.workdir.resolve())],
            cache_bytes=0,  # distinct media each round anyway; no variant may reuse another's
            frame_store=FrameStoreSettings(url=self.frames_url),
        )
        settings = EngineSettings(
            device=plan.device,
            dtype=plan.dtype,
            max_new_tokens_default=plan.new_tokens,
            fixed_output_length=True,
            token_budget=10**7,
            length_bucketing=False,
            max_batch_size=max(plan.batch_sizes.values()),
        )
        frames = FrameStore(open_store(self.frames_url), media.frame_store, media)
        loader = MediaLoader(media, frames=frames)
        started = time.perf_counter()
        engine = Engine(str(path), settings, media, loader).setup()
        seconds = time.perf_counter() - started
        self.engine, self.media_settings = engine, media
        self.targets = visual_downscale(engine.loaded.processor)
        self.device_decoder, self.report.decoder = _device_decoder(plan.device)
        if plan.cuda:
            self.accelerator = engine
            self.report.accelerator = f"the GPU ({plan.device}): the engine's own generate"
        else:
            self.accelerator = SimulatedAccelerator(
                engine, PREFILL_BASE_S, DECODE_STEP_S, PREFILL_TOKEN_S
            )
            self.report.accelerator = (
                "simulated H200-like (no CUDA): generate sleeps "
                f"{PREFILL_BASE_S * 1000:.0f} ms a micro-batch + {PREFILL_TOKEN_S * 1e6:.0f} us "
                f"a prompt token + {DECODE_STEP_S * 1000:.0f} ms a decode step"
            )
        image, video = self.targets
        detail = f"image target: {_target(image)}; video frame target: {_target(video)}"
        self.report.setups.append(("load", seconds, detail))
        self.clock.say(f"engine loaded in {seconds:.1f} s: {detail}")

    @contextmanager
    def _decoder(self, decoder: Any) -> Iterator[None]:
        """The engine's image decoder for a while: ``None`` is the CPU reference. (The engine
        picks it once at setup from ``media.device_decode``; a benchmark compares both.)"""
        preparer = self.engine._preparer
        before = preparer.image_decoder
        preparer.image_decoder = decoder
        try:
            yield
        finally:
            preparer.image_decoder = before

    # (a), (b), (c) -------------------------------------------------------------------------------
    def _decode(self, media: Media) -> None:
        from vlmq.workers.media.device import decode_jpegs
        from vlmq.workers.media.image import decode_image

        plan, settings, decoder = self.plan, self.media_settings, self.device_decoder
        assert settings is not None
        target = self.targets[0]
        datas = [p.read_bytes() for p in media.decode]
        device, batch, label = decoder.device, plan.jpeg_batch, _short(self.report.decoder)

        def batched() -> list[Any]:
            return [
                image
                for chunk in chunks(datas, batch)
                for image in decode_jpegs(chunk, settings, [target] * len(chunk), device)
            ]

        variants: list[tuple[str, int, Callable[[], object]]] = [
            (
                "CPU: `decode_image` (Pillow: JPEG draft + bicubic), one thread",
                1,
                lambda: [decode_image(d, settings, target) for d in datas],
            ),
            (
                f"{label}: `NvJpegDecoder.decode`, one at a time (the loader's path)",
                1,
                lambda: [decoder.decode(d, settings, target) for d in datas],
            ),
            (f"{label}: `decode_jpegs`, resized on the device, to the host", batch, batched),
            (
                f"{label}: `decode_jpeg` alone, full size, left on the device",
                batch,
                lambda: decode_only(datas, batch, device),
            ),
        ]
        for name, size, action in variants:
            with counting_fallbacks() as warnings:
                action()  # warm-up: CUDA context, nvJPEG handles, first allocations
                ms = [timed(action) * 1000 / len(datas) for _ in range(plan.repeats)]
            row = DecodeRow(name, size, ms, warnings.count)
            self.report.decode.append(row)
            self.clock.say(f"(a) {name}: {spread(ms)} ms/photo, fallbacks {warnings.count}")
        cpu = [decode_image(d, settings, target) for d in datas]
        dev = batched()
        pixels = pixel_row(f"photos: {label} vs CPU", list(zip(cpu, dev, strict=True)))
        self.report.pixels.append(pixels)
        self.clock.say(f"(b) pixel error: {pixels}")

    def _agreement(self, media: Media) -> None:
        plan = self.plan
        requests = [
            media_request("image", p, plan.agree_tokens) for p in media.decode[: plan.agree]
        ]
        with self._decoder(None):
            reference = greedy_tokens(self.engine, requests)
            again = greedy_tokens(self.engine, requests)
        with self._decoder(self.device_decoder), counting_fallbacks() as warnings:
            device = greedy_tokens(self.engine, requests)
        label = _short(self.report.decoder)
        rows = [
            agreement("CPU decode, run again (the baseline)", reference, again),
            agreement(
                f"{label} decode vs CPU decode"
                + (f" ({warnings.count} fallbacks to the CPU)" if warnings.count else ""),
                reference,
                device,
            ),
        ]
        self.report.agree += rows
        for row in rows:
            self.clock.say(f"(b) {row}")

    def _video(self, media: Media) -> None:
        from vlmq.workers.media.device import cuda_available, torchcodec_available, video_route
        from vlmq.workers.media.video import decode_video

        plan, settings = self.plan, self.media_settings
        assert settings is not None
        target = self.targets[1]
        clips = media.clips[0][: max(1, min(4, plan.clips))]
        datas = [c.read_bytes() for c in clips]
        reference = [decode_video(d, settings, None, None, target) for d in datas]
        first = reference[0]
        samples_per_s = len(first.frames) / max(first.duration_s, 1e-9)
        route = video_route(
            plan.clip_size[1],
            samples_per_s,
            "auto",
            cuda_available(),
            torchcodec_available(),
            settings,
        )
        self.report.video_route = (
            f"`video_route` for these clips ({plan.clip_size[1]} rows, {samples_per_s:.2f} "
            f"samples/s), media.device_decode=auto: **{route.device}**: {route.reason}"
        )
        if not torchcodec_available():
            self._skip(
                "(c) CUDA video decode: skipped: torchcodec is not importable here (the GPU "
                "machine's image does not have it and cannot download it; its wheels do not "
                "bundle the FFmpeg shared libraries it needs either)"
            )
            return
        cpu_ms = [
            timed(lambda: [decode_video(d, settings, None, None, target) for d in datas])
            * 1000
            / len(datas)
            for _ in range(plan.repeats)
        ]
        device = plan.device if plan.cuda else "cpu"

        def on_device() -> list[Any]:
            return [torchcodec_frames(d, r, device) for d, r in zip(datas, reference, strict=True)]

        on_device()  # warm-up
        device_ms = [timed(on_device) * 1000 / len(datas) for _ in range(plan.repeats)]
        self.report.video += [
            VideoRow("CPU: `decode_video` (PyAV, exact sampling, downscaled)", cpu_ms),
            VideoRow(f"torchcodec on {device}: the same samples, resized on the device", device_ms),
        ]
        pairs = [
            (ref_frame, frame)
            for decoded, ref in zip(on_device(), reference, strict=True)
            for ref_frame, frame in zip(ref.frames, decoded, strict=False)
        ]
        self.report.pixels.append(pixel_row(f"clip frames: torchcodec on {device} vs PyAV", pairs))

    # (e) ---------------------------------------------------------------------------------------
    def _photos(self, media: Media) -> None:
        from bench.gpu_device_media import logits_lines, photo_lines
        from vlmq.workers.media.image import decode_image

        plan, settings = self.plan, self.media_settings
        assert settings is not None
        device = plan.device if plan.cuda else "cpu"
        datas = [p.read_bytes() for p in media.decode]
        lines, images = photo_lines(
            datas, settings, self.targets[0], device, plan.jpeg_batch, plan.repeats
        )
        self.report.device_media += lines
        self._publish()
        count = max(1, plan.agree)
        cpu_images = [decode_image(d, settings, self.targets[0]) for d in datas[:count]]
        self.clock.say("(e) logits agreement")
        self.report.device_media += logits_lines(self.engine.loaded, cpu_images, images[:count])

    def _bare_media(self) -> None:
        """Media settings and targets without an engine (the NVDEC call carries no llguidance
        to load one): a fixed target of ~448x448 pixels for photos and frames."""
        from vlmq.config.settings import MediaSettings
        from vlmq.workers.media.image import Downscale

        self.media_settings = MediaSettings(
            local_roots=[str(self.plan.workdir.resolve())], cache_bytes=0
        )
        target = Downscale(max_pixels=448 * 448)
        self.targets = (target, target)

    def _nvdec(self, pool: Pool, media: Media) -> None:
        from bench.gpu_device_media import video_lines

        plan, settings = self.plan, self.media_settings
        assert settings is not None
        clips = [c.read_bytes() for c in media.clips[0][: max(1, min(4, plan.clips))]]
        device = plan.device if plan.cuda else "cpu"
        self.report.device_media += video_lines(
            clips,
            settings,
            self.targets[1],
            device,
            plan.clip_seconds,
            pool,
            plan.procs,
            plan.repeats,
        )

    # (d) ---------------------------------------------------------------------------------------
    def _busy(self, pool: Pool, media: Media) -> None:
        for round_ in range(self.plan.repeats):
            what = f"(d) round {round_ + 1}/{self.plan.repeats}"
            if not self._step("round", what, partial(self._round, pool, media, round_)):
                return

    def _round(self, pool: Pool, media: Media, round_: int) -> None:
        plan = self.plan
        threads = f"{plan.threads} prepare thread{'s' if plan.threads > 1 else ''}"
        label = _short(self.report.decoder)
        for workload, kind, paths in (
            ("photos", "image", media.photos[round_]),
            ("clips", "video", media.clips[round_]),
        ):
            requests = [media_request(kind, p, plan.new_tokens) for p in paths]
            batch = plan.batch_sizes[kind]
            run = feed(self.accelerator, requests, plan.threads, batch, None, False)
            self._add(workload, f"self: {threads}, CPU decode", run)
            if kind == "image":
                with self._decoder(self.device_decoder), counting_fallbacks() as warnings:
                    run = feed(self.accelerator, requests, plan.threads, batch, None, False)
                self._add(workload, f"self: {threads}, {label} decode", run)
                if warnings.count:
                    self.report.notes.append(
                        f"(d) round {round_ + 1}: {label} fell back to the CPU {warnings.count} "
                        "times (the worker's log says why)"
                    )
            jobs = [self._job(kind, p) for p in paths]
            wall, cpu, decodes, _ = prepare_in_processes(pool, jobs)
            run = feed(self.accelerator, requests, plan.threads, batch, TENANT, True)
            run = replace(run, prepare_wall_s=wall, prepare_cpu_s=cpu)
            if decodes != len(paths) or run.store_hits != len(paths):
                raise RuntimeError(
                    f"{workload}: prepared ahead {decodes}/{len(paths)}, read back "
                    f"{run.store_hits}/{len(paths)} from the frame store"
                )
            self._add(workload, f"prepared ahead by {plan.procs} processes", run)

    def _job(self, kind: str, path: Path) -> str:
        assert self.media_settings is not None
        target = self.targets[0] if kind == "image" else self.targets[1]
        return json.dumps(
            {
                "kind": kind,
                "source": str(path),
                "target": downscale_json(target),
                "tenant": TENANT,
                "media": self.media_settings.model_dump_json(),
                "store": self.frames_url,
            }
        )

    def _add(self, workload: str, variant: str, run: BusyRun) -> None:
        self.report.busy.setdefault((workload, variant), []).append(run)
        self.clock.say(
            f"(d) {workload} / {variant}: busy {run.busy:.2f}, {run.items} in {run.wall_s:.2f} s"
        )


def run(plan: Plan) -> Report:
    return Runner(plan).run()


def _device_decoder(device: str) -> tuple[Any, str]:
    """The device image decoder and what to call it: nvJPEG through the worker's own choice
    (``device_image_decoder``) on CUDA; without CUDA, the same class decoding on the CPU
    (torchvision's ``decode_jpeg``), so the smoke run walks the same code."""
    from vlmq.config.settings import MediaSettings
    from vlmq.workers.media.device import NvJpegDecoder, device_image_decoder

    if device.startswith("cuda"):
        chosen = device_image_decoder(MediaSettings(device_decode="auto"), device)
        if chosen is not None:
            return chosen, f"nvJPEG on {device}"
    return NvJpegDecoder("cuda", "cpu"), "torchvision on the CPU (no CUDA; same code, not nvJPEG)"


def _params(n: int) -> str:
    return f"{n / 1e9:.3f} B" if n >= 10**9 else f"{n / 1e6:.2f} M"


def _target(downscale: Any) -> str:
    if downscale is None:
        return "none"
    if downscale.cover:
        return f"cover {downscale.cover[0]}x{downscale.cover[1]}"
    return f"at most {downscale.max_pixels} pixels"


def _short(decoder: str) -> str:
    return decoder.split(" (", 1)[0]


def _gpu_line() -> str:
    import torch

    if not torch.cuda.is_available():
        return "GPU: none (CPU run)"
    props = torch.cuda.get_device_properties(0)
    return f"GPU: {props.name} ({props.total_memory / 2**30:.0f} GiB), CUDA {torch.version.cuda}"


# ---------------------------------------------------------------------------------------------
# rendering
# ---------------------------------------------------------------------------------------------


def _header(report: Report) -> list[str]:
    plan = report.plan
    status = "complete" if report.finished else "partial (still running or cut short)"
    lines = [
        f"Command: `{plan.command}`",
        "",
        f"Machine: {report.machine}. {report.gpu}.",
        "",
        f"Status: {status}; {report.elapsed_s:.0f} s of a {plan.time_budget_s:.0f} s budget. "
        f"Medians of {plan.repeats} repeats (min-max).",
    ]
    if report.setups:
        lines += ["", "| setup | seconds | detail |", "| --- | ---: | --- |"]
        lines += [f"| {name} | {s:.1f} | {detail} |" for name, s, detail in report.setups]
    return lines


def _decode_table(report: Report) -> list[str]:
    if not report.decode:
        return []
    plan = report.plan
    lines = [
        "",
        f"**(a) JPEG decode**, {plan.decode_photos} photos {plan.photo_size[0]}x"
        f"{plan.photo_size[1]} to the processor's image target; device decoder: "
        f"{report.decoder}.",
        "",
        "| variant | batch | ms / photo | photos / s | fallbacks to the CPU |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for row in report.decode:
        rate = [1000 / ms for ms in row.ms_per_item if ms > 0]
        lines.append(
            f"| {row.variant} | {row.batch} | {spread(row.ms_per_item)} | {spread(rate, '.0f')} "
            f"| {row.fallbacks} |"
        )
    return lines


def _pixel_tables(report: Report) -> list[str]:
    lines: list[str] = []
    if report.pixels:
        lines += [
            "",
            "**(b) GPU decode against the CPU reference**: absolute pixel error (0-255) at the "
            "processor's target.",
            "",
            "| what | size | items | mean | p99 | max | size mismatches |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        lines += [
            f"| {p.what} | {p.target} | {p.items} | {p.mean_abs:.2f} | {p.p99_abs} | "
            f"{p.max_abs} | {p.mismatched} |"
            for p in report.pixels
        ]
    if report.agree:
        plan = report.plan
        lines += [
            "",
            f"Greedy tokens of the engine ({plan.agree_tokens} new tokens, fixed length) on the "
            "same photos:",
            "",
            "| comparison | requests | identical outputs | mean agreeing prefix |",
            "| --- | ---: | ---: | ---: |",
        ]
        lines += [
            f"| {a.comparison} | {a.requests} | {a.identical} | {a.prefix:.0%} |"
            for a in report.agree
        ]
    return lines


def _video_table(report: Report) -> list[str]:
    lines: list[str] = []
    if report.video_route:
        lines += ["", f"**(c) video decode**: {report.video_route}."]
    if report.video:
        lines += ["", "| variant | ms / clip |", "| --- | ---: |"]
        lines += [f"| {v.variant} | {spread(v.ms_per_clip, '.0f')} |" for v in report.video]
    return lines


def _busy_table(report: Report) -> list[str]:
    if not report.busy:
        return []
    plan = report.plan
    lines = [
        "",
        f"**(d) accelerator busy**: {report.accelerator}. Per round {plan.photos} distinct "
        f"photos (batches of {plan.batch_sizes['image']}) and {plan.clips} distinct clips "
        f"(batches of {plan.batch_sizes['video']}, 2 fps, at most 16 frames), "
        f"{plan.new_tokens} new tokens. Self: the worker prepares on its own threads. Prepared "
        f"ahead: {plan.procs} prepare processes put the media in a `file://` frame store "
        "first (the accelerator idle), then the worker reads it back; busy is the worker's "
        "phase.",
        "",
        "| workload | variant | accelerator busy | worker CPU / request | prepare wall | "
        "prepare CPU / item | items/s per prepare core | prepare cores per accelerator |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for (workload, variant), runs in report.busy.items():
        ahead = any(r.prepare_cpu_s for r in runs)
        cells = [
            workload,
            variant,
            spread([r.busy for r in runs]),
            spread([r.gpu_cpu_s / r.items * 1000 for r in runs], ".1f") + " ms",
            spread([r.prepare_wall_s for r in runs]) + " s" if ahead else "-",
            spread([r.prepare_cpu_per_item * 1000 for r in runs], ".0f") + " ms" if ahead else "-",
            spread([1 / r.prepare_cpu_per_item for r in runs if r.prepare_cpu_s], ".1f")
            if ahead
            else "-",
            spread([r.cores_per_accelerator for r in runs], ".1f") if ahead else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def render(report: Report) -> str:
    lines = ["## GPU media check", "", *_header(report)]
    lines += _decode_table(report) + _pixel_tables(report) + _video_table(report)
    lines += _busy_table(report) + report.device_media
    if report.notes:
        lines += ["", "Notes:", ""] + [f"- {s}" for s in report.notes]
    if report.failed:
        lines += ["", "Failed:", ""] + [f"- {s}" for s in report.failed]
    if report.skipped:
        lines += ["", "Skipped:", ""] + [f"- {s}" for s in report.skipped]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------


def _size(text: str) -> tuple[int, int]:
    width, _, height = text.partition("x")
    if not (width.isdigit() and height.isdigit()):
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT, got {text!r}")
    return int(width), int(height)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu_media", description=(__doc__ or "").splitlines()[0]
    )
    add = parser.add_argument
    add("--cpu-smoke", action="store_true", help=f"tiny dims, fp32, CPU ({SMOKE_ENV}=1)")
    add("--family", default="qwen2_5_vl", help="qwen2_5_vl, qwen3_vl or internvl")
    add("--model", type=Path, default=None, help="an existing checkpoint (default: build one)")
    add("--size", default=None, help="checkpoint size (default real; tiny with --cpu-smoke)")
    add("--device", default=None, help="default cuda (cpu with --cpu-smoke)")
    add("--dtype", default=None, help="default bfloat16 (float32 with --cpu-smoke)")
    add("--photo-size", type=_size, default=None, help="default 1920x1080")
    add("--clip-size", type=_size, default=None, help="default 1280x720")
    add("--clip-seconds", type=int, default=None, help="default 20")
    add("--photos", type=int, default=None, help="(d) photos per round (default 32)")
    add("--clips", type=int, default=None, help="(d) clips per round (default 8)")
    add("--repeats", type=int, default=None, help="default 3")
    add("--procs", type=int, default=None, help="prepare processes (default: cores)")
    add("--threads", type=int, default=None, help="the worker's prepare threads (cores - 1)")
    add("--time-budget-s", type=float, default=None, help="default 360 (80 with --cpu-smoke)")
    add("--workdir", type=Path, default=None, help="default .vlmq/gpu-media")
    add("--write", default=None, help="markdown file (default bench/GPU.md; '' for none)")
    add("--nvdec-only", action="store_true", help="only (e)'s video figures, no engine")
    add("--progress", type=Path, default=None, help="also write progress lines to this file")
    return parser


def plan_from_args(argv: Sequence[str]) -> Plan:
    args = _parser().parse_args(list(argv))
    smoke = args.cpu_smoke or os.environ.get(SMOKE_ENV, "") not in ("", "0")
    defaults = SMOKE_DEFAULTS if smoke else GPU_DEFAULTS
    given = {
        "size": args.size,
        "device": args.device,
        "dtype": args.dtype,
        "photo_size": args.photo_size,
        "clip_size": args.clip_size,
        "clip_seconds": args.clip_seconds,
        "photos": args.photos,
        "clips": args.clips,
        "repeats": args.repeats,
        "procs": args.procs,
        "threads": args.threads,
        "time_budget_s": args.time_budget_s,
        "workdir": args.workdir,
    }
    values = {**defaults, **{k: v for k, v in given.items() if v is not None}}
    workdir = Path(values.pop("workdir")).resolve()
    write = args.write
    if write is None:
        write = str(workdir / "GPU.md") if smoke else str(DEFAULT_WRITE)
    return Plan(
        family=args.family,
        model=args.model.resolve() if args.model else None,
        workdir=workdir,
        write=Path(write) if write else None,
        smoke=smoke,
        command=shlex.join(["python", "-m", "bench.gpu_media", *argv]),
        nvdec_only=args.nvdec_only,
        progress=args.progress,
        **values,
    )


def _check(plan: Plan) -> str | None:
    from vlmq.workers.demo.tiny import FAMILIES

    if plan.family not in FAMILIES:
        return f"unknown family {plan.family!r} (one of {', '.join(FAMILIES)})"
    if plan.cuda:
        import torch

        if not torch.cuda.is_available():
            return "CUDA is not available here; use --cpu-smoke (or --device cpu)"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    plan = plan_from_args(sys.argv[1:] if argv is None else argv)
    problem = _check(plan)
    if problem:
        print(f"gpu_media: {problem}", file=sys.stderr)
        return 2
    report = run(plan)
    print(render(report), flush=True)
    if plan.write:
        print(f"wrote {plan.write}", flush=True)
    return 1 if report.failed else 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    raise SystemExit(main())
