"""Where a decode step goes: torch.profiler over one generate per path, on the same batch.

    python -m bench.decode_profile [--family qwen2_5_vl] [--size small] [--rows 32]
        [--new-tokens 16] [--device cpu|cuda] [--top 12] [--write docs/engines.md]

Paths: plain ``model.generate`` (no vlmq processors), vlmq's generate path (per-row logits
processors and stopping criteria) and vlmq's decode loop. For each: host time per step, the ops
with the most host time (self CPU), and the operations that make the host wait for the device:
on CUDA the runtime's synchronising calls (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``,
device-to-host ``cudaMemcpy``); on the CPU, where nothing waits, the ATen ops that would (a
tensor read as a Python number or bool: ``aten::_local_scalar_dense``, ``aten::item``,
``aten::is_nonzero``; ops whose output size depends on the data: ``aten::nonzero``), counted
per decode step. With ``--device cuda`` the device's kernel time per step too.
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import machine, replace_section
from bench.decode import _text_requests
from vlmq.config.settings import DecodeSettings, EngineSettings, MediaSettings

MARKER = "decode-profile"
# ATen ops that make a CUDA device sync with the host (their result is read on the host, or
# sizes a tensor): counted on the CPU, where nothing waits.
SYNCING_OPS = ("aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::nonzero")
SYNCING_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


@dataclass
class PathProfile:
    name: str
    steps: int
    host_ms: float
    device_ms: float | None
    syncs: Counter[str] = field(default_factory=Counter)
    top: list[tuple[str, float, int]] = field(default_factory=list)


def _profile(name: str, run: Any, steps: int, top: int, cuda: bool) -> PathProfile:
    run()  # warm
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        run()
    events = prof.key_averages()
    syncs: Counter[str] = Counter()
    for event in events:
        if event.key in SYNCING_OPS or event.key in SYNCING_CALLS:
            syncs[event.key] += event.count
        if cuda and event.key.startswith("cudaMemcpy"):
            syncs[event.key] += event.count
    host_us = sum(e.self_cpu_time_total for e in events)
    device_us = sum(getattr(e, "self_device_time_total", 0) for e in events) if cuda else None
    ranked = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return PathProfile(
        name,
        steps,
        host_us / 1000 / steps,
        None if device_us is None else device_us / 1000 / steps,
        syncs,
        [(e.key, e.self_cpu_time_total / 1000 / steps, e.count // steps) for e in ranked],
    )


def profiles(engine: Any, rows: int, new_tokens: int, top: int) -> list[PathProfile]:
    prepared = [engine.prepare(r) for r in _text_requests(rows, [new_tokens] * rows)]
    collated = engine.collate(prepared)
    model, runner = engine.loaded.model, engine._runner
    inputs = runner._to_device(collated.inputs)
    cuda = engine.loaded.device.startswith("cuda")

    def plain() -> None:
        with torch.inference_mode():
            model.generate(
                **inputs,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=runner.pad_id,
            )

    def vlmq(mode: str) -> Any:
        def run() -> None:
            engine.set_decode(mode=mode, inflight=False)
            items = [replace(p, max_new_tokens=new_tokens) for p in prepared]
            engine.generate(engine.collate(items))

        return run

    paths = (
        ("plain generate", plain),
        ("vlmq generate path", vlmq("generate")),
        ("vlmq decode loop", vlmq("loop")),
    )
    return [_profile(name, run, new_tokens, top, cuda) for name, run in paths]


def render(args: argparse.Namespace, found: list[PathProfile]) -> str:
    lines = [
        f"`python -m bench.decode_profile --family {args.family} --size {args.size} --rows "
        f"{args.rows} --new-tokens {args.new_tokens} --device {args.device}`; {machine()}. "
        "One generate per path (prefill included, spread over its steps), after a warm-up.",
        "",
        "| path | host ms per step | device ms per step | host-waiting ops per step |",
        "| --- | ---: | ---: | --- |",
    ]
    for p in found:
        syncs = ", ".join(f"{k} {v / p.steps:.1f}" for k, v in sorted(p.syncs.items())) or "none"
        device = f"{p.device_ms:.2f}" if p.device_ms is not None else "-"
        lines.append(f"| {p.name} | {p.host_ms:.2f} | {device} | {syncs} |")
    for p in found:
        lines += ["", f"Most host time, {p.name} (ms per step, calls per step):", ""]
        lines += ["| op | ms | calls |", "| --- | ---: | ---: |"]
        lines += [f"| `{key}` | {ms:.3f} | {calls} |" for key, ms, calls in p.top]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="qwen2_5_vl")
    parser.add_argument("--size", default="small")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--workdir", default=".vlmq/bench")
    parser.add_argument("--write", default="docs/engines.md", help="'' to print only")
    args = parser.parse_args(argv)
    folder = Path(args.workdir).resolve() / f"{args.family}-{args.size}"
    if not (folder / "config.json").exists():
        from vlmq.workers.demo.tiny import build_tiny_model

        build_tiny_model(folder, args.family, size=args.size)
    from vlmq.workers.engine import Engine

    settings = EngineSettings(
        device=args.device,
        max_batch_size=args.rows,
        fixed_output_length=True,
        decode=DecodeSettings(slots=args.rows),
    )
    engine = Engine(str(folder), settings, MediaSettings()).setup()
    table = render(args, profiles(engine, args.rows, args.new_tokens, args.top))
    print(table)
    if args.write:
        replace_section(Path(args.write), MARKER, table)


if __name__ == "__main__":
    main()
