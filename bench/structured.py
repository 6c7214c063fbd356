"""Structured outputs and n, side by side in one run (issue 13).

* constrained vs unconstrained throughput (generated tokens/s) at batch 1 and 16: the same
  prompts, greedy, the same token limit; constrained rows carry a JSON schema whose string
  field keeps them generating (as long extractions do), so both sides generate about the same
  number of tokens and the difference is the masking;
* schema compile time, cold (a schema the worker has not seen) vs cached;
* ``n=4`` vs four separate requests of the same image prompt (sampled, seeded).

    python -m bench.structured [--family qwen2_5_vl] [--sizes tiny,small] [--repeats 3]

The tiny checkpoints' vocabulary is ~2,240 tokens; a Qwen model's is 151,646, where a
constraint's mask costs more per step (bench.grammar_engines measures it on a 149k-token
vocabulary): read the ratio here with that figure beside it.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import machine
from tests.support.samples import save_image
from vlmq.config.constraints import Constraint, json_schema_grammar
from vlmq.config.schemas import Request
from vlmq.config.settings import EngineSettings, MediaSettings
from vlmq.workers.demo.tiny import build_tiny_model

NEW_TOKENS = 32
LONG_TEXT: dict[str, Any] = {
    "type": "object",
    "properties": {"summary": {"type": "string"}, "label": {"enum": ["a", "b", "c"]}},
    "required": ["summary", "label"],
}


def _request(i: int, **generation: Any) -> Request:
    text = f"Summarise request {i} about queues, batches and padded generation."
    return Request.model_validate(
        {
            "messages": [{"role": "user", "content": text}],
            "max_new_tokens": NEW_TOKENS,
            **generation,
        }
    )


def _tokens_per_s(engine: Any, requests: list[Request], batch: int) -> tuple[float, float]:
    """Generated tokens per second, and the share of rows that ran to the limit."""
    engine.set_max_batch_size(batch)
    started = time.perf_counter()
    results = engine.run(requests)
    elapsed = time.perf_counter() - started
    assert all(r.status == "succeeded" for r in results), [r.error for r in results]
    tokens = sum(r.usage.completion_tokens for r in results)
    full = sum(r.usage.completion_tokens == NEW_TOKENS for r in results) / len(results)
    return tokens / elapsed, full


def throughput(engine: Any, batch: int, rows: int) -> dict[str, float]:
    schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": LONG_TEXT}}
    plain = [_request(i) for i in range(rows)]
    constrained = [_request(i, response_format=schema) for i in range(rows)]
    _tokens_per_s(engine, constrained[:batch], batch)  # warm: compile, first masks
    plain_rate, _ = _tokens_per_s(engine, plain, batch)
    constrained_rate, full = _tokens_per_s(engine, constrained, batch)
    return {
        "plain_tok_s": plain_rate,
        "constrained_tok_s": constrained_rate,
        "slowdown": 1 - constrained_rate / plain_rate,
        "constrained_full_rows": full,
    }


_fresh = itertools.count()


def compile_times(engine: Any, count: int = 20) -> dict[str, float]:
    """A schema the worker has not seen (a new field name each time) vs one it has."""
    book = engine._runner.grammars
    cold = []
    for _ in range(count):
        i = next(_fresh)
        schema = {
            **LONG_TEXT,
            "properties": {**LONG_TEXT["properties"], f"f{i}": {"type": "integer"}},
        }
        constraint = Constraint("response_format", json_schema_grammar(schema), True)
        started = time.perf_counter()
        book.compile(constraint)
        cold.append(time.perf_counter() - started)
    started = time.perf_counter()
    for _ in range(count):
        book.compile(constraint)
    cached = (time.perf_counter() - started) / count
    return {"cold_ms": statistics.median(cold) * 1000, "cached_us": cached * 1e6}


def n_vs_separate(engine: Any, image: str, reps: int = 3) -> dict[str, float]:
    content = [{"type": "image", "image": image}, {"type": "text", "text": "Ideas?"}]

    def req(**generation: Any) -> Request:
        return Request.model_validate(
            {
                "messages": [{"role": "user", "content": content}],
                "max_new_tokens": NEW_TOKENS,
                "temperature": 1.0,
                **generation,
            }
        )

    engine.set_max_batch_size(16)
    one, four = [], []
    for rep in range(reps):
        started = time.perf_counter()
        engine.run([req(n=4, seed=rep)])
        one.append(time.perf_counter() - started)
        started = time.perf_counter()
        engine.run([req(seed=rep * 10 + i) for i in range(4)])
        four.append(time.perf_counter() - started)
    return {
        "n4_s": statistics.median(one),
        "four_requests_s": statistics.median(four),
        "n4_over_four": statistics.median(one) / statistics.median(four),
    }


def _spread(values: list[float], fmt: str = "{:.3g}") -> str:
    return (
        f"{fmt.format(statistics.median(values))} "
        f"({fmt.format(min(values))}-{fmt.format(max(values))})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", default="qwen2_5_vl")
    parser.add_argument("--sizes", default="tiny,small")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--switch-interval", type=float, default=0.0001)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # As a worker runs (WorkerSettings.gil_switch_interval_s): the mask thread gets the GIL
    # back quickly while the model thread computes.
    sys.setswitchinterval(args.switch_interval)
    from vlmq.workers.engine import Engine

    root = Path(tempfile.mkdtemp())
    image = root / "a.png"
    save_image(image, size=(224, 224), seed=1)
    print(f"Machine: {machine()}")
    print(
        f"Command: python -m bench.structured --family {args.family} --sizes {args.sizes} "
        f"--rows {args.rows} --repeats {args.repeats} --threads {args.threads}"
    )
    for size in args.sizes.split(","):
        folder = build_tiny_model(root / f"{args.family}-{size}", args.family, size)
        engine = Engine(
            str(folder), EngineSettings(), MediaSettings(local_roots=[str(root)])
        ).setup()
        print(f"\n## {args.family} {size}: median (min-max) of {args.repeats} runs")
        for batch in (1, 16):
            runs = [
                throughput(engine, batch, args.rows if batch > 1 else 8)
                for _ in range(args.repeats)
            ]
            print(
                f"batch {batch}: plain {_spread([r['plain_tok_s'] for r in runs])} tok/s, "
                f"constrained {_spread([r['constrained_tok_s'] for r in runs])} tok/s, "
                f"slower by {_spread([r['slowdown'] * 100 for r in runs], '{:.1f}')}% "
                f"(constrained rows at the limit: {runs[0]['constrained_full_rows']:.0%})"
            )
        compiles = [compile_times(engine) for _ in range(args.repeats)]
        print(
            f"schema compile: cold {_spread([c['cold_ms'] for c in compiles])} ms, "
            f"cached {_spread([c['cached_us'] for c in compiles])} us"
        )
        n4 = [n_vs_separate(engine, str(image)) for _ in range(args.repeats)]
        print(
            f"n=4: {_spread([r['n4_s'] for r in n4])} s vs four requests "
            f"{_spread([r['four_requests_s'] for r in n4])} s: ratio "
            f"{_spread([r['n4_over_four'] for r in n4], '{:.2f}')}"
        )
        engine.close()


if __name__ == "__main__":
    main()
