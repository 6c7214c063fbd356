"""One vLLM engine for every check of a family (starting vLLM is the tier's whole cost): run in
the vLLM environment from the repository root,

    .venv-vllm/bin/python -m tests.vllm.driver --run IN.jsonl OUT.jsonl --go GO --name NAME

it sets the engine of ``vlmq worker --engine vllm`` up once (model, media roots, Redis and store
from the environment, as for any vlmq process), waits for the file GO (the tier starts every
family's engine at once, and runs one family at a time), runs IN through ``vlmq run``'s loop
(``run_file``) into OUT (written beside it and renamed: OUT appearing means the run is
complete), then serves the fleet with the same engine as ``vlmq worker`` does (``serve``, in a
Celery worker) until it is stopped or killed."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from vlmq.config.logs import configure_logging
from vlmq.config.settings import Settings
from vlmq.workers.cli import run_file, serve, worker_engine
from vlmq.workers.fleet.service import WorkerService


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run", nargs=2, type=Path, required=True, metavar=("IN", "OUT"))
    parser.add_argument("--go", type=Path, required=True)
    parser.add_argument("--name", required=True)
    args = parser.parse_args()
    configure_logging("info", "text")
    settings = Settings()
    engine = worker_engine("vllm", settings).setup()
    while not args.go.exists():  # this family's turn
        time.sleep(0.1)
    source, out = args.run
    partial = out.with_name(out.name + ".partial")
    run_file(engine, source, partial, chunk_size=256)
    partial.rename(out)
    service = WorkerService(settings, ["text", "image", "video"], engine, name=args.name)
    serve(settings, service.setup())


if __name__ == "__main__":  # vLLM starts its engine processes with spawn
    main()
