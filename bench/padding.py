"""Padding efficiency: length-bucketed vs first-come micro-batches, in-process.

    python -m bench.padding [--n 256] [--batch 16] [--model-size tiny]

A mixed-length text workload (prompts of 2 to 300 words, shuffled) runs
through the engine twice in the same process: micro-batches cut from the
arrival order, then from the length-sorted order. Reported: real prompt tokens
/ padded prompt tokens, and the throughput of each.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import WORDS
from vlmq.config.schemas import Request
from vlmq.config.settings import EngineSettings, MediaSettings
from vlmq.workers.engine import Engine


def mixed_workload(n: int, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for i in range(n):
        words = int(rng.choice([2, 5, 10, 20, 40, 80, 160, 300]) * rng.uniform(0.8, 1.2))
        text = " ".join(rng.choice(WORDS) for _ in range(max(1, words)))
        requests.append(
            Request.model_validate(
                {"custom_id": f"m{i}", "messages": [{"role": "user", "content": text}]}
            )
        )
    rng.shuffle(requests)
    return requests


def measure(
    model_dir: str, requests: list[Request], batch: int, bucketing: bool, new_tokens: int
) -> dict[str, Any]:
    settings = EngineSettings(
        max_batch_size=batch,
        token_budget=10**7,
        length_bucketing=bucketing,
        max_new_tokens_default=new_tokens,
        fixed_output_length=True,
    )
    engine = Engine(model_dir, settings, MediaSettings()).setup()
    engine.run(requests[:4])  # warm-up
    engine.stats = type(engine.stats)()
    started = time.perf_counter()
    results = engine.run(requests)
    elapsed = time.perf_counter() - started
    engine.close()
    stats = engine.stats
    assert all(r.status == "succeeded" for r in results)
    return {
        "bucketing": bucketing,
        "real_tokens": stats.real_prompt_tokens,
        "padded_tokens": stats.padded_prompt_tokens,
        "efficiency": stats.real_prompt_tokens / max(1, stats.padded_prompt_tokens),
        "req_per_s": len(requests) / elapsed,
    }


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(args.threads)
    model_dir = Path(args.workdir).resolve() / f"qwen2_5_vl-{args.model_size}"
    if not (model_dir / "config.json").exists():
        from vlmq.workers.demo.tiny import build_tiny_model

        build_tiny_model(model_dir, "qwen2_5_vl", size=args.model_size)
    requests = mixed_workload(args.n)
    return [
        measure(str(model_dir), requests, args.batch, b, args.new_tokens) for b in (False, True)
    ]


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"Command: `python -m bench.padding --n {args.n} --batch {args.batch} "
        f"--model-size {args.model_size} --new-tokens {args.new_tokens}`",
        "",
        "| micro-batches | real prompt tokens | padded prompt tokens | real / padded | req/s |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        name = "length-bucketed" if r["bucketing"] else "first-come"
        lines.append(
            f"| {name} | {r['real_tokens']:,} | {r['padded_tokens']:,} | "
            f"{r['efficiency']:.3f} | {r['req_per_s']:.1f} |"
        )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--model-size", default="tiny")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--workdir", default=".vlmq/bench")
    return p


def main() -> None:
    args = parser().parse_args()
    print(table(run(args), args))


if __name__ == "__main__":
    main()
