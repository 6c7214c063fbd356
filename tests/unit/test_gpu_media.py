"""bench.gpu_media: the GPU media check's CPU smoke path, its pure parts, what it imports, and
the estimate's way round the GPU machine's transformers.

The smoke run walks the GPU run's code with tiny sizes, once per module: media made by a
spawned process, the engine loaded by path, decode timings, pixel error, greedy agreement, the
in-process pipeline against the simulated accelerator, a prepare process filling a ``file://``
frame store that the worker reads back. The same run through ``bash bench/gpu.sh --media`` in a
Python 3.12 venv with the GPU machine's packages (torch 2.11, transformers 5.17, no pydantic,
av or zstandard; ``make gpu-wheels`` installed into a temporary target) needs that venv: set
VLMQ_GPU312_PYTHON to its python to run it (docs/prepare-tier.md, "GPU check").
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from bench import gpu_media
from bench.gpu_media import BusyRun, Report

ROOT = Path(__file__).resolve().parents[2]
PREPARED = "prepared ahead by 1 processes"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory, checkpoint: Any) -> tuple[Report, str]:
    """One smoke run on the tiny Qwen2.5-VL checkpoint: (report, the markdown written)."""
    workdir = tmp_path_factory.mktemp("gpu-media")
    written = workdir / "GPU.md"
    argv = ["--cpu-smoke", "--model", str(checkpoint("qwen2_5_vl", "tiny"))]
    argv += ["--workdir", str(workdir), "--write", str(written), "--time-budget-s", "300"]
    argv += ["--photo-size", "320x180", "--clip-size", "96x64", "--clip-seconds", "1"]
    argv += ["--photos", "2", "--clips", "1", "--repeats", "1", "--procs", "1", "--threads", "1"]
    plan = gpu_media.plan_from_args(argv)
    plan = replace(plan, decode_photos=2, jpeg_batch=2, agree=2, agree_tokens=3, new_tokens=2)
    report = gpu_media.run(plan)
    return report, written.read_text(encoding="utf-8")


def test_smoke_runs_every_section(smoke: tuple[Report, str]) -> None:
    report, written = smoke
    assert report.failed == []
    assert report.finished
    assert [row.fallbacks for row in report.decode] == [0, 0, 0, 0]
    assert all(len(row.ms_per_item) == 1 and row.ms_per_item[0] > 0 for row in report.decode)
    assert set(report.busy) == {
        ("photos", "self: 1 prepare thread, CPU decode"),
        ("photos", "self: 1 prepare thread, torchvision on the CPU decode"),
        ("photos", PREPARED),
        ("clips", "self: 1 prepare thread, CPU decode"),
        ("clips", PREPARED),
    }
    assert "<!-- gpu-media:start -->" in written and "<!-- gpu-media:end -->" in written
    assert "Status: complete" in written
    for heading in ("(a) JPEG decode", "(b) GPU decode", "(c) video decode", "(d) accelerator"):
        assert heading in written
    for heading in ("(e) Photos on the device", "(e) Video:", "Logits, device-decoded"):
        assert heading in written


def test_device_media_reports_pixel_error_logits_and_frame_rates(
    smoke: tuple[Report, str],
) -> None:
    """(e): the device path's pixel error is small, the logits agree on the CPU (fp32), the
    cores' frame rate is measured and the hardware decoder's absence is said, not hidden."""
    import re

    report, _ = smoke
    text = "\n".join(report.device_media)
    error = re.search(r"mean ([0-9.]+), p99 ([0-9]+)", text)
    assert error is not None and float(error.group(1)) < 3 and int(error.group(2)) < 24
    agree = re.search(r"top-1 agrees on (\d+)/(\d+)", text)
    assert agree is not None and agree.group(1) == agree.group(2)
    assert re.search(r"CPU reference \(PyAV, exact\), 1 processes \| [0-9.]+ ", text)
    assert "skipped: neither PyNvVideoCodec nor torchcodec imports here" in text


def test_device_decode_is_close_to_the_cpu_reference(smoke: tuple[Report, str]) -> None:
    """Without CUDA the device path decodes with torchvision on the CPU: a different resizer
    than Pillow's draft + bicubic, so close, not equal; same sizes."""
    report, _ = smoke
    (pixels,) = report.pixels
    assert pixels.items == 2 and pixels.mismatched == 0
    assert pixels.mean_abs < 3


def test_greedy_agreement_has_a_deterministic_baseline(smoke: tuple[Report, str]) -> None:
    report, _ = smoke
    baseline, device = report.agree
    assert (baseline.requests, baseline.identical, baseline.prefix) == (2, 2, 1.0)
    assert device.requests == 2


def test_prepared_ahead_is_read_back_and_self_decodes(smoke: tuple[Report, str]) -> None:
    report, _ = smoke
    for (workload, variant), runs in report.busy.items():
        (run,) = runs
        if variant == PREPARED:
            assert (run.store_hits, run.decodes) == (run.items, 0), workload
            assert run.prepare_cpu_s > 0 and run.prepare_wall_s > 0
        else:
            assert (run.store_hits, run.decodes) == (0, run.items), (workload, variant)
        assert 0 < run.busy <= 1 and run.generate_s > 0


def test_video_decode_without_torchcodec_is_skipped_saying_why(
    smoke: tuple[Report, str],
) -> None:
    from vlmq.workers.media.device import torchcodec_available

    report, _ = smoke
    assert "**cpu**: CUDA is not available" in report.video_route
    if not torchcodec_available():
        assert any("torchcodec is not importable" in s for s in report.skipped)


# --- pure parts --------------------------------------------------------------------------------


def test_spread_agreement_and_pixel_error() -> None:
    assert gpu_media.spread([3.0, 1.0, 2.0]) == "2.00 (1.00-3.00)"
    assert gpu_media.spread([1.5], ".1f") == "1.5"
    assert gpu_media.spread([]) == "-"
    row = gpu_media.agreement("x", [[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]])
    assert (row.requests, row.identical, row.prefix) == (2, 1, 0.75)
    a = np.zeros((10, 20, 3), dtype=np.uint8)  # 600 values
    b = a.copy()
    b[0, 0, 0] = 200  # under 1% of them
    b[1, 0, 0] = 3
    pixels = gpu_media.pixel_row("p", [(a, b), (a, np.zeros((20, 10, 3), dtype=np.uint8))])
    assert (pixels.target, pixels.items, pixels.max_abs, pixels.mismatched) == ("20x10", 2, 200, 1)
    assert pixels.mean_abs == pytest.approx(203 / 600) and pixels.p99_abs == 0
    b[2:, :, :] = 1
    assert gpu_media.pixel_row("p", [(a, b)]).p99_abs == 1


def test_busy_run_arithmetic() -> None:
    run = BusyRun(10, 2.0, 1.5, 0.2, 0, 10, prepare_wall_s=1.0, prepare_cpu_s=3.0)
    assert run.busy == 0.75 and run.prepare_cpu_per_item == 0.3
    assert run.cores_per_accelerator == 2.0  # 3 CPU seconds of preparing per 1.5 s of work


def test_plans_of_the_gpu_run_and_the_smoke() -> None:
    gpu = gpu_media.plan_from_args([])
    assert (gpu.size, gpu.device, gpu.dtype) == ("real", "cuda", "bfloat16")
    assert (gpu.photo_size, gpu.clip_size, gpu.clip_seconds) == ((1920, 1080), (1280, 720), 20)
    assert gpu.procs == len(os.sched_getaffinity(0)) and gpu.threads == max(1, gpu.procs - 1)
    assert gpu.write == Path("bench/GPU.md") and gpu.time_budget_s <= 420
    smoke = gpu_media.plan_from_args(["--cpu-smoke", "--workdir", "/tmp/x"])
    assert (smoke.size, smoke.device, smoke.dtype) == ("tiny", "cpu", "float32")
    assert smoke.write == Path("/tmp/x/GPU.md")


# --- what the GPU machine lacks ------------------------------------------------------------------


def test_the_check_imports_nothing_the_gpu_machine_lacks() -> None:
    """redis, celery, kombu and boto3/botocore are not there and are not carried."""
    code = (
        "import sys, bench.gpu_media, bench.gpu_bench, bench.prepare_procs, "
        "vlmq.workers.engine.engine, vlmq.workers.media.device, vlmq.workers.engine.noop, "
        "vlmq.stores.urls\n"
        "print(sorted(m for m in ('redis', 'celery', 'kombu', 'boto3', 'botocore') "
        "if m in sys.modules))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


class _BrokenHelper:
    """A processor whose ``_get_num_multimodal_tokens`` breaks for videos as transformers
    5.17's Qwen processors do; everything else is the real processor's."""

    def __init__(self, processor: Any) -> None:
        self._processor = processor

    def __getattr__(self, name: str) -> Any:
        return getattr(self._processor, name)

    def _get_num_multimodal_tokens(self, **kwargs: Any) -> Any:
        raise AttributeError("'Qwen2VLVideoProcessor' object has no attribute 'get_number_of_…'")


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_video_tokens_without_the_processor_helper_match_it(family: str, checkpoint: Any) -> None:
    from transformers import AutoProcessor

    from vlmq.workers.engine.estimate import _video_patch_tokens

    processor = AutoProcessor.from_pretrained(checkpoint(family, "tiny"))
    videos = [(16, 360, 640), (4, 720, 1280), (2, 56, 56)]
    direct = _video_patch_tokens(processor, videos)
    assert direct == [
        int(n)
        for n in processor._get_num_multimodal_tokens(
            video_sizes=[list(v) for v in videos]
        ).num_video_tokens
    ]
    assert _video_patch_tokens(_BrokenHelper(processor), videos) == direct


# --- the GPU machine's Python (opt-in) -----------------------------------------------------------


@pytest.mark.skipif(
    not os.environ.get("VLMQ_GPU312_PYTHON"),
    reason="needs a venv like the GPU machine's: VLMQ_GPU312_PYTHON=.venv-gpu312/bin/python",
)
def test_gpu_sh_media_installs_the_wheels_and_runs(tmp_path: Path) -> None:
    wheels = list((ROOT / ".whl").glob("*.whl"))
    if not wheels:
        pytest.skip("no wheels in .whl/: make gpu-wheels")
    env = {
        **os.environ,
        "PYTHON": os.environ["VLMQ_GPU312_PYTHON"],
        "VLMQ_GPU_SITE": str(tmp_path / "site"),
    }
    env.pop("PYTHONPATH", None)
    argv = ["bash", "bench/gpu.sh", "--media", "--cpu-smoke", "--workdir", str(tmp_path)]
    done = subprocess.run(
        argv, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300, check=False
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert f"installing {len(wheels)} wheels from .whl/" in output
    assert "Status: complete" in output and "Failed:" not in output
