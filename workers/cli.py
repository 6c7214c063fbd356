"""Worker-side commands: build tiny checkpoints, run a JSONL file in-process."""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import click

from vlmq.config.jsonl import ParsedLine, read_requests
from vlmq.config.settings import Settings

__all__ = [
    "TEST_HOOK_ENV",
    "build_tiny_model",
    "run",
    "run_file",
    "run_test_hook",
    "serve",
    "worker",
    "worker_engine",
]

# Names a module the worker hands its engine to before it is built (run_test_hook).
TEST_HOOK_ENV = "VLMQ_TEST_HOOK"

# --engine simulated: 5 ms per micro-batch, 4 ms per decode step, 20 us per prompt token (an
# H200 serving a 2-3B VLM; the arithmetic is in workers/engine/noop.py, SIMULATE_DEFAULT).
SIMULATE_DEFAULT = "0.005,0.004,0.00002"


@click.command("build-tiny-model")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--family",
    type=click.Choice(["qwen2_5_vl", "qwen3_vl", "internvl"]),
    default="qwen2_5_vl",
    show_default=True,
)
@click.option(
    "--size",
    type=click.Choice(["tiny", "small", "real"]),
    default="tiny",
    show_default=True,
    help="tiny: hidden 64; small: hidden 512 x 4 layers; real: the published dimensions.",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--device",
    default=None,
    help="Make the weights on this device (e.g. cuda) instead of the CPU: fast for --size real.",
)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16", "float16"]),
    default="float32",
    show_default=True,
    help="Weight dtype with --device.",
)
def build_tiny_model(
    directory: Path, family: str, size: str, seed: int, device: str | None, dtype: str
) -> None:
    """Build a deterministic random-weight checkpoint of a real VLM architecture, offline."""
    from vlmq.workers.demo.tiny import build_tiny_model as build

    started = time.perf_counter()
    path = build(directory, family=family, size=size, seed=seed, device=device, dtype=dtype)
    click.echo(f"built {family} ({size}) in {path} in {time.perf_counter() - started:.1f}s")


def _chunks(parsed: Iterator[ParsedLine], size: int) -> Iterator[list[ParsedLine]]:
    chunk: list[ParsedLine] = []
    for item in parsed:
        chunk.append(item)
        if sum(1 for p in chunk if p.request) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _output_record(parsed: ParsedLine, result: Any) -> dict[str, Any]:
    if parsed.error is not None:
        return parsed.error.to_record()
    record: dict[str, Any] = result.model_dump(mode="json", exclude_none=True)
    record["line"] = parsed.line
    return record


def _write_chunk(engine: Any, chunk: list[ParsedLine], out: IO[str], base: Path) -> tuple[int, int]:
    requests = [p.request.resolve_local_paths(base) for p in chunk if p.request is not None]
    results = iter(engine.run(requests))
    ok = failed = 0
    for parsed in chunk:
        record = _output_record(parsed, None if parsed.request is None else next(results))
        ok += record["status"] == "succeeded"
        failed += record["status"] != "succeeded"
        out.write(json.dumps(record, ensure_ascii=False) + "\n")
    out.flush()
    return ok, failed


@click.command("run")
@click.argument(
    "input_path", metavar="INPUT.jsonl", type=click.Path(dir_okay=False, path_type=Path)
)
@click.option(
    "-o", "--output", "output_path", required=True, type=click.Path(dir_okay=False, path_type=Path)
)
@click.option("--model", default=None, help="Model directory or Hugging Face id [VLMQ_MODEL].")
@click.option("--max-batch-size", type=int, default=None, help="Rows per micro-batch.")
@click.option("--token-budget", type=int, default=None, help="Padded tokens per micro-batch.")
@click.option(
    "--chunk-size",
    type=int,
    default=256,
    show_default=True,
    help="Requests read ahead and batched together.",
)
@click.option(
    "--engine",
    "backend",
    type=click.Choice(["hf", "vllm"]),
    default=None,
    help="hf: transformers (default); vllm: vLLM [VLMQ_ENGINE__BACKEND].",
)
def run(
    input_path: Path,
    output_path: Path,
    model: str | None,
    max_batch_size: int | None,
    token_budget: int | None,
    chunk_size: int,
    backend: str | None,
) -> None:
    """Run a JSONL file through the engine in-process (no Redis, no S3), like vllm run-batch.

    Each output line carries custom_id, status, output or error, and usage. A bad
    input line becomes an error record; the run goes on.
    """
    from vlmq.workers.engine import engine_for_backend

    settings = Settings()
    engine_settings = settings.engine.model_copy(
        update={
            k: v
            for k, v in {"max_batch_size": max_batch_size, "token_budget": token_budget}.items()
            if v is not None
        }
    )
    # Local media may be read from the input file's folder and the working directory.
    roots = [*settings.media.local_roots, str(input_path.resolve().parent), str(Path.cwd())]
    media = settings.media.model_copy(update={"local_roots": roots})
    backend = backend or settings.engine.backend
    engine = engine_for_backend(backend, model or settings.model, engine_settings, media).setup()
    started = time.perf_counter()
    ok, failed = run_file(engine, input_path, output_path, chunk_size)
    engine.close()
    elapsed = time.perf_counter() - started
    click.echo(f"\r{ok} succeeded, {failed} failed in {elapsed:.1f}s -> {output_path}", err=True)
    sys.exit(0)


def run_file(engine: Any, input_path: Path, output_path: Path, chunk_size: int) -> tuple[int, int]:
    """``vlmq run``'s loop over a set-up engine: one output line per input line, in order;
    returns (succeeded, failed)."""
    ok = failed = 0
    base = input_path.resolve().parent
    with input_path.open(encoding="utf-8") as lines, output_path.open("w", encoding="utf-8") as out:
        for chunk in _chunks(read_requests(lines), chunk_size):
            done_ok, done_failed = _write_chunk(engine, chunk, out, base)
            ok, failed = ok + done_ok, failed + done_failed
            click.echo(f"\r{ok + failed} done ({failed} failed)", nl=False, err=True)
    return ok, failed


def worker_engine(
    kind: str,
    settings: Settings,
    noop_delay_s: float = 0.0,
    simulate: str = SIMULATE_DEFAULT,
    simulate_processor: str = "host",
) -> Any:
    """The engine ``vlmq worker --engine KIND`` serves with (not set up yet)."""
    if kind == "noop":
        from vlmq.workers.engine.noop import NoopEngine

        return NoopEngine(noop_delay_s)
    from vlmq.workers.engine import engine_for_backend
    from vlmq.workers.media.fleet import fleet_loader

    # The fleet's media allowlist includes the staging location producers upload to.
    loader = fleet_loader(settings)
    backend = "vllm" if kind == "vllm" else "hf"
    engine = engine_for_backend(
        backend, settings.model, settings.engine, loader.settings, loader=loader
    )
    if kind == "simulated":
        from vlmq.workers.engine.noop import SimulatedAccelerator, parse_simulate

        try:
            prefill_s, step_s, token_s = parse_simulate(simulate)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--simulate") from None
        on_device = simulate_processor == "device"
        return SimulatedAccelerator(engine, prefill_s, step_s, token_s, on_device)
    return engine


@click.command("worker")
@click.option(
    "--role",
    type=click.Choice(["gpu", "prepare"]),
    default="gpu",
    show_default=True,
    help="gpu: serve a model; prepare: no model, fetch and decode the media of image and "
    "video tasks into the frame store and hand them on to the GPU workers (the prepare tier).",
)
@click.option(
    "--modality",
    "-m",
    default=None,
    help="Modality classes to serve: text, image, video or a comma list "
    "[default: text,image,video; image,video with --role prepare].",
)
@click.option("--model", default=None, help="Model directory or Hugging Face id [VLMQ_MODEL].")
@click.option("--name", default=None, help="Worker name (default modality@host:pid).")
@click.option(
    "--engine",
    "engine_kind",
    type=click.Choice(["hf", "vllm", "noop", "simulated"]),
    default=None,
    help="hf: transformers (default); vllm: vLLM, continuous batching [VLMQ_ENGINE__BACKEND]; "
    "noop: no inference (queue benchmarks, fault tests); simulated: the real media and "
    "processor work, generate replaced by a sleep (pipeline benchmarks).",
)
@click.option("--noop-delay", type=float, default=0.0, help="Seconds a noop batch takes.")
@click.option(
    "--simulate",
    default=SIMULATE_DEFAULT,
    show_default=True,
    help="With --engine simulated: seconds per micro-batch (prefill), per decode step and per "
    "prompt token (visual ones included); the two-number form charges no prompt tokens.",
)
@click.option(
    "--simulate-processor",
    type=click.Choice(["host", "device"]),
    default="host",
    show_default=True,
    help="With --engine simulated: where the processor's resizing and normalising run; "
    "device: on the simulated accelerator (as on a GPU), not charged to this host's CPU.",
)
@click.option(
    "--celery/--no-celery",
    default=True,
    show_default=True,
    help="Host the loop in a Celery worker (solo pool, events, remote control).",
)
def worker(
    role: str,
    modality: str | None,
    model: str | None,
    name: str | None,
    engine_kind: str | None,
    noop_delay: float,
    simulate: str,
    simulate_processor: str,
    celery: bool,
) -> None:
    """Serve modality queues in batches with one model, loaded once, in this process."""
    from vlmq.workers.fleet.service import WorkerService

    settings = Settings()
    if model:
        settings = settings.model_copy(update={"model": model})
    modality = modality or ("image,video" if role == "prepare" else "text,image,video")
    modalities = [m.strip() for m in modality.split(",") if m.strip()]
    unknown = set(modalities) - {"text", "image", "video"}
    if unknown or not modalities:
        raise click.BadParameter(f"unknown modality {sorted(unknown)}", param_hint="--modality")
    if role == "prepare":
        _serve_prepare(settings, modalities, name, engine_kind, celery)
        return
    kind = engine_kind or settings.engine.backend
    engine = worker_engine(kind, settings, noop_delay, simulate, simulate_processor)
    run_test_hook(engine)
    service = WorkerService(settings, modalities, engine, name=name).setup()
    serve(settings, service, celery)


def _serve_prepare(
    settings: Settings,
    modalities: list[str],
    name: str | None,
    engine_kind: str | None,
    celery: bool,
) -> None:
    """``vlmq worker --role prepare``: no model, no torch."""
    from vlmq.config.errors import ConfigError
    from vlmq.workers.fleet.service import WorkerService

    if "text" in modalities:
        raise click.BadParameter("text tasks have no media to prepare", param_hint="--modality")
    if engine_kind is not None:
        raise click.BadParameter("a prepare worker runs no engine", param_hint="--engine")
    run_test_hook(None)
    try:
        service = WorkerService(settings, modalities, None, name=name, role="prepare").setup()
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    serve(settings, service, celery)


def run_test_hook(engine: Any) -> None:
    """Hand the engine to the module ``VLMQ_TEST_HOOK`` names (its ``install(engine)``) before
    the worker is built: how the test suite injects faults into a worker process
    (tests/support/faults/inject.py). Unset, as in production, nothing is imported."""
    name = os.environ.get(TEST_HOOK_ENV)
    if name:
        importlib.import_module(name).install(engine)


def serve(settings: Settings, service: Any, celery: bool = True) -> None:
    """Host a set-up worker service until it is stopped: in a Celery worker (solo pool,
    events, remote control) or on its own (SIGTERM/SIGINT stop it)."""
    if celery:
        _run_in_celery(settings, service)
    else:
        _run_plain(service)


def _run_in_celery(settings: Settings, service: Any) -> None:
    from vlmq.config.keys import Keys
    from vlmq.workers.fleet.celery_app import make_app

    app = make_app(settings, service)
    celery_worker = app.Worker(
        hostname=service.name.replace(":", "-"),
        pool_cls="solo",
        concurrency=1,
        queues=[Keys(settings.fleet.key_prefix).control_queue()],
        without_gossip=True,
        without_mingle=True,
        task_events=True,
        quiet=True,
    )
    celery_worker.start()
    sys.exit(celery_worker.exitcode or 0)


def _run_plain(service: Any) -> None:
    import signal

    def _stop(signum: int, frame: Any) -> None:
        service.stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    service.start()
    service.wait()
