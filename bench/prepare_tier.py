"""Does the prepare tier feed an accelerator? Real-size media, real worker processes.

Media (bench/realmedia.py): 1080p JPEG photos and 720p H.264 clips of 20 s (GOP 60), distinct
per round: the still synthetic clips (a 110 Mbit/s target that a still scene spends on its
keyframes: ~810 KB each, ~2 KB for other frames, 3.8 Mbit/s on average) and "camera" clips
(panning, per-frame sensor noise, 4 Mbit/s: keyframes ~340 KB).

The GPU worker is ``vlmq worker --engine simulated`` (real media and processor work;
``generate`` sleeps 5 ms per micro-batch + 20 us per prompt token, visual tokens
included, + 4 ms per decode step: an H200-like 2-3B model; the processor's resizing and
normalising run on the simulated device, ``--simulate-processor device``) with the ``small``
Qwen2.5-VL checkpoint given Qwen2.5-VL-3B's real processor configs (a 1080p photo is ~2,700 visual
tokens, 16 frames of a 720p clip ~5,800, as on the real model; the weights do not matter:
``generate`` is simulated), 16 new tokens per request.

Side by side in each round, per workload (96 distinct photos, 6 batches; 32 distinct clips,
4 batches; 8 distinct camera clips), after 32 other photos through every worker (a warm-up:
a process's first batches fill its pools of memory once):

* **self**: the GPU worker prepares its own media (no prepare tier, no frame store).
* **prepared**: two ``vlmq worker --role prepare`` processes prepare the job first (the GPU
  worker paused), then the GPU worker runs it from the frame store (the prepare workers
  paused): accelerator busy = the batches' ``generate_s`` over the GPU worker's wall time;
  the GPU worker's own CPU seconds per request (``/proc``); the prepare workers' CPU seconds
  per item, hence items/s per core and the prepare cores one such accelerator needs.
* **keyframes**: the same clips prepared with ``video_sampling: keyframes``.
* **camera clips**: exact and keyframe sampling of filmed-like clips, for the prepare cores.
* **small images**: 96 56x56 PNGs: media that cost nothing, so the GPU worker's CPU per
  request is the fleet's own work (Redis, status, the result object).
* **second job**: 100 distinct 2 s 720p clips through the prepare tier, then a second job on
  the same 100 clips: decodes fleet-wide (the prepare workers'
  ``vlmq_media_loads_total{source="decoded"}`` + the GPU worker's ``media_decodes``).

    python -m bench.prepare_tier                  # 3 rounds, writes bench/README.md
    python -m bench.prepare_tier --repeats 1 --write ''
    python -m bench.prepare_tier --repeats 1 --write '' --workloads photos
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import machine, replace_section, spread, wait_for
from bench.fleet import _model_dir, _stop
from bench.pipeline import (
    NEW_TOKENS,
    ROOT,
    SIMULATE,
    Services,
    _item,
    services,
    start_worker,
)
from bench.realmedia import clips, photos, small_images

MARKER = "prepare-tier"
PREPARE_WORKERS = 2
WORKLOADS = ("photos", "clips", "camera clips", "small images", "hundred")
PHOTOS, CLIPS, CAMERA_CLIPS = 96, 32, 8
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


@dataclass
class Run:
    """One workload through one variant."""

    items: int
    gpu_wall_s: float
    generate_s: float
    gpu_cpu_s: float
    prepare_cpu_s: float = 0.0
    decodes: int = 0

    @property
    def busy(self) -> float:
        return min(1.0, self.generate_s / self.gpu_wall_s)

    @property
    def gpu_cpu_per_item(self) -> float:
        return self.gpu_cpu_s / self.items

    @property
    def prepare_cpu_per_item(self) -> float:
        return self.prepare_cpu_s / self.items

    @property
    def cores_per_accelerator(self) -> float:
        """Prepare cores that keep one accelerator busy: its item rate x CPU per item."""
        return self.prepare_cpu_per_item * self.items / max(self.generate_s, 1e-9)


@dataclass
class Report:
    repeats: int
    runs: dict[tuple[str, str], list[Run]] = field(default_factory=dict)

    def add(self, workload: str, variant: str, run: Run) -> None:
        self.runs.setdefault((workload, variant), []).append(run)


def bench_model(workdir: Path) -> Path:
    """The small checkpoint with the real processor configs (the real visual-token counts)."""
    out = workdir / "qwen2_5_vl-small-real-processor"
    if not (out / ".real-processor").exists():
        import shutil

        from vlmq.workers.demo.tiny import build_processor
        from vlmq.workers.demo.tiny.builder import chat_template
        from vlmq.workers.demo.tiny.tokenizer import build_tokenizer

        shutil.copytree(_model_dir(workdir), out, dirs_exist_ok=True)
        family = "qwen2_5_vl"
        tokenizer = build_tokenizer(family, chat_template=chat_template(family))
        build_processor(family, "real", tokenizer).save_pretrained(out)
        (out / ".real-processor").touch()
    return out


def _workloads(round_: int, wanted: tuple[str, ...] = WORKLOADS) -> dict[str, list[dict[str, Any]]]:
    """Per round, distinct media: several batches each (``BATCH``: 16 photos, 8 clips), so
    the busy fraction is the pipeline's, not the first batch's start-up. Only the ``wanted``
    workloads' media are made (a round's clips take minutes the first time)."""
    first = 1000
    media: dict[str, tuple[str, str, Callable[[], list[Path]]]] = {
        "photos": (
            "image",
            "What is in the picture?",
            lambda: photos(PHOTOS, start=first + PHOTOS * round_),
        ),
        "clips": ("video", "What happens?", lambda: clips(CLIPS, start=first + CLIPS * round_)),
        "camera clips": (
            "video",
            "What happens?",
            lambda: clips(CAMERA_CLIPS, start=first + CAMERA_CLIPS * round_, camera=True),
        ),
        "small images": (
            "image",
            "What is it?",
            lambda: small_images(PHOTOS, start=first + PHOTOS * round_),
        ),
    }
    return {
        name: [_item(kind, path, prompt, n) for n, path in enumerate(make())]
        for name, (kind, prompt, make) in media.items()
        if name in wanted
    }


def _keyframes(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = json.loads(json.dumps(items))
    for item in out:
        item["messages"][0]["content"][0]["video_sampling"] = "keyframes"
    return out


def _finished(bench: Services, job: str) -> bool:
    return bool(bench.client.status(job)["finished"])


def _records(bench: Services, job: str) -> list[dict[str, Any]]:
    records = [bench.client.result(t) for t in bench.client.job_task_ids(job)]
    failed = [r for r in records if r.get("status") != "succeeded"]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0].get('error')}")
    return records


def _generate_s(records: list[dict[str, Any]]) -> float:
    per_batch = {r["batch_id"]: r["timings"].get("generate_s", 0.0) for r in records}
    return sum(per_batch.values())


def _gpu_run(bench: Services, gpu: str, job: str) -> tuple[float, float, list[dict[str, Any]]]:
    """Let the GPU worker run ``job`` to its end: (wall, its CPU seconds, records)."""
    proc = bench.procs[gpu]
    cpu = cpu_seconds(proc.pid)
    started = time.perf_counter()
    proc.send_signal(signal.SIGCONT)
    wait_for(lambda: _finished(bench, job), 1800, "the job", 0.005)
    wall = time.perf_counter() - started
    proc.send_signal(signal.SIGSTOP)
    return wall, cpu_seconds(proc.pid) - cpu, _records(bench, job)


@dataclass
class Preparers:
    """The prepare workers, their metrics ports, and the media they had decoded when they
    were last paused (a paused process answers no metrics request, and one read after it
    resumes may already count the next job's first decodes: small images take ~1 ms)."""

    names: list[str]
    ports: list[int]
    decoded: int = 0  # a counter starts at 0 with its process


def _prepared_ahead(bench: Services, preparers: Preparers) -> tuple[float, int]:
    """Let the prepare workers prepare every waiting task: their CPU seconds and the media
    they decoded (read from their metrics while they still run, then paused)."""
    from vlmq.broker.queues import prepare_backlog
    from vlmq.config.keys import Keys

    keys = Keys()
    procs = [bench.procs[p] for p in preparers.names]
    cpu = sum(cpu_seconds(p.pid) for p in procs)
    for proc in procs:
        proc.send_signal(signal.SIGCONT)

    def done() -> bool:
        backlog = prepare_backlog(bench.client.redis, keys, ["image", "video"])
        return not any(backlog.values()) and not bench.client.redis.hlen(keys.inflight())

    wait_for(done, 1800, "preparing", 0.01)
    total = _decoded(preparers.ports)
    decoded, preparers.decoded = total - preparers.decoded, total
    for proc in procs:
        proc.send_signal(signal.SIGSTOP)
    return sum(cpu_seconds(p.pid) for p in procs) - cpu, decoded


def _decoded(ports: list[int]) -> int:
    """Media decoded by the prepare workers so far (their metrics endpoints)."""
    total = 0.0
    for port in ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            for line in reply.read().decode().splitlines():
                if line.startswith("vlmq_media_loads_total{") and 'source="decoded"' in line:
                    total += float(line.rsplit(" ", 1)[1])
    return int(total)


def run_self(bench: Services, gpu: str, items: list[dict[str, Any]]) -> Run:
    job = bench.client.submit_many(items)
    wall, cpu, records = _gpu_run(bench, gpu, job)
    decodes = sum(int(r["timings"].get("media_decodes") or 0) for r in records)
    return Run(len(items), wall, _generate_s(records), cpu, decodes=decodes)


def run_prepared(
    bench: Services, gpu: str, preparers: Preparers, items: list[dict[str, Any]]
) -> Run:
    job = bench.client.submit_many(items)
    prepare_cpu, decodes = _prepared_ahead(bench, preparers)
    wall, cpu, records = _gpu_run(bench, gpu, job)
    decodes += sum(int(r["timings"].get("media_decodes") or 0) for r in records)
    return Run(len(items), wall, _generate_s(records), cpu, prepare_cpu, decodes)


def _start_fleet(bench: Services, model: Path) -> tuple[str, str, Preparers]:
    # On a GPU the processor resizes and normalises on the device: so does the simulated one.
    simulated = ("--engine", "simulated", "--simulate", SIMULATE, "--simulate-processor", "device")
    off = {"VLMQ_MEDIA__FRAME_STORE__ENABLED": "false"}
    start_worker(bench, "gpu-self", model, ROOT, off, *simulated)
    # No per-worker media cache on the fed side: every read-back is the frame store's.
    nocache = {"VLMQ_MEDIA__CACHE_BYTES": "0"}
    start_worker(bench, "gpu-fed", model, ROOT, nocache, *simulated)
    preparers, ports = [], []
    for n in range(PREPARE_WORKERS):
        port = 9400 + n
        extra = {
            "VLMQ_METRICS__PORT": str(port),
            "VLMQ_WORKER__PREPROCESS_WORKERS": "1",
            **nocache,
        }
        start_worker(bench, f"prep-{n}", model, ROOT, extra, "--role", "prepare")
        preparers.append(f"prep-{n}")
        ports.append(port)
    for name in ("gpu-self", "gpu-fed", *preparers):
        bench.procs[name].send_signal(signal.SIGSTOP)
    return "gpu-self", "gpu-fed", Preparers(preparers, ports)


def measure(
    bench: Services, model: Path, report: Report, workloads: tuple[str, ...] = WORKLOADS
) -> None:
    own, fed, preparers = _start_fleet(bench, model)
    # Two batches of distinct photos first: what a worker spends per request over a job, not
    # its first batches' (fresh memory for the frame store's read buffers, torch's first
    # allocations: a pool of buffers ~6 MB each fills once per process).
    warm = [_item("image", path, "Warm up.", n) for n, path in enumerate(photos(32, start=20_000))]
    run_self(bench, own, warm)
    run_prepared(bench, fed, preparers, warm)
    for round_ in range(report.repeats):
        _progress(f"round {round_ + 1}/{report.repeats}")
        for name, items in _workloads(round_, workloads).items():
            report.add(name, "self", run_self(bench, own, items))
            report.add(name, "prepared", run_prepared(bench, fed, preparers, items))
            if name in ("clips", "camera clips"):
                keyed = _keyframes(items)
                report.add(name, "keyframes", run_prepared(bench, fed, preparers, keyed))
            _progress(f"{name}: {_summary(report, name)}")
    if "hundred" in workloads:
        hundred = [_item("video", c, "What happens?", n) for n, c in enumerate(_hundred())]
        for job in ("100 clips, first job", "100 clips, second job"):
            report.add(job, "prepared", run_prepared(bench, fed, preparers, hundred))
    for name in (own, fed, *preparers.names):
        _stop(bench.procs.pop(name))


def _hundred() -> list[Path]:
    return clips(100, seconds=2, start=5000)


def _summary(report: Report, workload: str) -> str:
    parts = []
    for (name, variant), runs in report.runs.items():
        if name == workload:
            parts.append(f"{variant} busy {runs[-1].busy:.2f}")
    return ", ".join(parts)


def render(report: Report, command: str) -> str:
    lines = [
        f"`{command}` on {machine()}: a simulated H200-like accelerator "
        f"(`--simulate {SIMULATE}`), {NEW_TOKENS} new tokens, {PREPARE_WORKERS} prepare "
        f"processes of 1 thread; medians of {report.repeats} rounds (min-max).",
        "",
        "| workload | variant | accelerator busy | GPU worker CPU / request | "
        "prepare CPU / item | items/s per prepare core | prepare cores per accelerator | "
        "decodes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (name, variant), runs in report.runs.items():
        prepare = [r.prepare_cpu_per_item for r in runs]
        cells = [
            name,
            variant,
            spread([r.busy for r in runs], ".2f"),
            spread([r.gpu_cpu_per_item * 1000 for r in runs], ".1f") + " ms",
            spread([p * 1000 for p in prepare], ".0f") + " ms" if any(prepare) else "-",
            spread([1 / p for p in prepare if p], ".1f") if any(prepare) else "-",
            spread([r.cores_per_accelerator for r in runs], ".1f") if any(prepare) else "-",
            spread([float(r.decodes) for r in runs], ".0f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _progress(message: str) -> None:
    print(f"[prepare-tier] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help="which of photos, clips, camera clips, small images, hundred (the second job "
        "on 100 clips)",
    )
    parser.add_argument(
        "--write", default=str(ROOT / "bench" / "README.md"), help="README to update ('' to skip)"
    )
    args = parser.parse_args(argv)
    workloads = tuple(args.workloads.split(","))
    model = bench_model(ROOT / ".vlmq" / "bench")
    for round_ in range(args.repeats):  # generate (once) and cache every round's media
        _workloads(round_, workloads)
    if "hundred" in workloads:
        _hundred()
    report = Report(args.repeats)
    with services() as bench:
        measure(bench, model, report, workloads)
    command = "python -m bench.prepare_tier" + (
        f" {' '.join(argv or sys.argv[1:])}" if (argv or sys.argv[1:]) else ""
    )
    text = render(report, command)
    print(text)
    if args.write:
        replace_section(Path(args.write), MARKER, text)


if __name__ == "__main__":
    main()
