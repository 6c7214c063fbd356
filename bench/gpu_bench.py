"""GPU run: real-dimension random-weight checkpoints, bf16, SDPA vs flash-attention-2, batched.

    bash bench/gpu.sh [--families qwen2_5_vl,qwen3_vl,internvl] [--attn sdpa,flash_attention_2]
        [--n-single 8] [--batch-sizes text=32,image=16,video=8] [--new-tokens 64]
        [--time-budget-s 420] [--workdir .vlmq/gpu] [--write bench/GPU.md]
    bash bench/gpu.sh --cpu-smoke    # the same code path: tiny dims, fp32, SDPA, CPU, < 60 s
    python -m bench.gpu_bench --build-only --device cpu --families qwen3_vl   # time a build

Checkpoints have the published dimensions of Qwen2.5-VL-3B, Qwen3-VL-2B and InternVL3-2B-hf
(``vlmq.workers.demo.tiny`` size "real") and random weights. They are built without the
network, fast, by the one builder with its ``device`` option (``build_tiny_model(..., device=,
dtype=)``): the model is instantiated on the meta device, materialised in the target dtype
directly on the target device (``to_empty``), initialised there by the model's own
``initialize_weights`` and saved with the builder's tokenizer, processor and generation config.
The engine then loads it by path, as it loads a real checkpoint.

For each attention implementation (SDPA first, then flash_attention_2 when ``flash_attn`` is
importable), model and modality: a warm-up, ``--n-single`` requests one at a time, then one full
large batch, with fixed output lengths (min_new_tokens = max_new_tokens). Reported: req/s,
generated tok/s, peak GPU memory (reset before every run) and the speedup of the large batch over
batch size 1. A time budget skips (and names) whatever would not fit; the table is rewritten
after every row, so a run cut short still leaves its rows.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from bench.common import machine, replace_section, require_success, run_in_batches, workload
from vlmq.config.schemas import Request
from vlmq.config.settings import EngineSettings, MediaSettings
from vlmq.workers.demo.tiny import FAMILIES, build_tiny_model, count_parameters
from vlmq.workers.engine import Engine
from vlmq.workers.engine.model import flash_attention_available
from vlmq.workers.engine.runner import free_device_memory

__all__ = ["Budget", "Clock", "Plan", "build_checkpoint", "main", "run"]

MARKER = "gpu"
MODALITIES = ("text", "image", "video")
ATTENTIONS = ("sdpa", "flash_attention_2")
FLASH = "flash_attention_2"
GPU_BATCH = {"text": 32, "image": 16, "video": 8}
SMOKE_BATCH = {"text": 4, "image": 4, "video": 2}
WARMUP_TOKENS = 4
DEFAULT_WRITE = Path("bench/GPU.md")
SMOKE_ENV = "VLMQ_GPU_BENCH_CPU_SMOKE"
MODEL_NAMES = {
    "qwen2_5_vl": "Qwen2.5-VL-3B",
    "qwen3_vl": "Qwen3-VL-2B",
    "internvl": "InternVL3-2B-hf",
}


# ---------------------------------------------------------------------------------------------
# plan, clock and budget
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """Everything one run does, resolved from the command line (and --cpu-smoke)."""

    families: tuple[str, ...]
    attentions: tuple[str, ...]
    modalities: tuple[str, ...]
    size: str
    device: str
    dtype: str
    n_single: int
    batch_sizes: dict[str, int]
    new_tokens: int
    time_budget_s: float
    workdir: Path
    write: Path | None
    seed: int
    build_only: bool
    smoke: bool
    command: str


class Clock:
    """Seconds since the run started, and timestamped progress lines."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self._now = now
        self._start = now()

    def elapsed(self) -> float:
        return self._now() - self._start

    def say(self, message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')} +{self.elapsed():6.1f}s] {message}", flush=True)


class Budget:
    """Refuses a step when elapsed time plus its estimate would pass the limit.

    A step's estimate is the longest step of the same kind seen so far ("build", "load",
    "run:text" ...); a run of a modality not seen yet is estimated from the longest run seen.
    The first step of a kind is estimated at 0 s, so it always starts while time is left.
    """

    def __init__(self, clock: Clock, limit_s: float) -> None:
        self.clock = clock
        self.limit_s = limit_s
        self._seen: dict[str, float] = {}

    def record(self, kind: str, seconds: float) -> None:
        self._seen[kind] = max(self._seen.get(kind, 0.0), seconds)

    def estimate(self, kind: str) -> float:
        if kind in self._seen:
            return self._seen[kind]
        prefix = kind.split(":", 1)[0] + ":"
        if ":" in kind:
            return max((s for k, s in self._seen.items() if k.startswith(prefix)), default=0.0)
        return 0.0

    def refuse(self, kinds: Sequence[str], what: str) -> str | None:
        """None if ``kinds`` fit in the time left, else the reason ``what`` is skipped."""
        elapsed = self.clock.elapsed()
        needed = sum(self.estimate(kind) for kind in kinds)
        if elapsed + needed < self.limit_s:
            return None
        return (
            f"{what}: skipped by the time budget ({elapsed:.0f} s elapsed + ~{needed:.0f} s "
            f"estimated > {self.limit_s:.0f} s)"
        )


# ---------------------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Checkpoint:
    family: str
    path: Path
    params: int
    build_s: float
    gib: float
    reused: bool


def _stamp_path(out: Path) -> Path:
    return out.with_name(out.name + ".built.json")


def _checkpoint_gib(out: Path) -> float:
    return sum(f.stat().st_size for f in out.glob("*.safetensors")) / 2**30


def _reuse(out: Path, family: str, size: str, dtype: str, seed: int) -> Checkpoint | None:
    """A checkpoint this script built earlier with the same family/size/dtype/seed, if any."""
    stamp = _stamp_path(out)
    if not (stamp.exists() and (out / "config.json").exists()):
        return None
    info = json.loads(stamp.read_text(encoding="utf-8"))
    if (info.get("family"), info.get("size"), info.get("dtype"), info.get("seed")) != (
        family,
        size,
        dtype,
        seed,
    ):
        return None
    return Checkpoint(family, out, int(info["params"]), 0.0, _checkpoint_gib(out), True)


def build_checkpoint(
    out: Path, family: str, size: str, device: str, dtype: str, seed: int = 0
) -> Checkpoint:
    """A random-weight checkpoint made on ``device`` in ``dtype`` by the one builder
    (``build_tiny_model(..., device=...)``), or the one this script stamped earlier with the
    same family/size/dtype/seed. On CPU init dominates (30-80 s for the real sizes); on CUDA
    it should be seconds at most, leaving the bf16 safetensors write."""
    reused = _reuse(out, family, size, dtype, seed)
    if reused is not None:
        return reused
    started = time.perf_counter()
    build_tiny_model(out, family, size, seed, device=device, dtype=dtype)
    free_device_memory()
    params = count_parameters(family, size)
    info = {"family": family, "size": size, "dtype": dtype, "seed": seed, "params": params}
    _stamp_path(out).write_text(json.dumps(info), encoding="utf-8")
    return Checkpoint(
        family, out, params, time.perf_counter() - started, _checkpoint_gib(out), False
    )


# ---------------------------------------------------------------------------------------------
# measuring
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Measurement:
    seconds: float
    requests: int
    tokens: int
    peak_gib: float | None
    largest_batch: int

    @property
    def rate(self) -> float:
        return self.requests / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


@dataclass(frozen=True)
class Row:
    model: str
    attention: str
    modality: str
    batch_size: int
    measurement: Measurement
    speedup: float | None


@dataclass(frozen=True)
class Setup:
    model: str
    step: str
    seconds: float
    detail: str


@dataclass
class Report:
    """What a run measured and skipped, rendered as markdown at any point."""

    plan: Plan
    rows: list[Row] = field(default_factory=list)
    setups: list[Setup] = field(default_factory=list)
    checkpoints: list[Checkpoint] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    finished: bool = False


def flash_skip_reason(device: str, available: bool | None = None) -> str | None:
    """Why flash_attention_2 cannot run here, or None when it can."""
    if available is None:
        available = flash_attention_available()
    if not available:
        return "flash_attn is not importable (pip install -e '.[gpu]')"
    if not device.startswith("cuda"):
        return f"flash_attention_2 needs CUDA, the device is {device}"
    return None


def _reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device: str) -> float | None:
    if not device.startswith("cuda"):
        return None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def _allocated_gib(device: str) -> float | None:
    return torch.cuda.memory_allocated() / 2**30 if device.startswith("cuda") else None


def measure(engine: Engine, requests: list[Request], batch_size: int, device: str) -> Measurement:
    """Run ``requests`` in micro-batches of ``batch_size``; all must succeed."""
    _reset_peak(device)
    elapsed, results = run_in_batches(engine, requests, batch_size)
    require_success(results)
    return Measurement(
        seconds=elapsed,
        requests=len(results),
        tokens=sum(r.usage.completion_tokens for r in results if r.usage),
        peak_gib=_peak_gib(device),
        largest_batch=max(r.batch_size or 0 for r in results),
    )


def _short(request: Request, tokens: int) -> Request:
    generation = request.generation.model_copy(update={"max_new_tokens": tokens})
    return request.model_copy(update={"generation": generation})


def run_modality(
    engine: Engine, plan: Plan, model: str, attention: str, kind: str
) -> tuple[Row, Row]:
    """Warm-up, then ``n_single`` requests at batch size 1, then one full large batch."""
    large = plan.batch_sizes[kind]
    requests = workload(kind, max(plan.n_single, large), plan.workdir / "media")
    warm = [_short(r, WARMUP_TOKENS) for r in requests[:large]]
    measure(engine, warm[:1], 1, plan.device)
    measure(engine, warm, large, plan.device)
    single = measure(engine, requests[: plan.n_single], 1, plan.device)
    batched = measure(engine, requests[:large], large, plan.device)
    return (
        Row(model, attention, kind, 1, single, None),
        Row(model, attention, kind, large, batched, batched.rate / single.rate),
    )


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------


class Runner:
    """Walks the plan under the budget; every step logs, records and survives failures."""

    def __init__(self, plan: Plan, clock: Clock | None = None) -> None:
        self.plan = plan
        self.clock = clock or Clock()
        self.budget = Budget(self.clock, plan.time_budget_s)
        self.report = Report(plan)
        self._checkpoints: dict[str, Checkpoint | None] = {}

    def run(self) -> Report:
        self.clock.say(f"plan: {self.plan.command}")
        if self.plan.build_only:
            for family in self.plan.families:
                self._checkpoint(family)
        else:
            self._benchmark()
        self.report.finished = True
        self._publish()
        return self.report

    def _benchmark(self) -> None:
        """Attention implementations outermost: every model runs with SDPA before any with FA2."""
        for attention in self.plan.attentions:
            reason = flash_skip_reason(self.plan.device) if attention == FLASH else None
            if reason:
                self._skip(f"{attention}: skipped for every model: {reason}")
                continue
            for family in self.plan.families:
                self._model(family, attention)

    def _skip(self, message: str) -> None:
        self.clock.say(message)
        self.report.skipped.append(message)
        self._publish()

    def _fail(self, what: str, exc: BaseException) -> None:
        traceback.print_exc()
        message = f"{what}: failed: {type(exc).__name__}: {str(exc)[:300]}"
        self.clock.say(message)
        self.report.failed.append(message)
        free_device_memory()
        self._publish()

    def _publish(self) -> None:
        self.report.elapsed_s = self.clock.elapsed()
        if self.plan.write:
            self.plan.write.parent.mkdir(parents=True, exist_ok=True)
            replace_section(self.plan.write, MARKER, render(self.report))

    def _checkpoint(self, family: str) -> Checkpoint | None:
        if family in self._checkpoints:
            return self._checkpoints[family]
        name = model_name(family, self.plan.size)
        checkpoint = None
        reason = self.budget.refuse(["build", "load", "run:text"], f"{name}: build")
        if reason:
            self._skip(reason)
        else:
            checkpoint = self._build(family, name)
        self._checkpoints[family] = checkpoint
        return checkpoint

    def _build(self, family: str, name: str) -> Checkpoint | None:
        plan = self.plan
        out = plan.workdir / "models" / f"{family}-{plan.size}-{plan.dtype}"
        self.clock.say(f"{name}: checkpoint {out} ({plan.size} dims, {plan.dtype}, {plan.device})")
        try:
            checkpoint = build_checkpoint(
                out, family, plan.size, plan.device, plan.dtype, plan.seed
            )
        except Exception as exc:
            self._fail(f"{name}: build", exc)
            return None
        if not checkpoint.reused:
            self.budget.record("build", checkpoint.build_s)
        how = "reused" if checkpoint.reused else f"built in {checkpoint.build_s:.1f} s"
        self.clock.say(
            f"{name}: {how}: {_params(checkpoint.params)} params, {checkpoint.gib:.2f} GiB"
        )
        self.report.checkpoints.append(checkpoint)
        self._publish()
        return checkpoint

    def _model(self, family: str, attention: str) -> None:
        checkpoint = self._checkpoint(family)
        if checkpoint is None:
            return
        name = model_name(family, self.plan.size)
        first_run = f"run:{self.plan.modalities[0]}" if self.plan.modalities else "run:text"
        reason = self.budget.refuse(["load", first_run], f"{name} / {attention}")
        if reason:
            self._skip(reason)
            return
        engine = self._load(checkpoint, name, attention)
        if engine is None:
            return
        try:
            for kind in self.plan.modalities:
                self._modality(engine, name, attention, kind)
        finally:
            engine.close()
            del engine
            free_device_memory()

    def _load(self, checkpoint: Checkpoint, name: str, attention: str) -> Engine | None:
        plan = self.plan
        settings = EngineSettings(
            device=plan.device,
            dtype=plan.dtype,
            attn_implementation=attention,
            max_new_tokens_default=plan.new_tokens,
            fixed_output_length=True,
            token_budget=10**7,
            # Exact batch sizes: bucketing may split a batch to save padding.
            length_bucketing=False,
            max_batch_size=max(plan.batch_sizes.values()),
        )
        media = MediaSettings(local_roots=[str(plan.workdir.resolve())])
        self.clock.say(f"{name} / {attention}: loading")
        started = time.perf_counter()
        try:
            engine = Engine(str(checkpoint.path), settings, media).setup()
        except Exception as exc:
            self._fail(f"{name} / {attention}: load", exc)
            return None
        seconds = time.perf_counter() - started
        self.budget.record("load", seconds)
        weights = _allocated_gib(plan.device)
        detail = f"{weights:.2f} GiB allocated after load" if weights is not None else ""
        self.report.setups.append(Setup(name, f"load ({attention})", seconds, detail))
        self.clock.say(f"{name} / {attention}: loaded in {seconds:.1f} s {detail}")
        return engine

    def _modality(self, engine: Engine, name: str, attention: str, kind: str) -> None:
        what = f"{name} / {attention} / {kind}"
        reason = self.budget.refuse([f"run:{kind}"], what)
        if reason:
            self._skip(reason)
            return
        started = time.perf_counter()
        try:
            rows = run_modality(engine, self.plan, name, attention, kind)
        except Exception as exc:
            self._fail(what, exc)
            return
        self.budget.record(f"run:{kind}", time.perf_counter() - started)
        for row in rows:
            self.clock.say(f"{what}: {_progress(row)}")
        self.report.rows.extend(rows)
        self._publish()


def run(plan: Plan, clock: Clock | None = None) -> Report:
    return Runner(plan, clock).run()


# ---------------------------------------------------------------------------------------------
# rendering
# ---------------------------------------------------------------------------------------------


def model_name(family: str, size: str) -> str:
    return MODEL_NAMES[family] if size == "real" else f"{family}-{size}"


def _params(n: int) -> str:
    return f"{n / 1e9:.3f} B" if n >= 10**9 else f"{n / 1e6:.2f} M"


def _progress(row: Row) -> str:
    m = row.measurement
    peak = f"{m.peak_gib:.2f} GiB peak" if m.peak_gib is not None else ""
    speedup = f"x{row.speedup:.2f}" if row.speedup is not None else ""
    return (
        f"bs={row.batch_size:<3} {m.requests} req in {m.seconds:.2f} s: {m.rate:.2f} req/s "
        f"{m.tokens_per_s:.1f} tok/s {peak} {speedup}"
    ).rstrip()


def _gpu_line() -> str:
    if not torch.cuda.is_available():
        return "GPU: none (CPU run)"
    props = torch.cuda.get_device_properties(0)
    flash = "not installed"
    if flash_attention_available():
        import flash_attn

        flash = getattr(flash_attn, "__version__", "installed")
    return (
        f"GPU: {props.name} ({props.total_memory / 2**30:.0f} GiB), CUDA {torch.version.cuda}, "
        f"flash_attn {flash}"
    )


def _header(report: Report) -> list[str]:
    plan = report.plan
    sizes = ", ".join(f"{k} {plan.batch_sizes[k]}" for k in plan.modalities)
    status = "complete" if report.finished else "partial (still running or cut short)"
    return [
        f"Command: `{plan.command}`",
        "",
        f"Machine: {machine()}. {_gpu_line()}.",
        "",
        f"Checkpoints: random weights, `{plan.size}` dimensions of the tiny builder, {plan.dtype} "
        f"on {plan.device}. Workload: `bench.common.workload` (text prompts of 4-24 words; one "
        f"224x224 image; a 16-frame 64x64 video at 8 fps). {plan.new_tokens} new tokens per "
        f"request (fixed). Batch size 1 over {plan.n_single} requests; large batch: one full "
        f"batch ({sizes}). Peak memory: `torch.cuda.max_memory_allocated`, reset before every "
        "run, weights included.",
        "",
        f"Status: {status}; {report.elapsed_s:.0f} s of a {plan.time_budget_s:.0f} s budget.",
    ]


def _setup_table(report: Report) -> list[str]:
    lines = ["", "| model | step | seconds | detail |", "| --- | --- | ---: | --- |"]
    for c in report.checkpoints:
        step = "build (reused)" if c.reused else "build"
        detail = f"{_params(c.params)} params, {c.gib:.2f} GiB safetensors"
        lines.append(
            f"| {model_name(c.family, report.plan.size)} | {step} | {c.build_s:.1f} | {detail} |"
        )
    for s in report.setups:
        lines.append(f"| {s.model} | {s.step} | {s.seconds:.1f} | {s.detail} |")
    return lines


def _row_line(row: Row) -> str:
    m = row.measurement
    size = str(row.batch_size)
    if m.largest_batch != row.batch_size:
        size += f" (ran as {m.largest_batch})"
    peak = f"{m.peak_gib:.2f}" if m.peak_gib is not None else "-"
    speedup = f"{row.speedup:.2f}x" if row.speedup is not None else "1.00x"
    return (
        f"| {row.model} | {row.attention} | {row.modality} | {size} | {m.requests} "
        f"| {m.seconds:.2f} | {m.rate:.2f} | {m.tokens_per_s:.1f} | {peak} | {speedup} |"
    )


def _results_table(report: Report) -> list[str]:
    lines = [
        "",
        "| model | attention | modality | batch size | requests | seconds | req/s "
        "| generated tok/s | peak GPU GiB | speedup vs bs=1 |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    return lines + [_row_line(row) for row in report.rows]


def _flash_table(report: Report) -> list[str]:
    """flash_attention_2 req/s over SDPA req/s, where both ran."""
    sdpa = {(r.model, r.modality, r.batch_size): r for r in report.rows if r.attention == "sdpa"}
    pairs = [
        (sdpa[key], r)
        for r in report.rows
        if r.attention == FLASH and (key := (r.model, r.modality, r.batch_size)) in sdpa
    ]
    if not pairs:
        return []
    lines = [
        "",
        "| model | modality | batch size | flash_attention_2 / sdpa (req/s) |",
        "| --- | --- | ---: | ---: |",
    ]
    for base, flash in pairs:
        ratio = flash.measurement.rate / base.measurement.rate
        lines.append(f"| {flash.model} | {flash.modality} | {flash.batch_size} | {ratio:.2f}x |")
    return lines


def render(report: Report) -> str:
    lines = ["## GPU run", "", *_header(report), *_setup_table(report)]
    if report.rows:
        lines += _results_table(report) + _flash_table(report)
    if report.failed:
        lines += ["", "Failed:", ""] + [f"- {s}" for s in report.failed]
    if report.skipped:
        lines += ["", "Skipped:", ""] + [f"- {s}" for s in report.skipped]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------


def _csv(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _batch_sizes(text: str) -> dict[str, int]:
    """``text=32,image=16,video=8`` (modalities left out keep their default)."""
    sizes = dict(GPU_BATCH)
    for item in _csv(text):
        kind, _, value = item.partition("=")
        if kind not in MODALITIES or not value.isdigit() or int(value) < 1:
            raise argparse.ArgumentTypeError(f"expected modality=N, got {item!r}")
        sizes[kind] = int(value)
    return sizes


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu_bench", description=(__doc__ or "").splitlines()[0]
    )
    add = parser.add_argument
    add(
        "--cpu-smoke",
        action="store_true",
        help=f"tiny dims, fp32, CPU, few requests ({SMOKE_ENV}=1)",
    )
    add("--families", type=_csv, default=FAMILIES)
    add("--attn", type=_csv, default=ATTENTIONS, help="attention implementations, in order")
    add("--modalities", type=_csv, default=MODALITIES)
    add("--size", default=None, help="checkpoint size (default real; tiny with --cpu-smoke)")
    add("--device", default=None, help="default cuda (cpu with --cpu-smoke)")
    add("--dtype", default=None, help="default bfloat16 (float32 with --cpu-smoke)")
    add("--n-single", type=int, default=None, help="requests at batch size 1 (default 8)")
    add("--batch-sizes", type=_batch_sizes, default=None, help="e.g. text=32,image=16,video=8")
    add("--new-tokens", type=int, default=None, help="fixed output length (default 64)")
    add("--time-budget-s", type=float, default=None, help="default 420 (45 with --cpu-smoke)")
    add("--workdir", type=Path, default=None, help="default .vlmq/gpu (.vlmq/gpu-smoke)")
    add("--write", default=None, help="markdown file (default bench/GPU.md; '' for none)")
    add("--seed", type=int, default=0)
    add("--build-only", action="store_true", help="build the checkpoints, report, stop")
    return parser


def _pick(value: Any, smoke: bool, gpu_default: Any, smoke_default: Any) -> Any:
    if value is not None:
        return value
    return smoke_default if smoke else gpu_default


def plan_from_args(argv: Sequence[str]) -> Plan:
    args = _parser().parse_args(list(argv))
    smoke = args.cpu_smoke or os.environ.get(SMOKE_ENV, "") not in ("", "0")
    workdir = _pick(args.workdir, smoke, Path(".vlmq/gpu"), Path(".vlmq/gpu-smoke"))
    write = _pick(args.write, smoke, str(DEFAULT_WRITE), str(workdir / "GPU.md"))
    unknown = [f for f in args.families if f not in FAMILIES]
    unknown += [m for m in args.modalities if m not in MODALITIES]
    unknown += [a for a in args.attn if a not in (*ATTENTIONS, "eager")]
    if unknown:
        raise SystemExit(f"unknown names: {unknown}")
    return Plan(
        families=args.families,
        attentions=args.attn,
        modalities=args.modalities,
        size=_pick(args.size, smoke, "real", "tiny"),
        device=_pick(args.device, smoke, "cuda", "cpu"),
        dtype=_pick(args.dtype, smoke, "bfloat16", "float32"),
        n_single=_pick(args.n_single, smoke, 8, 2),
        batch_sizes=_pick(args.batch_sizes, smoke, dict(GPU_BATCH), dict(SMOKE_BATCH)),
        new_tokens=_pick(args.new_tokens, smoke, 64, 8),
        time_budget_s=_pick(args.time_budget_s, smoke, 420.0, 45.0),
        workdir=Path(workdir).resolve(),
        write=Path(write) if write else None,
        seed=args.seed,
        build_only=args.build_only,
        smoke=smoke,
        command=shlex.join(["python", "-m", "bench.gpu_bench", *argv]),
    )


def smoke_plan(workdir: Path, **overrides: Any) -> Plan:
    """The --cpu-smoke plan with its workdir and report under ``workdir`` (for tests)."""
    plan = plan_from_args(["--cpu-smoke", "--workdir", str(workdir)])
    return replace(plan, **overrides)


def _check_device(plan: Plan) -> str | None:
    if plan.device.startswith("cuda") and not torch.cuda.is_available():
        return "CUDA is not available here; use --cpu-smoke (or --device cpu)"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    plan = plan_from_args(sys.argv[1:] if argv is None else argv)
    problem = _check_device(plan)
    if problem:
        print(f"gpu_bench: {problem}", file=sys.stderr)
        return 2
    report = run(plan)
    print(render(report), flush=True)
    if plan.write:
        print(f"wrote {plan.write}", flush=True)
    return 0


def _quiet_logs() -> None:
    """Command line only: warnings from our code, errors from transformers."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("transformers").setLevel(logging.ERROR)


if __name__ == "__main__":
    _quiet_logs()
    raise SystemExit(main())
