"""GPU run: real-dimension random-weight checkpoints, bf16, the decode loop beside transformers'
generate, per family, modality and batch size, measured against the GPU's own roofline.

    bash bench/gpu.sh [--families qwen2_5_vl,qwen3_vl,internvl] [--paths generate,loop]
        [--batch-sizes text=1:8:32:64,image=1:8:32,video=1:8:32] [--new-tokens 64]
        [--attn sdpa] [--compile] [--time-budget-s 400] [--progress FILE]
        [--workdir .vlmq/gpu] [--write bench/GPU.md]
    bash bench/gpu.sh --cpu-smoke    # the same code path: tiny dims, fp32, CPU, < 90 s
    python -m bench.gpu_bench --build-only --device cpu --families qwen3_vl   # time a build

Checkpoints have the published dimensions of Qwen2.5-VL-3B, Qwen3-VL-2B and InternVL3-2B-hf
(``vlmq.workers.demo.tiny`` size "real") and random weights. They are built without the
network, fast, by the one builder with its ``device`` option (``build_tiny_model(..., device=,
dtype=)``): instantiated on the meta device, materialised in the target dtype on the target
device, initialised there and saved with the builder's tokenizer, processor and generation
config. The engine then loads it by path, as it loads a real checkpoint.

Per model (loaded once), modality and batch size, each path runs the same collated batch with a
fixed output length: ``generate`` (transformers' generate with vlmq's per-row processors, eager:
the reference) and ``loop`` (the decode loop: CUDA graphs on CUDA, captured during a warm-up
whose time is reported), plus ``loop+compile`` with ``--compile`` (torch.compile before
capture; the first run's compile time is reported). Each is timed for N new tokens and for 1:
the decode step is (T_N - T_1) / (N - 1), the prefill T_1. Reported per row: generated tok/s,
ms per decode step, the device's busy share (decode loop: kernel time of its replayed graphs
and prefill from CUDA events; both paths: NVML's utilisation, sampled, where pynvml imports),
the share of the memory roofline a decode step reaches (bytes it reads / its time / the
bandwidth of a copy measured in the same run) and the prefill's FLOP rate.

A time budget is checked before every step and skips (and names) what would not fit; every
progress line goes to stdout and to ``--progress`` as it happens, and the table is rewritten
after every row, so a run cut short still leaves what it measured.
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
from typing import IO, Any

import torch

from bench.common import machine, replace_section, workload
from bench.roofline import ModelCost, UtilizationSampler, memory_bandwidth, model_cost
from vlmq.config.schemas import Request
from vlmq.config.settings import DecodeSettings, EngineSettings, MediaSettings
from vlmq.workers.demo.tiny import FAMILIES, build_tiny_model, count_parameters
from vlmq.workers.engine import Engine
from vlmq.workers.engine.model import flash_attention_available
from vlmq.workers.engine.runner import free_device_memory

__all__ = ["Budget", "Clock", "Plan", "build_checkpoint", "main", "run"]

MARKER = "gpu"
MODALITIES = ("text", "image", "video")
ATTENTIONS = ("sdpa", "flash_attention_2")
FLASH = "flash_attention_2"
PATHS = ("generate", "loop")
COMPILED = "loop+compile"
GPU_BATCH = {"text": (1, 8, 32, 64), "image": (1, 8, 32), "video": (1, 8, 32)}
SMOKE_BATCH = {"text": (1, 2), "image": (2,), "video": (2,)}
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
    paths: tuple[str, ...]
    size: str
    device: str
    dtype: str
    batch_sizes: dict[str, tuple[int, ...]]
    new_tokens: int
    time_budget_s: float
    workdir: Path
    write: Path | None
    progress: Path | None
    seed: int
    build_only: bool
    smoke: bool
    command: str


class Clock:
    """Seconds since the run started, and timestamped progress lines (stdout and, when given,
    a file written line by line: a run killed at its limit still leaves them)."""

    def __init__(
        self, now: Callable[[], float] = time.perf_counter, progress: Path | None = None
    ) -> None:
        self._now = now
        self._start = now()
        self._file: IO[str] | None = None
        if progress is not None:
            progress.parent.mkdir(parents=True, exist_ok=True)
            self._file = progress.open("a", encoding="utf-8", buffering=1)

    def elapsed(self) -> float:
        return self._now() - self._start

    def say(self, message: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')} +{self.elapsed():6.1f}s] {message}"
        print(line, flush=True)
        if self._file is not None:
            self._file.write(line + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())


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
    rows: int
    new_tokens: int
    seconds: float  # the batch, new_tokens each
    prefill_s: float  # the same batch, one token each
    busy: float | None  # the device's own time over wall (decode loop: CUDA events)
    nvml: float | None  # NVML utilisation over the run (where pynvml imports)
    roofline: float | None  # bytes a decode step reads / its time / measured bandwidth
    prefill_tflops: float | None
    peak_gib: float | None
    warmup_s: float  # the warm-up: graph captures (and compiles) of the first use

    @property
    def tokens_per_s(self) -> float:
        return self.rows * self.new_tokens / self.seconds

    @property
    def step_ms(self) -> float:
        return 1000 * max(0.0, self.seconds - self.prefill_s) / max(1, self.new_tokens - 1)


@dataclass(frozen=True)
class Row:
    model: str
    attention: str
    modality: str
    batch_size: int
    path: str
    measurement: Measurement
    speedup: float | None  # tok/s over the generate path's, same model, modality and size


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
    bandwidth: float | None = None
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


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


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


@dataclass(frozen=True)
class Batch:
    """One collated batch, and the same batch asking other output lengths."""

    collated: Any
    prompt_tokens: int
    vision_tokens: int

    def asking(self, tokens: int) -> Any:
        items = [replace(item, max_new_tokens=tokens) for item in self.collated.items]
        return replace(self.collated, items=items)


def _vision_tokens(inputs: dict[str, Any], model: Any) -> int:
    """Positions the vision encoder runs over: Qwen's flattened patches, or InternVL's images
    times their patch grid."""
    count = 0
    for key in ("pixel_values", "pixel_values_videos"):
        pixels = inputs.get(key)
        if pixels is None:
            continue
        if pixels.dim() == 2:
            count += int(pixels.shape[0])
            continue
        patch = getattr(model.config.vision_config, "patch_size", 14)
        patch = patch[0] if isinstance(patch, (list, tuple)) else patch
        count += int(pixels.shape[0]) * (pixels.shape[-2] // patch) * (pixels.shape[-1] // patch)
    return count


def collate_batch(engine: Engine, requests: list[Request]) -> Batch:
    prepared = [engine.prepare(r) for r in requests]
    failed = [p.error for p in prepared if p.error is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed to prepare: {failed[0]}")
    collated = engine.collate(prepared)
    inputs = collated.inputs
    return Batch(
        collated,
        int(inputs["attention_mask"].sum()),
        _vision_tokens(inputs, engine._ready().model),
    )


def _generate(engine: Engine, collated: Any) -> list[Any]:
    outcomes = engine.generate(collated)
    errors = [o.error for o in outcomes if o.error is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
    return outcomes


def _timed(engine: Engine, collated: Any, device: str) -> float:
    _sync(device)
    started = time.perf_counter()
    _generate(engine, collated)
    _sync(device)
    return time.perf_counter() - started


def _device_seconds(engine: Engine) -> float:
    decoder = engine.decoder
    if decoder is None:
        return 0.0
    decoder.timer.collect(wait=True)
    return sum(decoder.timer.seconds.values())


@dataclass(frozen=True)
class Yardstick:
    """What a model's work costs the device, and what the device can do."""

    cost: ModelCost
    bandwidth: float
    device: str


def measure(
    engine: Engine, batch: Batch, path: str, new_tokens: int, yardstick: Yardstick
) -> Measurement:
    """One path on one batch: warm-up, then N tokens and 1 token, each timed alone."""
    device = yardstick.device
    looping = path != "generate"
    engine.set_decode(mode="loop" if looping else "generate")
    warm = batch.asking(new_tokens if looping else WARMUP_TOKENS)
    warmup_s = _timed(engine, warm, device)
    prefill_s = _timed(engine, batch.asking(1), device)
    _reset_peak(device)
    before = _device_seconds(engine)
    with UtilizationSampler(device) as sampler:
        seconds = _timed(engine, batch.asking(new_tokens), device)
    busy = (_device_seconds(engine) - before) / seconds if looping else None
    rows = batch.collated.rows
    # A decode step's time is a difference of two runs: within noise of zero, it is unknown.
    step_s = (seconds - prefill_s) / max(1, new_tokens - 1)
    context = batch.collated.inputs["input_ids"].shape[1] + new_tokens / 2
    step_bytes = yardstick.cost.step_bytes(rows, context)
    roofline = step_bytes / step_s / yardstick.bandwidth if step_s > 0 else None
    flops = yardstick.cost.prefill_flops(batch.prompt_tokens, batch.vision_tokens)
    return Measurement(
        rows=rows,
        new_tokens=new_tokens,
        seconds=seconds,
        prefill_s=prefill_s,
        busy=busy,
        nvml=sampler.mean,
        roofline=roofline,
        prefill_tflops=flops / prefill_s / 1e12,
        peak_gib=_peak_gib(device),
        warmup_s=warmup_s,
    )


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------


class Runner:
    """Walks the plan under the budget; every step logs, records and survives failures."""

    def __init__(self, plan: Plan, clock: Clock | None = None) -> None:
        self.plan = plan
        self.clock = clock or Clock(progress=plan.progress)
        self.budget = Budget(self.clock, plan.time_budget_s)
        self.report = Report(plan)
        self._checkpoints: dict[str, Checkpoint | None] = {}

    def run(self) -> Report:
        self.clock.say(f"plan: {self.plan.command}")
        if self.plan.build_only:
            for family in self.plan.families:
                self._checkpoint(family)
        else:
            self._bandwidth()
            self._benchmark()
        self.report.finished = True
        self._publish()
        self.clock.say("done")
        return self.report

    def _bandwidth(self) -> None:
        gib = 2.0 if self.plan.device.startswith("cuda") else 0.25
        self.report.bandwidth = memory_bandwidth(self.plan.device, gib)
        self.clock.say(
            f"memory bandwidth (copy of {gib} GiB): {self.report.bandwidth / 1e9:.0f} GB/s"
        )

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
        first = f"run:{self.plan.modalities[0]}" if self.plan.modalities else "run:text"
        reason = self.budget.refuse(["load", first], f"{name} / {attention}")
        if reason:
            self._skip(reason)
            return
        engine = self._load(checkpoint, name, attention)
        if engine is None:
            return
        try:
            yardstick = Yardstick(
                model_cost(engine._ready().model), self.report.bandwidth or 1.0, self.plan.device
            )
            plain = [p for p in self.plan.paths if p != COMPILED]
            for kind in self.plan.modalities:
                for size in self.plan.batch_sizes[kind]:
                    self._config(engine, name, attention, kind, size, plain, yardstick)
            if COMPILED in self.plan.paths:
                self._compiled(engine, name, attention, yardstick)
        finally:
            engine.close()
            del engine
            free_device_memory()

    def _compiled(self, engine: Engine, name: str, attention: str, yardstick: Yardstick) -> None:
        engine.set_decode(mode="loop", compile=True)
        for kind in self.plan.modalities:
            for size in self.plan.batch_sizes[kind]:
                self._config(engine, name, attention, kind, size, [COMPILED], yardstick)

    def _load(self, checkpoint: Checkpoint, name: str, attention: str) -> Engine | None:
        plan = self.plan
        largest = max(max(sizes) for sizes in plan.batch_sizes.values())
        settings = EngineSettings(
            device=plan.device,
            dtype=plan.dtype,
            attn_implementation=attention,
            max_new_tokens_default=plan.new_tokens,
            fixed_output_length=True,
            token_budget=10**7,
            # Exact batch sizes: bucketing may split a batch to save padding.
            length_bucketing=False,
            max_batch_size=largest,
            decode=DecodeSettings(slots=largest),
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

    def _config(
        self,
        engine: Engine,
        name: str,
        attention: str,
        kind: str,
        size: int,
        paths: Sequence[str],
        yardstick: Yardstick,
    ) -> None:
        what = f"{name} / {kind} / bs={size}"
        reason = self.budget.refuse([f"run:{p}:{kind}" for p in paths], what)
        if reason:
            self._skip(reason)
            return
        try:
            requests = workload(kind, size, self.plan.workdir / "media")
            batch = collate_batch(engine, requests)
        except Exception as exc:
            self._fail(f"{what}: prepare", exc)
            return
        for path in paths:
            self._path(engine, what, (name, attention, kind, size, path), batch, yardstick)

    def _path(
        self,
        engine: Engine,
        what: str,
        key: tuple[str, str, str, int, str],
        batch: Batch,
        yardstick: Yardstick,
    ) -> None:
        name, attention, kind, size, path = key
        reason = self.budget.refuse([f"run:{path}:{kind}"], f"{what} / {path}")
        if reason:
            self._skip(reason)
            return
        started = time.perf_counter()
        try:
            measured = measure(engine, batch, path, self.plan.new_tokens, yardstick)
        except Exception as exc:
            self._fail(f"{what} / {path}", exc)
            return
        self.budget.record(f"run:{path}:{kind}", time.perf_counter() - started)
        base = next(
            (
                r.measurement
                for r in self.report.rows
                if (r.model, r.attention, r.modality, r.batch_size, r.path)
                == (name, attention, kind, size, "generate")
            ),
            None,
        )
        speedup = measured.tokens_per_s / base.tokens_per_s if base is not None else None
        row = Row(name, attention, kind, size, path, measured, speedup)
        self.report.rows.append(row)
        self.clock.say(f"{what} / {path}: {_progress(row)}")
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


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _progress(row: Row) -> str:
    m = row.measurement
    peak = f" {m.peak_gib:.2f} GiB peak" if m.peak_gib is not None else ""
    speedup = f" x{row.speedup:.2f} over generate" if row.speedup is not None else ""
    return (
        f"{m.tokens_per_s:.1f} tok/s, {m.step_ms:.2f} ms/step, busy {_share(m.busy)}, "
        f"nvml {_share(m.nvml)}, roofline {_share(m.roofline)}, prefill "
        f"{_share(m.prefill_tflops)} TFLOP/s, warm-up {m.warmup_s:.1f} s{peak}{speedup}"
    )


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
    sizes = "; ".join(
        f"{k} {', '.join(str(s) for s in plan.batch_sizes[k])}" for k in plan.modalities
    )
    status = "complete" if report.finished else "partial (still running or cut short)"
    bandwidth = f"{report.bandwidth / 1e9:.0f} GB/s" if report.bandwidth else "not measured"
    return [
        f"Command: `{plan.command}`",
        "",
        f"Machine: {machine()}. {_gpu_line()}. Memory bandwidth (a copy, measured in this run): "
        f"{bandwidth}.",
        "",
        f"Checkpoints: random weights, `{plan.size}` dimensions of the tiny builder, {plan.dtype} "
        f"on {plan.device}. Workload: `bench.common.workload` (text prompts of 4-24 words; one "
        f"224x224 image; a 16-frame 64x64 video at 8 fps). {plan.new_tokens} new tokens per row "
        f"(fixed). Batch sizes: {sizes}. Paths: {', '.join(plan.paths)}. Seconds are the "
        "model's work on a collated batch (prepare and collate excluded); ms/step = (T_N - T_1) "
        "/ (N - 1); busy = the device's own time / wall (the decode loop's CUDA events; "
        "'-' for generate, whose eager launches it cannot bracket); nvml = NVML utilisation "
        "sampled every 50 ms; roofline = bytes a decode step reads (weights once, each row's "
        "keys and values) / step time / bandwidth; prefill TFLOP/s = 2 x parameters x tokens "
        "(vision encoder included) / T_1. Peak memory: `torch.cuda.max_memory_allocated`.",
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
    peak = f"{m.peak_gib:.2f}" if m.peak_gib is not None else "-"
    speedup = f"{row.speedup:.2f}x" if row.speedup is not None else "-"
    return (
        f"| {row.model} | {row.attention} | {row.modality} | {row.batch_size} | {row.path} "
        f"| {m.tokens_per_s:.1f} | {m.step_ms:.2f} | {_share(m.busy)} | {_share(m.nvml)} "
        f"| {_share(m.roofline)} | {_share(m.prefill_tflops)} | {m.warmup_s:.1f} | {peak} "
        f"| {speedup} |"
    )


def _results_table(report: Report) -> list[str]:
    lines = [
        "",
        "| model | attention | modality | batch size | path | generated tok/s | ms/step "
        "| busy | nvml | roofline | prefill TFLOP/s | warm-up s | peak GPU GiB "
        "| tok/s over generate |",
        "| --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: |",
    ]
    return lines + [_row_line(row) for row in report.rows]


def render(report: Report) -> str:
    lines = ["## GPU run", "", *_header(report), *_setup_table(report)]
    if report.rows:
        lines += _results_table(report)
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


def _batch_sizes(text: str) -> dict[str, tuple[int, ...]]:
    """``text=1:8:32:64,image=1:8:32`` (modalities left out keep their default)."""
    sizes = dict(GPU_BATCH)
    for item in _csv(text):
        kind, _, value = item.partition("=")
        parts = value.split(":")
        if kind not in MODALITIES or not all(p.isdigit() and int(p) >= 1 for p in parts):
            raise argparse.ArgumentTypeError(f"expected modality=N[:N...], got {item!r}")
        sizes[kind] = tuple(int(p) for p in parts)
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
    add("--paths", type=_csv, default=PATHS, help=f"of {', '.join((*PATHS, COMPILED))}")
    add("--compile", action="store_true", help=f"add the {COMPILED} path")
    add("--size", default=None, help="checkpoint size (default real; tiny with --cpu-smoke)")
    add("--device", default=None, help="default cuda (cpu with --cpu-smoke)")
    add("--dtype", default=None, help="default bfloat16 (float32 with --cpu-smoke)")
    add("--batch-sizes", type=_batch_sizes, default=None, help="e.g. text=1:8:32:64,image=1:8")
    add("--new-tokens", type=int, default=None, help="fixed output length (default 64)")
    add("--time-budget-s", type=float, default=None, help="default 400 (90 with --cpu-smoke)")
    add("--workdir", type=Path, default=None, help="default .vlmq/gpu (.vlmq/gpu-smoke)")
    add("--write", default=None, help="markdown file (default bench/GPU.md; '' for none)")
    add("--progress", type=Path, default=None, help="also write progress lines to this file")
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
    paths = tuple(args.paths) + ((COMPILED,) if args.compile else ())
    unknown = [f for f in args.families if f not in FAMILIES]
    unknown += [m for m in args.modalities if m not in MODALITIES]
    unknown += [a for a in args.attn if a not in (*ATTENTIONS, "eager")]
    unknown += [p for p in paths if p not in (*PATHS, COMPILED)]
    if unknown:
        raise SystemExit(f"unknown names: {unknown}")
    return Plan(
        families=args.families,
        attentions=args.attn,
        modalities=args.modalities,
        paths=paths,
        size=_pick(args.size, smoke, "real", "tiny"),
        device=_pick(args.device, smoke, "cuda", "cpu"),
        dtype=_pick(args.dtype, smoke, "bfloat16", "float32"),
        batch_sizes=_pick(args.batch_sizes, smoke, dict(GPU_BATCH), dict(SMOKE_BATCH)),
        new_tokens=_pick(args.new_tokens, smoke, 64, 8),
        time_budget_s=_pick(args.time_budget_s, smoke, 400.0, 90.0),
        workdir=Path(workdir).resolve(),
        write=Path(write) if write else None,
        progress=args.progress,
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
