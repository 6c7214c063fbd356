"""Does the pipelined worker keep the model busy? Real-size media through real fleet workers.

Media (bench/realmedia.py): 1080p JPEG photos and 720p H.264 clips of 20 s at 30 fps with a
keyframe every 2 s. Workloads, per modality: *distinct* media (32 photos, one prompt each;
8 clips, one prompt each) and *repeated* media (4 photos x 8 prompts; 2 clips x 4 prompts).
The model is the ``small`` Qwen2.5-VL checkpoint (random weights, real processors), 1 torch
thread, 16 new tokens per request (fixed length), batch 16 for images and 8 for video.

Sections, each side by side in one run, ``--repeats`` rounds (medians, spreads):

* **fleet**: one ``vlmq worker`` process per variant, all loaded at the start and paused
  (SIGSTOP) while another runs: ``before`` (a git worktree of the commit before issue 11:
  the serial loop, no downscale at decode, no cache), ``serial`` (this tree,
  ``VLMQ_WORKER__PIPELINE=false``: the serial loop with the per-item savings) and
  ``pipelined`` (this tree's default). Throughput is requests over submit-to-finished; the
  model-busy fraction is the sum of ``generate_s`` over the job's micro-batches over that
  wall. ``model alone`` is the upper bound: the same micro-batches collated in this process
  beforehand, only ``generate`` timed (the workers paused).
* **simulated accelerator**: the same workloads through ``--engine simulated`` workers
  (real media and processor work, ``generate`` a sleep of 5 ms per micro-batch + 20 us per
  prompt token, visual tokens included, + 4 ms per decode step: an H200-like 2-3B model),
  pipeline off, on with 1 and with 2 preprocessing workers; the model-busy fraction shows
  whether preprocessing keeps up.
* **processor**: the torchvision (fast) vs the pil (slow) image processor on 16 photos:
  collate seconds, how far their pixel values differ, whether greedy tokens change.
* **decode**: 16 sampled frames of a 20 s and a 60 s clip: in order vs seeking, frame vs
  slice decoder threads, unreferenced frames skipped or not; decode-time downscaling vs
  full-size decode (photos and clips, decode + processor).

    python -m bench.pipeline                           # everything, 3 repeats, writes README
    python -m bench.pipeline --sections fleet --repeats 1 --write ''
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from bench.common import machine, replace_section, wait_for
from bench.fencing import worktree
from bench.fleet import _stop
from bench.realmedia import clips, photos

ROOT = Path(__file__).resolve().parents[1]
# The last commit before the pipelined worker (issue 10's figures): the "before" variant.
BASELINE = "5952f69"
MARKER = "pipeline"
NEW_TOKENS = 16
BATCH = {"image": 16, "video": 8}
# 5 ms per micro-batch + 4 ms per decode step + 20 us per prompt token, visual tokens included
# (H200-like for a 2-3B model: workers/engine/noop.py). Figures before prompt tokens were
# charged used "0.015,0.004" (no per-token cost: video prefill was free).
SIMULATE = "0.005,0.004,0.00002"


# --- workloads -----------------------------------------------------------------------------


@dataclass
class Workload:
    name: str
    modality: str
    items: list[dict[str, Any]]


def _item(kind: str, source: Path, question: str, n: int) -> dict[str, Any]:
    part = {"type": kind, kind: str(source)}
    return {
        "custom_id": f"{kind}-{n}",
        "messages": [{"role": "user", "content": [part, f"{question} (request {n})"]}],
    }


def workloads(round_: int) -> list[Workload]:
    """The four workloads of one round, on media no earlier round used (a worker's cache
    keeps what it decoded and processed: a later round on the same media would measure
    the cache, not the work)."""
    questions = [
        "What is in the picture?",
        "Which colours dominate?",
        "Count the shapes.",
        "Describe the background.",
        "Is there any text?",
        "What is at the top left?",
        "Describe the lighting.",
        "Give it a title.",
    ]
    photo = photos(36, start=36 * round_)
    clip = clips(10, start=10 * round_)
    image_distinct = [_item("image", p, questions[0], n) for n, p in enumerate(photo[:32])]
    image_repeated = [_item("image", photo[32 + n // 8], questions[n % 8], n) for n in range(32)]
    video_distinct = [_item("video", c, "What happens?", n) for n, c in enumerate(clip[:8])]
    video_repeated = [_item("video", clip[8 + n // 4], questions[n % 4], n) for n in range(8)]
    return [
        Workload("image, distinct (32 photos)", "image", image_distinct),
        Workload("image, repeated (4 photos x 8)", "image", image_repeated),
        Workload("video, distinct (8 clips)", "video", video_distinct),
        Workload("video, repeated (2 clips x 4)", "video", video_repeated),
    ]


def _warm_up() -> Workload:
    photo = photos(1, start=10_000)[0]
    return Workload("warm-up", "image", [_item("image", photo, "Warm up.", n) for n in range(2)])


# --- workers -----------------------------------------------------------------------------


@dataclass
class Services:
    tmp: Path
    url: str
    results: str
    client: Any
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)


@contextmanager
def services() -> Iterator[Services]:
    from vlmq.config.settings import Settings
    from vlmq.producers.client import Client
    from vlmq.producers.localredis import LocalRedis

    with tempfile.TemporaryDirectory(prefix="vlmq-bench-pipeline-") as name:
        tmp = Path(name)
        server = LocalRedis(tmp / "redis").start()
        results = f"file://{tmp / 'results'}"
        bench = Services(
            tmp, server.url, results, Client(Settings(redis_url=server.url, results_url=results))
        )
        try:
            yield bench
        finally:
            for proc in bench.procs.values():
                _stop(proc)
            server.stop()


def _worker_env(bench: Services, model: Path, tree: Path, extra: dict[str, str]) -> dict[str, str]:
    policy = {
        m: {"max_batch_size": BATCH.get(m, 16), "max_wait_s": 0.05, "token_budget": 10**6}
        for m in ("text", "image", "video")
    }
    return {
        **os.environ,
        "PYTHONPATH": str(tree),
        "VLMQ_REDIS_URL": bench.url,
        "VLMQ_RESULTS_URL": bench.results,
        "VLMQ_BATCH": json.dumps(policy),
        "VLMQ_MODEL": str(model),
        "VLMQ_ENGINE__FIXED_OUTPUT_LENGTH": "true",
        "VLMQ_ENGINE__MAX_NEW_TOKENS_DEFAULT": str(NEW_TOKENS),
        "VLMQ_ENGINE__MAX_BATCH_SIZE": "16",
        "VLMQ_ENGINE__TORCH_THREADS": "1",
        "VLMQ_MEDIA__LOCAL_ROOTS": json.dumps([str(ROOT / ".vlmq")]),
        **extra,
    }


def start_worker(
    bench: Services, name: str, model: Path, tree: Path, extra: dict[str, str], *args: str
) -> subprocess.Popen[bytes]:
    log = (bench.tmp / f"{name}.log").open("wb")
    command = [sys.executable, "-m", "vlmq", "worker", "--modality", "image,video", "--name", name]
    proc = subprocess.Popen(
        [*command, "--no-celery", *args],
        cwd=tree,
        env=_worker_env(bench, model, tree, extra),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    bench.procs[name] = proc
    wait_for(lambda: _alive(bench, name) and _registered(bench, name), 600, f"worker {name}", 0.005)
    return proc


def _alive(bench: Services, name: str) -> bool:
    proc = bench.procs[name]
    if proc.poll() is not None:
        tail = (bench.tmp / f"{name}.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"worker {name} exited with {proc.returncode}:\n{tail}")
    return True


def _registered(bench: Services, name: str) -> bool:
    from vlmq.config.keys import Keys

    return bool(bench.client.redis.hexists(Keys().workers(), name))


@contextmanager
def running(bench: Services, name: str) -> Iterator[None]:
    """Only this worker runs (the others stay SIGSTOPped: no CPU, no pulls)."""
    proc = bench.procs[name]
    proc.send_signal(signal.SIGCONT)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGSTOP)


@dataclass
class JobRun:
    seconds: float
    generate_s: float
    outputs: dict[str, str]

    @property
    def busy(self) -> float:
        return min(1.0, self.generate_s / self.seconds)


def run_job(bench: Services, name: str, workload: Workload) -> JobRun:
    with running(bench, name):
        started = time.perf_counter()
        job = bench.client.submit_many(workload.items)
        done = partial(_job_finished, bench, job)
        wait_for(lambda: _alive(bench, name) and done(), 1200, "a job", 0.005)
        seconds = time.perf_counter() - started
    records = [bench.client.result(t) for t in bench.client.job_task_ids(job)]
    failed = [r for r in records if r.get("status") != "succeeded"]
    if failed:
        raise RuntimeError(f"{name}: {len(failed)} requests failed: {failed[0].get('error')}")
    per_batch = {r["batch_id"]: r["timings"].get("generate_s", 0.0) for r in records}
    outputs = {r["custom_id"]: r.get("output") or "" for r in records}
    _progress(
        f"{name}: {workload.name}: {seconds:.2f}s, busy {sum(per_batch.values()) / seconds:.2f}"
    )
    return JobRun(seconds, sum(per_batch.values()), outputs)


# --- the model alone -------------------------------------------------------------------------


def _engine(model: Path, **media: Any) -> Any:
    import torch

    from vlmq.config.settings import EngineSettings, MediaSettings
    from vlmq.workers.engine import Engine

    torch.set_num_threads(1)
    settings = EngineSettings(
        max_new_tokens_default=NEW_TOKENS,
        fixed_output_length=True,
        max_batch_size=16,
        torch_threads=1,
    )
    return Engine(
        str(model), settings, MediaSettings(local_roots=[str(ROOT / ".vlmq")], **media)
    ).setup()


def model_alone(engine: Any, workload: Workload) -> float:
    """Seconds of generate alone over the workload's micro-batches, collated beforehand."""
    from vlmq.config.schemas import Request

    requests = [Request.model_validate(item) for item in workload.items]
    batch = BATCH[workload.modality]
    total = 0.0
    for start in range(0, len(requests), batch):
        prepared = [engine.prepare(r) for r in requests[start : start + batch]]
        for micro in engine.plan(prepared):
            collated = engine.collate(micro)
            began = time.perf_counter()
            engine.generate(collated)
            total += time.perf_counter() - began
    return total


# --- sections ---------------------------------------------------------------------------------


@dataclass
class Report:
    repeats: int
    fleet: dict[tuple[str, str], list[JobRun]] = field(default_factory=dict)
    alone: dict[str, list[float]] = field(default_factory=dict)
    simulated: dict[tuple[str, str], list[JobRun]] = field(default_factory=dict)
    processor: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    same_outputs: dict[str, tuple[int, int]] = field(default_factory=dict)
    affinity: dict[str, list[tuple[float, int]]] = field(default_factory=dict)


def fleet_section(bench: Services, model: Path, report: Report, baseline: Path | None) -> None:
    variants: dict[str, tuple[Path, dict[str, str]]] = {}
    if baseline is not None:
        variants["before"] = (baseline, {})
    variants["serial"] = (ROOT, {"VLMQ_WORKER__PIPELINE": "false"})
    variants["pipelined"] = (ROOT, {})
    for name, (tree, extra) in variants.items():
        start_worker(bench, name, model, tree, extra)
        bench.procs[name].send_signal(signal.SIGSTOP)
    for name in variants:  # warm-up: one small job each
        run_job(bench, name, _warm_up())
    engine = _engine(model)
    try:
        for round_ in range(report.repeats):
            _progress(f"fleet round {round_ + 1}/{report.repeats}")
            for load in workloads(round_):
                for name in variants:
                    report.fleet.setdefault((load.name, name), []).append(
                        run_job(bench, name, load)
                    )
                report.alone.setdefault(load.name, []).append(model_alone(engine, load))
    finally:
        engine.close()
        for name in variants:
            _stop(bench.procs.pop(name))
    for load in workloads(0):
        serial = report.fleet[(load.name, "serial")]
        piped = report.fleet[(load.name, "pipelined")]
        same = sum(s.outputs == p.outputs for s, p in zip(serial, piped, strict=True))
        report.same_outputs[load.name] = (same, len(serial))


def simulated_section(bench: Services, model: Path, report: Report) -> None:
    variants = {
        "serial": {"VLMQ_WORKER__PIPELINE": "false", "VLMQ_WORKER__PREPROCESS_WORKERS": "1"},
        "pipelined, 1 preprocessing worker": {"VLMQ_WORKER__PREPROCESS_WORKERS": "1"},
        "pipelined, 2 preprocessing workers": {"VLMQ_WORKER__PREPROCESS_WORKERS": "2"},
    }
    names = {label: f"sim-{i}" for i, label in enumerate(variants)}
    for label, extra in variants.items():
        start_worker(
            bench, names[label], model, ROOT, extra, "--engine", "simulated", "--simulate", SIMULATE
        )
        bench.procs[names[label]].send_signal(signal.SIGSTOP)
    try:
        for label in variants:
            run_job(bench, names[label], _warm_up())
        for round_ in range(report.repeats):
            _progress(f"simulated round {round_ + 1}/{report.repeats}")
            for load in workloads(round_):
                for label in variants:
                    run = run_job(bench, names[label], load)
                    report.simulated.setdefault((load.name, label), []).append(run)
    finally:
        for name in names.values():
            _stop(bench.procs.pop(name))


def _job_finished(bench: Services, job: str) -> bool:
    return bool(bench.client.status(job)["finished"])


def _affinity_job(clip_paths: list[Path], grouped: bool) -> Workload:
    """Four clips, four questions each: one clip's questions next to each other (grouped:
    how a job usually lists them, and what grouping by media at submit would produce) or
    interleaved (every clip's first question, then every clip's second, ...)."""
    pairs = [(c, q) for c in range(4) for q in range(4)]
    if not grouped:
        pairs.sort(key=lambda pair: (pair[1], pair[0]))
    items = [_item("video", clip_paths[c], f"Question {q}.", n) for n, (c, q) in enumerate(pairs)]
    return Workload("grouped" if grouped else "interleaved", "video", items)


def affinity_section(bench: Services, model: Path, report: Report) -> None:
    """Two pipelined workers serving one video queue at once: how many clip decodes a job
    costs (requests not served from a worker's cache) and how long it takes, with the
    job's prompts grouped by clip or interleaved."""
    names = ("aff-a", "aff-b")
    for name in names:
        start_worker(bench, name, model, ROOT, {})
    try:
        for round_ in range(report.repeats):
            fresh = clips(8, start=10 * round_)  # not seen by these two workers before
            for grouped, paths in ((True, fresh[:4]), (False, fresh[4:])):
                load = _affinity_job(paths, grouped)
                started = time.perf_counter()
                job = bench.client.submit_many(load.items)
                wait_for(partial(_job_finished, bench, job), 1200, "a job", 0.005)
                seconds = time.perf_counter() - started
                records = [bench.client.result(t) for t in bench.client.job_task_ids(job)]
                hits = sum(int(r["timings"].get("media_cache_hits", 0)) for r in records)
                decodes = len(records) - hits
                report.affinity.setdefault(load.name, []).append((seconds, decodes))
                _progress(f"affinity {load.name}: {seconds:.2f}s, {decodes} decodes")
    finally:
        for name in names:
            _stop(bench.procs.pop(name))


def processor_section(model: Path, photo_paths: list[Path], report: Report) -> None:
    import torch

    from vlmq.config.schemas import Request
    from vlmq.config.settings import EngineSettings, MediaSettings
    from vlmq.workers.engine import Engine

    torch.set_num_threads(1)
    requests = [
        Request.model_validate(_item("image", p, "What is in the picture?", n))
        for n, p in enumerate(photo_paths[:16])
    ]
    engines = {}
    for backend in ("torchvision", "pil"):
        settings = EngineSettings(
            max_new_tokens_default=NEW_TOKENS,
            max_batch_size=16,
            torch_threads=1,
            image_processor_backend=backend,
        )
        media = MediaSettings(local_roots=[str(ROOT / ".vlmq")], cache_bytes=0)
        engines[backend] = Engine(str(model), settings, media).setup()
    prepared = {b: [e.prepare(r) for r in requests] for b, e in engines.items()}
    timings: dict[str, list[float]] = {b: [] for b in engines}
    collated: dict[str, Any] = {}
    for _ in range(report.repeats):
        for backend, engine in engines.items():
            began = time.perf_counter()
            collated[backend] = engine.collate(prepared[backend])
            timings[backend].append(time.perf_counter() - began)
    fast, slow = collated["torchvision"].inputs, collated["pil"].inputs
    diff = (fast["pixel_values"].float() - slow["pixel_values"].float()).abs()
    outputs = {
        b: [o.completion.token_ids for o in engines[b].generate(collated[b])] for b in engines
    }
    changed = sum(a != b for a, b in zip(outputs["torchvision"], outputs["pil"], strict=True))
    for engine in engines.values():
        engine.close()
    fast_s, slow_s = statistics.median(timings["torchvision"]), statistics.median(timings["pil"])
    report.processor = [
        "| image processor | collate 16 photos (median) | spread |",
        "| --- | ---: | --- |",
        f"| torchvision (fast, default) | {fast_s:.3f} s | {_spread(timings['torchvision'])} |",
        f"| pil (slow) | {slow_s:.3f} s | {_spread(timings['pil'])} |",
        "",
        f"Fast over slow: {slow_s / fast_s:.2f}x faster. Pixel values (normalised) differ by "
        f"at most {diff.max().item():.4f}, {diff.mean().item():.5f} on average; same shapes "
        f"({tuple(fast['pixel_values'].shape)}). Greedy tokens (16 new, random-weight small "
        f"checkpoint) differ for {changed} of {len(requests)} requests.",
    ]


def decode_section(model: Path, photo_paths: list[Path], report: Report) -> None:
    from vlmq.config.settings import EngineSettings, MediaSettings
    from vlmq.workers.engine.model import load_processor
    from vlmq.workers.engine.prepare import visual_downscale
    from vlmq.workers.media import decode_image, decode_video

    processor = load_processor(str(model), EngineSettings())
    image_target, video_target = visual_downscale(processor)
    rows = [
        "| media | variant | seconds (median) | spread | vs baseline |",
        "| --- | --- | ---: | --- | ---: |",
    ]

    def timed(call: Callable[[], Any]) -> list[float]:
        values = []
        for _ in range(report.repeats):
            began = time.perf_counter()
            call()
            values.append(time.perf_counter() - began)
        return values

    def add(media: str, variants: list[tuple[str, list[float]]]) -> None:
        base = statistics.median(variants[0][1])
        for label, values in variants:
            median = statistics.median(values)
            rows.append(
                f"| {media} | {label} | {median:.3f} | {_spread(values)} | {base / median:.2f}x |"
            )

    for seconds in (20, 60):
        data = clips(1, seconds)[0].read_bytes()
        no_skip = {"video_skip_unreferenced": False}
        variants = [
            (
                "before: in order, frame threads",
                MediaSettings(video_seek=False, video_thread_type="AUTO", **no_skip),
            ),
            ("in order, slice threads", MediaSettings(video_seek=False, **no_skip)),
            ("seek, every seek taken", MediaSettings(video_seek_min_skip_frames=0, **no_skip)),
            ("seek when it skips > 30 frames", MediaSettings(**no_skip)),
            ("... + unreferenced frames skipped (default)", MediaSettings()),
        ]
        measured = []
        for label, settings in variants:
            sample = partial(decode_video, data, settings, 2.0, 16, video_target)
            measured.append((label, timed(sample)))
        add(f"{seconds} s 720p clip, 16 frames", measured)
    photo = photo_paths[0].read_bytes()
    full = MediaSettings()

    def photo_with(downscale: Any) -> None:
        image = decode_image(photo, full, downscale)
        processor.image_processor([image], return_tensors="pt")

    add(
        "1080p JPEG, decode + image processor",
        [
            ("full-size decode", timed(lambda: photo_with(None))),
            ("downscaled at decode", timed(lambda: photo_with(image_target))),
        ],
    )
    clip = clips(1, 20)[0].read_bytes()

    def clip_with(downscale: Any) -> None:
        video = decode_video(clip, full, 2.0, 16, downscale)
        processor.video_processor([video.frames], return_tensors="pt", do_sample_frames=False)

    add(
        "20 s 720p clip, decode + video processor",
        [
            ("full-size frames", timed(lambda: clip_with(None))),
            ("downscaled at decode", timed(lambda: clip_with(video_target))),
        ],
    )
    report.decode = rows


# --- the report ----------------------------------------------------------------------------


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def _median_runs(runs: list[JobRun]) -> tuple[float, float, list[float]]:
    seconds = [r.seconds for r in runs]
    return statistics.median(seconds), statistics.median(r.busy for r in runs), seconds


def render(report: Report, loads: list[Workload], command: str) -> str:
    lines = [f"Command: `{command}`", "", f"Machine: {machine()}.", ""]
    if report.fleet:
        lines += _fleet_lines(report, loads)
    if report.simulated:
        lines += _simulated_lines(report, loads)
    if report.affinity:
        lines += _affinity_lines(report)
    if report.processor:
        title = "Image processors (16 photos of 1080p, downscaled at decode, one collate):"
        lines += [title, "", *report.processor, ""]
    if report.decode:
        title = "Decode (one thread; `vs baseline`: the first row of each medium over this one):"
        lines += [title, "", *report.decode, ""]
    return "\n".join(lines)


def _fleet_lines(report: Report, loads: list[Workload]) -> list[str]:
    lines = [
        "Real fleet workers (small Qwen2.5-VL checkpoint, 1 torch thread, 16 new tokens "
        "per request):",
        "",
        "| workload | variant | req/s (median) | wall s (spread) | model busy "
        "| vs before | vs serial |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: |",
    ]
    for load in loads:
        n = len(load.items)
        rates = {}
        for variant in ("before", "serial", "pipelined"):
            if (load.name, variant) not in report.fleet:
                continue
            median, busy, seconds = _median_runs(report.fleet[(load.name, variant)])
            rates[variant] = n / median
            lines.append(
                f"| {load.name} | {variant} | {n / median:.2f} | {_spread(seconds)} "
                f"| {busy:.2f} | {_ratio(rates, variant, 'before')} "
                f"| {_ratio(rates, variant, 'serial')} |"
            )
        alone = report.alone[load.name]
        lines.append(
            f"| {load.name} | model alone (pre-collated) "
            f"| {n / statistics.median(alone):.2f} | {_spread(alone)} | 1.00 | | |"
        )
    same = ", ".join(f"{name}: {a}/{b} runs" for name, (a, b) in report.same_outputs.items())
    return [*lines, "", f"Outputs of the serial and the pipelined worker identical: {same}.", ""]


def _simulated_lines(report: Report, loads: list[Workload]) -> list[str]:
    lines = [
        f"Simulated accelerator (`--engine simulated --simulate {SIMULATE}`: 5 ms per "
        "micro-batch + 4 ms per decode step + 20 us per prompt token, visual tokens included, "
        "sleeping; real media and processor work):",
        "",
        "| workload | variant | req/s (median) | wall s (spread) | accelerator busy |",
        "| --- | --- | ---: | --- | ---: |",
    ]
    for load in loads:
        for (name, variant), runs in report.simulated.items():
            if name != load.name:
                continue
            median, busy, seconds = _median_runs(runs)
            lines.append(
                f"| {load.name} | {variant} | {len(load.items) / median:.2f} "
                f"| {_spread(seconds)} | {busy:.3f} |"
            )
    return [*lines, ""]


def _affinity_lines(report: Report) -> list[str]:
    lines = [
        "Media affinity: two pipelined workers on one video queue, 4 clips x 4 prompts "
        "(batch 8), the prompts grouped by clip or interleaved:",
        "",
        "| job order | wall s (median) | spread | clip decodes (median) |",
        "| --- | ---: | --- | ---: |",
    ]
    for order, runs in report.affinity.items():
        seconds = [r[0] for r in runs]
        decodes = statistics.median(r[1] for r in runs)
        lines.append(
            f"| {order} | {statistics.median(seconds):.2f} | {_spread(seconds)} | {decodes:g} |"
        )
    return [*lines, ""]


def _ratio(rates: dict[str, float], variant: str, base: str) -> str:
    if base not in rates or variant == base:
        return ""
    return f"{rates[variant] / rates[base]:.2f}x"


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sections", default="fleet,simulated,affinity,processor,decode")
    parser.add_argument("--no-baseline", action="store_true", help="skip the 'before' worker")
    parser.add_argument(
        "--write", default=str(ROOT / "bench" / "README.md"), help="README to update ('' to skip)"
    )
    args = parser.parse_args(argv)
    sections = set(args.sections.split(","))
    from bench.fleet import _model_dir

    model = _model_dir(ROOT / ".vlmq" / "bench")
    for round_ in range(args.repeats):  # generate (once) and cache every round's media
        workloads(round_)
    loads = workloads(0)
    photo_paths = photos(16)
    report = Report(args.repeats)
    if sections & {"fleet", "simulated", "affinity"}:
        tree = (
            nullcontext(None) if args.no_baseline or "fleet" not in sections else worktree(BASELINE)
        )
        with tree as baseline, services() as bench:
            if "fleet" in sections:
                fleet_section(bench, model, report, baseline)
            if "simulated" in sections:
                simulated_section(bench, model, report)
            if "affinity" in sections:
                affinity_section(bench, model, report)
    if "processor" in sections:
        processor_section(model, photo_paths, report)
    if "decode" in sections:
        decode_section(model, photo_paths, report)
    command = "python -m bench.pipeline" + (
        f" {' '.join(argv or sys.argv[1:])}" if (argv or sys.argv[1:]) else ""
    )
    text = render(report, loads, command)
    print(text)
    if args.write:
        replace_section(Path(args.write), MARKER, text)


if __name__ == "__main__":
    main()
