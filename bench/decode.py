"""The decode loop against transformers' generate, side by side in one process.

    python -m bench.decode [--family qwen2_5_vl] [--size small] [--rows 32] [--new-tokens 32]
        [--rounds 3] [--workdir .vlmq/bench] [--write bench/README.md]

1. **Host time per decode step** at ``--rows`` (greedy text, fixed output length, the same
   collated batch): plain ``model.generate`` (no vlmq processors), vlmq's generate path
   (``engine.decode.mode=generate``: per-row logits processors and stopping criteria) and the
   decode loop (eager: this machine has no GPU). A step's cost is (a run of N new tokens - a run
   of 1) / (N - 1): the prefill is taken out. Wall and process CPU per step; each round runs the
   three one after the other; the ratios are taken within a round.
2. **Decode waste** on a workload whose output lengths vary 4x (``--requests``, default 512,
   max_new_tokens drawn from [new/2, 2 new]): generated tokens over slots x steps, static
   micro-batches (each decodes to its longest row) against in-flight slots (a finished row's slot
   takes the next micro-batch's row), with tokens/s. A finite workload ends with a tail in which
   fewer rows than slots are left; the more requests, the less it weighs (a fleet's queue has
   none).
3. With ``--compile-starts``: a worker's start with ``engine.decode.compile`` on, twice, each in a
   fresh process sharing one empty inductor cache folder: the first compiles the decode step,
   the second finds it on disk. Seconds from process start to its first 8 tokens, and whether the
   tokens equal the eager loop's.

On CPU "host time" is all the time: the host computes the model too. What the loop removes on
a GPU (a launch per kernel, a sync per step, work per row on the host) is in docs/engines.md
("Where a step goes"), from ``python -m bench.decode_profile``.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from bench.common import machine, replace_section, require_success, spread
from vlmq.config.schemas import Request
from vlmq.config.settings import DecodeSettings, EngineSettings, MediaSettings

MARKER = "decode"


@dataclass
class StepCost:
    wall_ms: float
    cpu_ms: float


def _text_requests(n: int, new_tokens: list[int], seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    words = ["queue", "batch", "token", "worker", "model", "slot", "cache", "graph", "step"]
    return [
        Request.model_validate(
            {
                "custom_id": f"r{i}",
                "messages": [
                    {"role": "user", "content": " ".join(rng.choice(words) for _ in range(12))}
                ],
                "max_new_tokens": new_tokens[i],
            }
        )
        for i in range(n)
    ]


def _timed(run: Any) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - wall, time.process_time() - cpu


def _step_cost(run: Any, new_tokens: int) -> StepCost:
    """(N tokens - 1 token) / (N - 1): the decode steps without the prefill."""
    long_wall, long_cpu = _timed(lambda: run(new_tokens))
    short_wall, short_cpu = _timed(lambda: run(1))
    steps = new_tokens - 1
    return StepCost(1000 * (long_wall - short_wall) / steps, 1000 * (long_cpu - short_cpu) / steps)


def host_time_round(engine: Any, rows: int, new_tokens: int) -> dict[str, StepCost]:
    """One round of the three ways to decode the same collated batch."""
    requests = _text_requests(rows, [new_tokens] * rows)
    prepared = [engine.prepare(r) for r in requests]
    collated = engine.collate(prepared)
    model, runner = engine.loaded.model, engine._runner
    inputs = runner._to_device(collated.inputs)

    def plain(n: int) -> None:
        with torch.inference_mode():
            model.generate(
                **inputs,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=runner.pad_id,
            )

    def with_max(n: int) -> list[Any]:
        return [replace(p, max_new_tokens=n) for p in prepared]

    def vlmq(mode: str) -> Any:
        def run(n: int) -> None:
            engine.set_decode(mode=mode, inflight=False)
            outcomes = engine.generate(engine.collate(with_max(n)))
            assert all(o.error is None for o in outcomes), outcomes[0].error

        return run

    costs = {}
    for name, run in (("plain", plain), ("generate", vlmq("generate")), ("loop", vlmq("loop"))):
        run(2)  # warm: the first call of a path pays one-time setup
        costs[name] = _step_cost(run, new_tokens)
    return costs


def waste_round(engine: Any, rows: int, new_tokens: int, count: int) -> dict[str, dict[str, float]]:
    """Static micro-batches against in-flight slots on outputs that vary 4x.

    ``decode``: the tokens decode steps made over slots x decode steps: the decode waste of a
    static batch (its rows wait for its longest), and what a memory-bound GPU pays (a step
    costs about the same however many of its rows are busy). ``with prefills``: every token over
    slots x (decode steps + prefills), a prefill counted as one step in which only the rows it
    admits make a token (a small prefill on a GPU is a weight read like a step): refilling slots
    a few rows at a time costs prefills. ``computed``: tokens over the rows the steps actually
    ran (the loop packs its rows into the fewest slots), what a compute-bound device pays."""
    rng = random.Random(1)
    lengths = [rng.randint(new_tokens // 2, new_tokens * 2) for _ in range(count)]
    requests = _text_requests(count, lengths, seed=1)
    found = {}
    for name, inflight in (("static", False), ("in flight", True)):
        engine.set_decode(mode="loop", inflight=inflight, slots=rows)
        engine.run(requests[:rows])  # warm
        decode = engine.decoder.stats
        before = dict(vars(decode))
        started = time.perf_counter()
        results = engine.run(requests)
        elapsed = time.perf_counter() - started
        require_success(results)
        grew = {key: getattr(decode, key) - before[key] for key in before}
        tokens = grew["useful_steps"]
        steps, prefills = grew["steps"], grew["prefills"]
        found[name] = {
            "steps": steps,
            "prefills": prefills,
            "decode": (tokens - grew["admitted_rows"]) / (rows * steps),
            "with prefills": tokens / (rows * (steps + prefills)),
            "computed": tokens / grew["row_steps"],
            "tok_s": sum(r.usage.completion_tokens for r in results) / elapsed,
        }
    return found


_START = """
import json, sys, time
started = time.perf_counter()
from vlmq.config.schemas import Request
from vlmq.config.settings import DecodeSettings, EngineSettings, MediaSettings
from vlmq.workers.engine import Engine
folder, cache = sys.argv[1], sys.argv[2]
decode = DecodeSettings(compile=True, compile_cache_dir=cache)
engine = Engine(folder, EngineSettings(max_new_tokens_default=8, decode=decode), MediaSettings())
engine.setup()
requests = [Request.model_validate({"messages": [{"role": "user", "content": f"hi {i}"}]})
            for i in range(4)]
compiled = [r.output for r in engine.run(requests)]
ready = time.perf_counter() - started
engine.set_decode(compile=False)
print(json.dumps({"ready_s": ready, "same": compiled == [r.output for r in engine.run(requests)]}))
"""


def compile_starts(folder: Path, workdir: Path) -> dict[str, Any]:
    """Two fresh processes with compile on and one empty cache folder: cold, then warm."""
    import subprocess
    import sys
    import tempfile

    cache = Path(tempfile.mkdtemp(prefix="inductor-", dir=workdir))
    found: dict[str, Any] = {}
    for name in ("cold", "warm"):
        done = subprocess.run(
            [sys.executable, "-c", _START, str(folder), str(cache)],
            capture_output=True,
            text=True,
            check=True,
        )
        found[name] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def render(
    args: argparse.Namespace,
    hosts: list[dict[str, StepCost]],
    wastes: list[Any],
    starts: list[dict[str, Any]],
) -> str:
    lines = [
        f"`python -m bench.decode --family {args.family} --size {args.size} --rows {args.rows} "
        f"--new-tokens {args.new_tokens} --rounds {args.rounds}`; {machine()}. Median of "
        f"{args.rounds} rounds (min-max).",
        "",
        f"Host time per decode step, {args.rows} rows, greedy text, fp32 (CPU: the host "
        "computes the model too):",
        "",
        "| path | ms per step (wall) | CPU ms per step | wall / plain generate |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, label in (
        ("plain", "transformers `generate`, no vlmq processors"),
        ("generate", "vlmq's generate path (per-row processors)"),
        ("loop", "vlmq's decode loop (eager)"),
    ):
        walls = [h[name].wall_ms for h in hosts]
        cpus = [h[name].cpu_ms for h in hosts]
        ratios = [h[name].wall_ms / h["plain"].wall_ms for h in hosts]
        cells = [spread(values, ".2f") for values in (walls, cpus, ratios)]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Decode waste, {args.requests} requests whose max_new_tokens vary 4x "
        f"({args.new_tokens // 2}-{args.new_tokens * 2}), fixed output lengths, {args.rows} "
        "rows at once:",
        "",
        "| decoding | decode steps | prefills | decode tokens / (slots x decode steps) "
        "| tokens / (slots x (steps + prefills)) | tokens / rows computed | generated tok/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    keys = ("steps", "prefills", "decode", "with prefills", "computed", "tok_s")
    for name in ("static", "in flight"):
        cells = [spread([w[name][key] for w in wastes], ".2f") for key in keys]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    if starts:
        cold = [s["cold"]["ready_s"] for s in starts]
        warm = [s["warm"]["ready_s"] for s in starts]
        same = all(s[k]["same"] for s in starts for k in ("cold", "warm"))
        lines += [
            "",
            "A worker's start with `engine.decode.compile` (torch.compile, inductor on the CPU), "
            "seconds from process start to its first four 8-token requests, each start a fresh "
            "process sharing one inductor cache folder:",
            "",
            "| start | seconds to first results |",
            "| --- | ---: |",
            f"| first (compiles the decode step) | {spread(cold, '.2f')} |",
            f"| restarted (compiled step read from disk) | {spread(warm, '.2f')} |",
            "",
            f"Compiled tokens equal to the eager loop's: {'yes' if same else 'NO'}.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="qwen2_5_vl")
    parser.add_argument("--size", default="small")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--requests", type=int, default=512, help="requests in the decode-waste workload"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", default=".vlmq/bench")
    parser.add_argument("--write", default="bench/README.md", help="'' to print only")
    parser.add_argument("--compile-starts", action="store_true", help="also time compiled starts")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    folder = Path(args.workdir).resolve() / f"{args.family}-{args.size}"
    if not (folder / "config.json").exists():
        from vlmq.workers.demo.tiny import build_tiny_model

        build_tiny_model(folder, args.family, size=args.size)
    from vlmq.workers.engine import Engine

    settings = EngineSettings(
        max_batch_size=args.rows,
        fixed_output_length=True,
        decode=DecodeSettings(slots=args.rows),
    )
    engine = Engine(str(folder), settings, MediaSettings()).setup()
    hosts, wastes, starts = [], [], []
    for round_ in range(args.rounds):
        hosts.append(host_time_round(engine, args.rows, args.new_tokens))
        wastes.append(waste_round(engine, args.rows, args.new_tokens, args.requests))
        if args.compile_starts:
            starts.append(compile_starts(folder, Path(args.workdir).resolve()))
        print(
            f"round {round_ + 1}: "
            + json.dumps({k: round(v.wall_ms, 2) for k, v in hosts[-1].items()} | wastes[-1])
            + (f" starts {json.dumps(starts[-1])}" if starts else ""),
            flush=True,
        )
    table = render(args, hosts, wastes, starts)
    print(table)
    if args.write:
        replace_section(Path(args.write), MARKER, table)


if __name__ == "__main__":
    main()
