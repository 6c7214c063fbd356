"""Hostile input at scale: the bad-input corpus plus generated inputs through
the real media guard and the real engine (tiny Qwen2.5-VL on CPU).

    python -m bench.bad_input [--examples 2000] [--decode-examples 1000] [--seed 0]
        [--batch 16] [--write docs/reliability.md]

Generated inputs come from the hypothesis strategies of
``tests/support/faults/corpus.py``, driven by a ``@given`` function called here
(seeded, generate phase only): ``--examples`` conversations go through
``Request.model_validate`` and then ``Engine.run`` in batches of ``--batch``
with valid batch-mates; ``--decode-examples`` byte strings go straight to
``decode_image`` and ``decode_video``. Reported: inputs by category, worker
crashes, tasks without a clear error, SSRF canary hits and outbound connection
attempts (targets 0), outcomes and error codes, and the time.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as seeded
from hypothesis import strategies as st
from PIL import Image

from bench.common import machine, replace_section
from tests.support.faults.corpus import (
    SUCCEEDED,
    Canary,
    FaultEnv,
    OutboundSpy,
    Verdict,
    build_corpus,
    conversations,
    decode_verdicts,
    engine_settings,
    evaluate,
    items_from_cases,
    items_from_raw,
    make_env,
    make_loader,
    media_bytes,
    media_settings,
    valid_mates,
)
from vlmq.config.settings import MediaSettings

MARKER = "bad-input"
HEADING = "# Reliability figures\n"
T = TypeVar("T")


@dataclass
class Tally:
    """Every verdict, counted the ways the report needs."""

    by_category: dict[str, Counter[str]] = field(default_factory=dict)
    outcomes: Counter[str] = field(default_factory=Counter)
    crashes: list[Verdict] = field(default_factory=list)
    unclear: list[Verdict] = field(default_factory=list)
    mismatched: list[Verdict] = field(default_factory=list)

    def add(self, verdicts: Iterable[Verdict]) -> None:
        for verdict in verdicts:
            self.by_category.setdefault(verdict.category, Counter())[verdict.outcome] += 1
            self.outcomes[verdict.outcome] += 1
            if verdict.crashed:
                self.crashes.append(verdict)
            elif verdict.problems:
                self.unclear.append(verdict)
            if verdict.mismatch:
                self.mismatched.append(verdict)

    def tried(self, category: str) -> int:
        return sum(self.by_category.get(category, Counter()).values())


@dataclass
class Run:
    tally: Tally
    canary_hits: int
    outbound: list[str]
    seconds: dict[str, float]


def drive(strategy: st.SearchStrategy[T], count: int, seed: int, sink: Callable[[T], None]) -> None:
    """Feed ``count`` values of ``strategy`` to ``sink`` through a ``@given``
    function: hypothesis's own generation, seeded, without shrinking."""

    @seeded(seed)
    @settings(
        max_examples=count,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def feed(value: T) -> None:
        sink(value)

    if count > 0:
        feed()


class _Batcher:
    """Collects generated requests and evaluates them a batch at a time."""

    def __init__(self, engine: Any, env: FaultEnv, tally: Tally, size: int) -> None:
        self.engine, self.tally, self.size = engine, tally, size
        self.mates = valid_mates(env)[:2]
        self.pending: list[Any] = []
        self.sent = 0

    def __call__(self, raw: Any) -> None:
        self.pending.append(raw)
        if len(self.pending) >= self.size:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        items = items_from_raw(self.pending, "generated conversation", f"g{self.sent}-")
        self.tally.add(evaluate(self.engine, items, self.mates))
        self.sent += len(self.pending)
        self.pending = []


def run(args: argparse.Namespace) -> Run:
    from vlmq.workers.demo.tiny import build_tiny_model
    from vlmq.workers.engine import Engine

    tally, seconds = Tally(), {}
    with tempfile.TemporaryDirectory() as tmp, Canary() as canary, OutboundSpy() as spy:
        env = make_env(Path(tmp) / "env", canary.port)
        model = build_tiny_model(Path(tmp) / "model", "qwen2_5_vl")
        media = media_settings(env)
        engine = Engine(str(model), engine_settings(), media, make_loader(media)).setup()
        started = time.perf_counter()
        tally.add(evaluate(engine, items_from_cases(build_corpus(env)), valid_mates(env)))
        seconds["corpus"] = time.perf_counter() - started
        started = time.perf_counter()
        batcher = _Batcher(engine, env, tally, args.batch)
        drive(conversations(env), args.examples, args.seed, batcher)
        batcher.flush()
        seconds["conversations"] = time.perf_counter() - started
        started = time.perf_counter()
        _decode_fuzz(env, tally, args.decode_examples, args.seed)
        seconds["decoders"] = time.perf_counter() - started
        engine.close()
        return Run(tally, canary.hits, list(spy.attempts), seconds)


def _decode_fuzz(env: FaultEnv, tally: Tally, count: int, seed: int) -> None:
    settings = MediaSettings()
    with ThreadPoolExecutor(max_workers=1) as pool:
        index = iter(range(count))

        def sink(data: bytes) -> None:
            tally.add(decode_verdicts(f"bytes {next(index, -1)}", data, settings, pool))

        drive(media_bytes(env.seeds), count, seed, sink)


# --- report ---------------------------------------------------------------------------


def _outcomes(counter: Counter[str]) -> str:
    return ", ".join(f"{name} {n}" for name, n in counter.most_common())


_NOT_CORPUS = {"valid batch-mate", "generated conversation", "decoder: image", "decoder: video"}


def _inputs_row(tally: Tally) -> str:
    corpus = sum(tally.tried(c) for c in tally.by_category if c not in _NOT_CORPUS)
    generated = tally.tried("generated conversation")
    blobs = tally.tried("decoder: image")  # each byte string goes to both decoders
    total = corpus + generated + blobs
    return (
        f"| inputs tried | {total}: {corpus} corpus requests, {generated} generated "
        f"conversations, {blobs} generated byte strings (each to both decoders); plus "
        f"{tally.tried('valid batch-mate')} valid batch-mates | |"
    )


def _target_rows(result: Run) -> list[str]:
    tally = result.tally
    mates = tally.by_category.get("valid batch-mate", Counter())
    failed_mates = sum(n for outcome, n in mates.items() if outcome != SUCCEEDED)
    corpus_mismatch = [v for v in tally.mismatched if v.category != "valid batch-mate"]
    rows = [
        ("worker crashes (an exception out of validation, Engine.run or a decoder)",
         len(tally.crashes)),
        ("tasks without a clear error (code outside the client codes, or a message with a "
         "traceback, repr, address, exception name or worker path)", len(tally.unclear)),
        ("SSRF canary hits (connections to the 127.0.0.1 / ::1 listener)", result.canary_hits),
        ("outbound connection attempts of any kind", len(result.outbound)),
        ("corpus cases with another outcome than expected", len(corpus_mismatch)),
        ("valid batch-mates that failed", failed_mates),
    ]  # fmt: skip
    return [f"| {name} | {value} | 0 |" for name, value in rows]


def _category_rows(tally: Tally) -> list[str]:
    return [
        f"| {category} | {sum(counter.values())} | {_outcomes(counter)} |"
        for category, counter in tally.by_category.items()
    ]


def render(args: argparse.Namespace, result: Run) -> str:
    tally = result.tally
    command = (
        f"python -m bench.bad_input --examples {args.examples} "
        f"--decode-examples {args.decode_examples} --seed {args.seed} --batch {args.batch}"
    )
    total_s = sum(result.seconds.values())
    times = ", ".join(f"{name} {s:.1f} s" for name, s in result.seconds.items())
    lines = [  # the file's own "## Bad input" heading sits above the markers
        f"Command: `{command}`. Machine: {machine()}.",
        "Real media guard and engine: tiny Qwen2.5-VL (hidden 64, 2 layers) on CPU, "
        "`MediaSettings` defaults except: every SSRF host literal allowlisted (loopback, "
        "metadata, private, decimal/hex/short IPv4 forms) with `allow_private_addresses` "
        "off, one local root, 4 MiB / 16 MiB byte caps, DNS only for `localhost` and "
        "numeric hosts; `max_new_tokens` cap 32. Corpus and strategies: "
        "`tests/support/faults/corpus.py`.",
        "",
        "| figure | measured | target |",
        "| --- | ---: | ---: |",
        _inputs_row(tally),
        *_target_rows(result),
        f"| time | {total_s:.1f} s ({times}) | |",
        "",
        "| category | inputs | outcomes |",
        "| --- | ---: | --- |",
        *_category_rows(tally),
        "",
        "| outcome | count |",
        "| --- | ---: |",
        *(f"| {name} | {n} |" for name, n in tally.outcomes.most_common()),
    ]
    return "\n".join(lines)


def _details(result: Run) -> str:
    tally = result.tally
    bad = tally.crashes + tally.unclear + tally.mismatched
    shown = [
        f"  {v.category} / {v.name!r}: {v.outcome} {v.message[:80]!r} {v.problems + v.mismatch}"
        for v in bad[:30]
    ]
    return "\n".join(["problems:", *shown]) if shown else "no problems"


def write(path: Path, body: str) -> None:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(HEADING, encoding="utf-8")
    replace_section(path, MARKER, body)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--examples", type=int, default=2000, help="generated conversations")
    parser.add_argument("--decode-examples", type=int, default=1000, help="generated byte strings")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=16, help="generated requests per Engine.run")
    parser.add_argument("--write", metavar="FILE", help="replace the bad-input section of FILE")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    # The corpus holds a 100-megapixel PNG on purpose; it is refused, not decoded.
    warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)
    args = parse_args(argv)
    result = run(args)
    report = render(args, result)
    print(report)
    print(_details(result), file=sys.stderr)
    if args.write:
        write(Path(args.write), report)
    clean = not (result.tally.crashes or result.tally.unclear or result.tally.mismatched)
    return 0 if clean and result.canary_hits == 0 and not result.outbound else 1


if __name__ == "__main__":
    sys.exit(main())
