"""bench.gpu_bench: the CPU smoke run of the GPU benchmark, its budget, its progress file and
its flash-attn refusal.

The smoke run is the GPU run's code path (fast checkpoint build, engine load by path, the same
collated batch through transformers' generate and the decode loop per family, modality and batch
size, the roofline yardsticks, markdown report) with tiny dimensions, fp32 and SDPA on CPU. It
runs once per module, in-process, with flash_attn reported missing.
"""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from bench import gpu_bench
from vlmq.workers.demo.tiny import FAMILIES, count_parameters

ROOT = Path(__file__).resolve().parents[2]
# Published parameter counts of Qwen2.5-VL-3B, Qwen3-VL-2B, InternVL3-2B (in billions).
REAL_PARAMS_B = {"qwen2_5_vl": (3.6, 3.9), "qwen3_vl": (2.0, 2.3), "internvl": (2.0, 2.2)}
ROW = re.compile(
    r"^\| (?P<model>[^|]+) \| (?P<attn>sdpa|flash_attention_2|eager) \| "
    r"(?P<modality>text|image|video) \| (?P<bs>\d+) \| (?P<path>generate|loop) \|",
    re.MULTILINE,
)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, str]:
    """Run ``--cpu-smoke`` once with flash_attn reported missing; return (report, stdout,
    progress file)."""
    workdir = tmp_path_factory.mktemp("gpu-smoke")
    out = workdir / "GPU.md"
    progress = workdir / "progress.log"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gpu_bench, "flash_attention_available", lambda: False)
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            code = gpu_bench.main(
                [
                    "--cpu-smoke",
                    "--workdir",
                    str(workdir),
                    "--write",
                    str(out),
                    "--time-budget-s",
                    "600",
                    "--progress",
                    str(progress),
                ]
            )
    assert code == 0
    return out.read_text(encoding="utf-8"), buffer.getvalue(), progress.read_text()


def _rows(report: str) -> set[tuple[str, str, str, int, str]]:
    return {
        (m["model"].strip(), m["attn"], m["modality"], int(m["bs"]), m["path"])
        for m in ROW.finditer(report)
    }


def test_smoke_has_a_row_per_model_modality_batch_size_and_path(
    smoke: tuple[str, str, str],
) -> None:
    report, _, _ = smoke
    expected = {
        (f"{family}-tiny", "sdpa", kind, bs, path)
        for family in FAMILIES
        for kind, sizes in gpu_bench.SMOKE_BATCH.items()
        for bs in sizes
        for path in gpu_bench.PATHS
    }
    assert _rows(report) == expected
    assert "<!-- gpu:start -->" in report and "<!-- gpu:end -->" in report
    assert "Status: complete" in report
    assert "Failed:" not in report


def test_smoke_skips_flash_attention_when_flash_attn_is_missing(
    smoke: tuple[str, str, str],
) -> None:
    report, stdout, _ = smoke
    assert not any(attn == "flash_attention_2" for _, attn, _, _, _ in _rows(report))
    line = "flash_attention_2: skipped for every model: flash_attn is not importable"
    assert line in report
    assert line in stdout


def test_smoke_reports_each_path_beside_generate(smoke: tuple[str, str, str]) -> None:
    report, _, progress = smoke
    lines = [line for line in report.splitlines() if ROW.match(line)]
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        path, busy, speedup, peak = cells[4], cells[7], cells[13], cells[12]
        assert float(cells[5]) > 0  # generated tok/s
        assert peak == "-"  # no GPU memory on CPU
        if path == "generate":
            assert busy == "-" and speedup == "-"
        else:  # the loop's own device time (the host's, on CPU) over wall, and its ratio
            assert 0 < float(busy) <= 1.0 and speedup.endswith("x")
    assert "Memory bandwidth (a copy, measured in this run)" in report
    # Every progress line went to the file as it happened, the last one included.
    assert "memory bandwidth" in progress and progress.rstrip().endswith("done")
    assert sum("tok/s" in line for line in progress.splitlines()) == len(lines)


def test_flash_skip_reasons() -> None:
    assert "flash_attn" in (gpu_bench.flash_skip_reason("cuda", available=False) or "")
    assert "CUDA" in (gpu_bench.flash_skip_reason("cpu", available=True) or "")
    assert gpu_bench.flash_skip_reason("cuda", available=True) is None


def test_cuda_plan_refuses_cleanly_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert gpu_bench.main(["--write", ""]) == 2
    assert "--cpu-smoke" in capsys.readouterr().err


def test_time_budget_skips_everything_and_says_so(tmp_path: Path) -> None:
    plan = replace(gpu_bench.smoke_plan(tmp_path), time_budget_s=0.0, write=None)
    report = gpu_bench.run(plan)
    assert report.rows == [] and report.checkpoints == []
    assert report.skipped and all("time budget" in s or "flash" in s for s in report.skipped)
    assert "skipped by the time budget" in gpu_bench.render(report)


class _FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_budget_estimates_from_steps_seen() -> None:
    fake = _FakeTime()
    budget = gpu_bench.Budget(gpu_bench.Clock(fake), limit_s=100.0)
    assert budget.refuse(["build", "run:text"], "first") is None  # nothing seen: 0 s estimates
    budget.record("run:text", 30.0)
    budget.record("run:image", 40.0)
    assert budget.estimate("run:video") == 40.0  # unseen modality: the longest run seen
    fake.now = 65.0
    assert budget.refuse(["run:text"], "x") is None
    reason = budget.refuse(["run:image"], "m / sdpa / image")
    assert reason is not None and reason.startswith("m / sdpa / image: skipped by the time budget")


def test_fast_build_has_the_tiny_builders_layout(tmp_path: Path, checkpoint: Any) -> None:
    fast = gpu_bench.build_checkpoint(tmp_path / "fast", "qwen3_vl", "tiny", "cpu", "float32")
    reference = checkpoint("qwen3_vl", "tiny")
    assert sorted(p.name for p in fast.path.iterdir()) == sorted(
        p.name for p in reference.iterdir()
    )
    again = gpu_bench.build_checkpoint(tmp_path / "fast", "qwen3_vl", "tiny", "cpu", "float32")
    assert again.reused and again.params == fast.params


@pytest.mark.parametrize("family", FAMILIES)
def test_real_dimensions_have_the_published_parameter_counts(family: str) -> None:
    low, high = REAL_PARAMS_B[family]
    assert low <= count_parameters(family, "real") / 1e9 <= high


def test_gpu_sh_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu.sh")], check=True)
