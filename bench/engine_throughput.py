"""Batched vs sequential generation in-process, per modality, side by side.

    python -m bench.engine_throughput [--sizes tiny,small] [--family qwen2_5_vl]
        [--batch-sizes 1,4,8,16,32] [--n 32] [--new-tokens 16] [--write bench/README.md]

Every configuration runs the same requests in the same process, one after the
other; output lengths are fixed (min_new_tokens = max_new_tokens) so every
batch size does the same work. Reported: req/s, generated tok/s and the
speedup over batch size 1.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import torch

from bench.common import machine, replace_section, require_success, run_in_batches, workload
from vlmq.config.settings import EngineSettings, MediaSettings
from vlmq.workers.engine import Engine

MODALITIES = ("text", "image", "video")


def _measure(engine: Engine, requests: list, batch_size: int) -> tuple[float, int]:
    elapsed, results = run_in_batches(engine, requests, batch_size)
    require_success(results)
    return elapsed, sum(r.usage.completion_tokens for r in results)


ROWS: list[tuple[Any, ...]] = []


def run(args: argparse.Namespace) -> str:
    torch.set_num_threads(args.threads)
    workdir = Path(args.workdir).resolve()
    rows = []
    for size in args.sizes:
        model_dir = workdir / f"{args.family}-{size}"
        if not (model_dir / "config.json").exists():
            from vlmq.workers.demo.tiny import build_tiny_model

            build_tiny_model(model_dir, args.family, size=size)
        settings = EngineSettings(
            max_new_tokens_default=args.new_tokens,
            fixed_output_length=True,
            token_budget=10**7,
            # Exact batch sizes: bucketing may split a batch to save padding.
            length_bucketing=False,
            max_batch_size=max(args.batch_sizes),
        )
        engine = Engine(str(model_dir), settings, MediaSettings(local_roots=[str(workdir)])).setup()
        for kind in MODALITIES:
            n = args.n if kind != "video" else max(args.batch_sizes[-1], args.n // 2)
            requests = workload(kind, n, workdir / "media")
            engine.run(requests[:2])  # warm-up
            base_rate = None
            for batch_size in args.batch_sizes:
                elapsed, tokens = _measure(engine, requests, batch_size)
                rate = n / elapsed
                base_rate = base_rate or rate
                rows.append((size, kind, batch_size, n, rate, tokens / elapsed, rate / base_rate))
                ROWS.append(rows[-1])
                print(
                    f"{size:5} {kind:5} bs={batch_size:<3} {rate:7.2f} req/s "
                    f"{tokens / elapsed:8.1f} tok/s  x{rate / base_rate:.2f}",
                    flush=True,
                )
        engine.close()
    return _table(args, rows)


def _table(args: argparse.Namespace, rows: list) -> str:
    lines = [
        f"Command: `python -m bench.engine_throughput --sizes {','.join(args.sizes)} "
        f"--family {args.family} --batch-sizes {','.join(map(str, args.batch_sizes))} "
        f"--n {args.n} --new-tokens {args.new_tokens} --threads {args.threads}`",
        "",
        f"Machine: {machine()}. Model family: {args.family}; "
        f"{args.new_tokens} new tokens per request (fixed).",
        "",
        "| checkpoint | modality | batch size | requests | req/s | generated tok/s "
        "| speedup vs bs=1 |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for size, kind, bs, n, rate, tps, speedup in rows:
        lines.append(f"| {size} | {kind} | {bs} | {n} | {rate:.2f} | {tps:.1f} | {speedup:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=lambda s: s.split(","), default=["tiny", "small"])
    parser.add_argument("--family", default="qwen2_5_vl")
    parser.add_argument(
        "--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8, 16, 32]
    )
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workdir", default=".vlmq/bench")
    parser.add_argument("--write", default=None, help="Markdown file to put the table in.")
    parser.add_argument("--json", default=None, help="Also write the rows as JSON here.")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    table = run(args)
    print(table)
    if args.json:
        keys = (
            "checkpoint",
            "modality",
            "batch_size",
            "requests",
            "req_per_s",
            "tok_per_s",
            "speedup",
        )
        Path(args.json).write_text(json.dumps([dict(zip(keys, r, strict=True)) for r in ROWS]))
    if args.write:
        replace_section(Path(args.write), f"engine-{args.family}", table)


if __name__ == "__main__":
    main()
