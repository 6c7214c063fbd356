"""bench.gpu_bench: the CPU smoke run of the GPU benchmark, its budget and its flash-attn refusal.

The smoke run is the GPU run's code path (fast checkpoint build, engine load by path, warm-up,
batch size 1 vs a large batch per modality, markdown report) with tiny dimensions, fp32 and SDPA
on CPU. It runs once per module, in-process, with flash_attn reported missing.
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
    r"(?P<modality>text|image|video) \| (?P<bs>\d+) \|",
    re.MULTILINE,
)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Run ``--cpu-smoke`` once with flash_attn reported missing; return (report, stdout)."""
    workdir = tmp_path_factory.mktemp("gpu-smoke")
    out = workdir / "GPU.md"
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
                ]
            )
    assert code == 0
    return out.read_text(encoding="utf-8"), buffer.getvalue()


def _rows(report: str) -> set[tuple[str, str, str, int]]:
    return {
        (m["model"].strip(), m["attn"], m["modality"], int(m["bs"])) for m in ROW.finditer(report)
    }


def test_smoke_has_a_row_per_model_modality_and_batch_size(smoke: tuple[str, str]) -> None:
    report, _ = smoke
    expected = {
        (f"{family}-tiny", "sdpa", kind, bs)
        for family in FAMILIES
        for kind, large in gpu_bench.SMOKE_BATCH.items()
        for bs in (1, large)
    }
    assert _rows(report) == expected
    assert "<!-- gpu:start -->" in report and "<!-- gpu:end -->" in report
    assert "Status: complete" in report
    assert "Failed:" not in report


def test_smoke_skips_flash_attention_when_flash_attn_is_missing(smoke: tuple[str, str]) -> None:
    report, stdout = smoke
    assert not any(attn == "flash_attention_2" for _, attn, _, _ in _rows(report))
    line = "flash_attention_2: skipped for every model: flash_attn is not importable"
    assert line in report
    assert line in stdout


def test_smoke_reports_speedups_and_fixed_lengths(smoke: tuple[str, str]) -> None:
    report, _ = smoke
    lines = [line for line in report.splitlines() if ROW.match(line)]
    plan = gpu_bench.smoke_plan(Path("unused"))
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        requests_per_s, tokens_per_s = float(cells[6]), float(cells[7])
        # Fixed output lengths: every request generates exactly new_tokens tokens
        # (a ratio of two rates: the rounded seconds column is too coarse here).
        assert tokens_per_s / requests_per_s == pytest.approx(plan.new_tokens, rel=0.05)
        assert cells[9].endswith("x")
        assert cells[8] == "-"  # no GPU memory on CPU


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
