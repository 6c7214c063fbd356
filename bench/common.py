"""Shared helpers for benchmarks: workloads, machine description, report writing."""

from __future__ import annotations

import argparse
import os
import platform
import random
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from vlmq.config.schemas import Request

__all__ = [
    "ablate",
    "ablation_args",
    "machine",
    "main_thread_cpu",
    "publish",
    "push_raw",
    "replace_section",
    "require_success",
    "run_in_batches",
    "spread",
    "workload",
]

WORDS = [
    "queue",
    "batch",
    "token",
    "image",
    "video",
    "frame",
    "worker",
    "model",
    "redis",
    "result",
    "status",
    "prompt",
    "padding",
    "latency",
    "throughput",
    "vision",
    "language",
    "request",
    "conversation",
    "fleet",
    "budget",
]


def machine() -> str:
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        cpu = platform.processor() or "unknown CPU"
    import torch
    import transformers

    return (
        f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"torch threads {torch.get_num_threads()}"
    )


def _prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def workload(
    kind: str, n: int, media_dir: Path, seed: int = 0, prompt_words: tuple[int, int] = (4, 24)
) -> list[Request]:
    """n requests of one modality class with varied prompt lengths."""
    from tests.support.samples import save_image, save_video

    rng = random.Random(seed)
    media_dir.mkdir(parents=True, exist_ok=True)
    image = media_dir / "bench.png"
    video = media_dir / "bench.mp4"
    if not image.exists():
        save_image(image, size=(224, 224), seed=1)
    if not video.exists():
        save_video(video, n_frames=16, size=(64, 64), fps=8, seed=2)
    requests = []
    for i in range(n):
        text = {"type": "text", "text": _prompt(rng, rng.randint(*prompt_words))}
        content: list[dict[str, Any]]
        if kind == "text":
            content = [text]
        elif kind == "image":
            content = [{"type": "image", "image": str(image)}, text]
        else:
            content = [{"type": "video", "video": str(video), "fps": 8, "max_frames": 16}, text]
        requests.append(
            Request.model_validate(
                {"custom_id": f"{kind}-{i}", "messages": [{"role": "user", "content": content}]}
            )
        )
    return requests


def run_in_batches(
    engine: Any, requests: list[Request], batch_size: int
) -> tuple[float, list[Any]]:
    """Time ``requests`` through ``engine`` in consecutive batches of ``batch_size``."""
    engine.set_max_batch_size(batch_size)
    started = time.perf_counter()
    results: list[Any] = []
    for start in range(0, len(requests), batch_size):
        results += engine.run(requests[start : start + batch_size])
    return time.perf_counter() - started, results


def require_success(results: list[Any]) -> None:
    failed = [r for r in results if r.status != "succeeded"]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0].error}")


def command_line(module: str, argv: Sequence[str] | None) -> str:
    """The command that ran, as a reader can paste it (an argument with a space quoted)."""
    return f"python -m {module} " + shlex.join(argv if argv is not None else sys.argv[1:])


def replace_section(path: Path, marker: str, body: str) -> None:
    """Replace the text between <!-- marker:start --> and <!-- marker:end -->."""
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        text = head + block + tail
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text, encoding="utf-8")


def wait_for(check: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.01) -> None:
    """Poll ``check`` until it holds; TimeoutError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(poll_s)


def spread(values: Sequence[float], fmt: str) -> str:
    """A figure of repeated runs as the tables give it: median (min-max), or the one value."""
    median = format(statistics.median(values), fmt)
    if len(values) == 1:
        return median
    return f"{median} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def main_thread_cpu(redis: Any) -> float:
    """Redis's main-thread CPU seconds so far (``INFO cpu``): what caps one Redis."""
    info = redis.info("cpu")
    return float(info["used_cpu_sys_main_thread"]) + float(info["used_cpu_user_main_thread"])


RAW_MESSAGE_BYTES = 1000


def push_raw(redis: Any, key: str, tasks: int) -> None:
    """The raw reference's queue: ``tasks`` ~1 KB strings ``LPUSH``ed onto ``key`` in
    pipelined chunks of 2,000."""
    body = "x" * RAW_MESSAGE_BYTES
    pipe = redis.pipeline(transaction=False)
    for start in range(0, tasks, 2000):
        pipe.lpush(key, *[f"{i}:{body}" for i in range(start, min(tasks, start + 2000))])
        pipe.execute()


def ablation_args(doc: str | None, argv: Sequence[str] | None) -> argparse.Namespace:
    """The arguments of a bench that counts what each part costs by taking it out."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--write", default=None, help="Markdown file to put the table in.")
    return parser.parse_args(argv)


def ablate(
    names: Sequence[str], measure: Callable[[str | None], dict[str, float]]
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """``measure(None)`` (the whole) and ``measure(name)`` (without that part) for each name,
    with progress on stderr."""
    whole = measure(None)
    print("as it is: done", file=sys.stderr, flush=True)
    without: dict[str, dict[str, float]] = {}
    for name in names:
        without[name] = measure(name)
        print(f"without {name}: done", file=sys.stderr, flush=True)
    return whole, without


def publish(body: str, write: str | None, marker: str) -> None:
    """Prints a bench's table, and puts it in the markdown file ``write`` names, if any."""
    print(body)
    if write:
        replace_section(Path(write), marker, body)
