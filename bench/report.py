"""The performance report: every figure side by side in one run, with a plot.

    python -m bench.report [--quick]

Runs, one after the other on this machine, and writes bench/REPORT.md and
bench/throughput.png:
1. in-process throughput vs batch size per modality (tiny and small checkpoints);
2. padding efficiency of length-bucketed vs first-come micro-batches;
3. the fleet (bench.fleet): enqueue rate, no-op drain vs raw Redis BRPOP,
   fleet vs in-process efficiency and the batching gain the fleet keeps,
   status-poll time for 10,000 tasks.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import replace_section

HERE = Path(__file__).resolve().parent
REPORT = HERE / "REPORT.md"
PLOT = HERE / "throughput.png"

HEADER = """# vlmq performance report

Produced by `python -m bench.report` (one run, one machine; every figure is a
ratio of two measurements taken side by side in that run, never a timed test).
See the command above each table. Plot: `bench/throughput.png`.
"""


def _python(*args: str) -> None:
    print("$ python -m", " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", *args], check=True, cwd=HERE.parent)


def _plot(rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["checkpoint"] for r in rows})
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4), squeeze=False)
    for axis, size in zip(axes[0], sizes, strict=True):
        for modality in ("text", "image", "video"):
            points = [r for r in rows if r["checkpoint"] == size and r["modality"] == modality]
            if points:
                axis.plot(
                    [p["batch_size"] for p in points],
                    [p["req_per_s"] for p in points],
                    marker="o",
                    label=modality,
                )
        axis.set_xscale("log", base=2)
        axis.set_xlabel("batch size")
        axis.set_ylabel("requests / s")
        axis.set_title(f"in-process throughput, {size} checkpoint")
        axis.grid(True, alpha=0.3)
        axis.legend()
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Smaller sizes (a smoke run).")
    args = parser.parse_args()
    started = time.monotonic()
    if not REPORT.exists():
        REPORT.write_text(HEADER)
    rows_file = Path(tempfile.mkdtemp()) / "engine.json"
    engine_args = ["--n", "16", "--batch-sizes", "1,4,16"] if args.quick else []
    _python(
        "bench.engine_throughput", *engine_args, "--write", str(REPORT), "--json", str(rows_file)
    )
    _plot(json.loads(rows_file.read_text()))
    padding_args = ["--n", "64"] if args.quick else ["--n", "256"]
    table = subprocess.run(
        [sys.executable, "-m", "bench.padding", *padding_args],
        check=True,
        capture_output=True,
        text=True,
        cwd=HERE.parent,
    ).stdout
    replace_section(REPORT, "padding", "## Padding efficiency\n\n" + table.strip())
    _python("bench.fleet", *(["--quick"] if args.quick else []), "--write", str(REPORT))
    print(f"wrote {REPORT} and {PLOT} in {time.monotonic() - started:.0f}s")


if __name__ == "__main__":
    main()
