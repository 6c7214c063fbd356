"""HF engine vs vLLM engine on the CPU, the same requests, one run (issue 14).

Each engine runs in a process of its own, in its own environment (HF: this one; vLLM: the
``.venv-vllm`` of ``make setup-vllm``), over the same small checkpoint and the same requests
per modality (``bench.common.workload``), with fixed output lengths so both do the same
work. Reported per engine: the start cost (import + setup: model load; for vLLM its engine
processes, profiling and warm-up) and, per modality, requests/s and generated tokens/s with
every request handed over at once (HF: sorted static micro-batches; vLLM: continuous
batching). On CPU this shows the wiring and the start cost, not what vLLM is for: its gains
(paged KV cache, continuous batching, CUDA graphs) are GPU gains.

    python -m bench.engines [--family qwen2_5_vl] [--n 32] [--new-tokens 16]

On a GPU machine (``bash bench/gpu.sh --engines``): ``--size real`` (real-dimension random
checkpoints, bf16) and ``--vllm-python`` the interpreter that has vllm (the same one when it is
installed next to vlmq); the HF side also reports its GPU-busy fraction (time inside
``generate`` over wall time). A vLLM side that cannot import vllm is skipped, and said so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vlmq.workers.engine.vllm_engine import CPU_BUILD_ENV

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
MODALITIES = ("text", "image", "video")


def _side(backend: str, model: str, requests_path: Path, new_tokens: int) -> dict[str, Any]:
    """Run in the engine's own process: start it, then each modality's requests at once."""
    started = time.perf_counter()
    from vlmq.config.schemas import Request
    from vlmq.config.settings import EngineSettings, MediaSettings, VllmSettings
    from vlmq.workers.engine import engine_for_backend

    settings = EngineSettings(
        backend=backend,
        max_new_tokens_default=new_tokens,
        fixed_output_length=True,
        max_batch_size=32,
        vllm=VllmSettings(max_model_len=4096, max_num_seqs=32),
    )
    lines = json.loads(requests_path.read_text())
    media = MediaSettings(local_roots=[str(requests_path.parent)])
    engine = engine_for_backend(backend, model, settings, media).setup()
    report: dict[str, Any] = {"backend": backend, "start_s": time.perf_counter() - started}
    for modality in MODALITIES:
        requests = [Request.model_validate(line) for line in lines[modality]]
        engine.run(requests[:2])  # warm
        if engine.stats is not None:
            engine.stats.generate_s = 0.0
        began = time.perf_counter()
        results = engine.run(requests)
        elapsed = time.perf_counter() - began
        failed = [r for r in results if r.status != "succeeded"]
        if failed:
            raise RuntimeError(f"{backend} {modality}: {failed[0].error}")
        tokens = sum(r.usage.completion_tokens for r in results)
        report[modality] = {
            "req_s": len(results) / elapsed,
            "tok_s": tokens / elapsed,
            "busy": _busy(engine, elapsed),
            "outputs": [r.output for r in results],
        }
    engine.close()
    return report


def _busy(engine: Any, elapsed: float) -> float | None:
    """The HF engine's model-busy fraction (time inside generate / wall); None for vLLM,
    whose engine process keeps its own clock."""
    stats = engine.stats
    return stats.generate_s / elapsed if stats is not None and elapsed > 0 else None


def _run_side(python: Path, backend: str, model: Path, requests_path: Path, args: Any) -> Any:
    out = requests_path.parent / f"{backend}.json"
    command = [
        str(python),
        "-m",
        "bench.engines",
        "--side",
        backend,
        "--model",
        str(model),
        "--requests",
        str(requests_path),
        "--new-tokens",
        str(args.new_tokens),
        "--out",
        str(out),
    ]
    env = {**os.environ, **CPU_BUILD_ENV} if backend == "vllm" else dict(os.environ)
    began = time.perf_counter()
    subprocess.run(command, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    report = json.loads(out.read_text())
    report["process_s"] = time.perf_counter() - began
    return report


def _vllm_missing(python: Path) -> str | None:
    """Why the vLLM side cannot run with this interpreter, or None."""
    if not python.exists():
        return f"{python} does not exist (run `make setup-vllm`)"
    found = subprocess.run([str(python), "-c", "import vllm"], capture_output=True, text=True)
    if found.returncode != 0:
        return f"{python} cannot import vllm: {found.stderr.strip().splitlines()[-1:]}"
    return None


def _workload(folder: Path, n: int) -> Path:
    from bench.common import workload

    lines = {
        m: [r.model_dump(mode="json", exclude_none=True) for r in workload(m, n, folder)]
        for m in MODALITIES
    }
    path = folder / "requests.json"
    path.write_text(json.dumps(lines))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", default="qwen2_5_vl")
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--size", default="small", help="checkpoint size: small, or real (GPU)")
    parser.add_argument(
        "--vllm-python", type=Path, default=VLLM_PYTHON, help="an interpreter that has vllm"
    )
    parser.add_argument("--side", choices=["hf", "vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        report = _side(args.side, args.model, args.requests, args.new_tokens)
        args.out.write_text(json.dumps(report))
        return
    from bench.common import machine
    from vlmq.workers.demo.tiny import build_tiny_model

    folder = Path(tempfile.mkdtemp())
    dtype = "bfloat16" if args.size == "real" else "float32"
    model = build_tiny_model(folder / "model", args.family, args.size, dtype=dtype)
    requests_path = _workload(folder, args.n)
    reports = [_run_side(Path(sys.executable), "hf", model, requests_path, args)]
    skipped = _vllm_missing(args.vllm_python)
    if skipped:
        print(f"vLLM side skipped: {skipped}")
    else:
        reports.append(_run_side(args.vllm_python, "vllm", model, requests_path, args))
    print(f"Machine: {machine()}")
    print(
        f"Command: python -m bench.engines --family {args.family} --n {args.n} "
        f"--new-tokens {args.new_tokens} (small checkpoint, fp32, fixed output length)\n"
    )
    print(
        "| engine | start (import + setup) | "
        + " | ".join(f"{m} req/s | {m} tok/s" for m in MODALITIES)
        + " |"
    )
    print("|---|---:|" + "---:|---:|" * len(MODALITIES))
    for report in reports:
        cells = " | ".join(
            f"{report[m]['req_s']:.1f} | {report[m]['tok_s']:.0f}" for m in MODALITIES
        )
        print(f"| {report['backend']} | {report['start_s']:.1f} s | {cells} |")
    busy = {m: reports[0][m]["busy"] for m in MODALITIES}
    print("\nHF model-busy fraction: " + ", ".join(f"{m} {b:.2f}" for m, b in busy.items() if b))
    if len(reports) < 2:
        return
    hf, vllm = reports
    same = {
        m: f"{sum(a == b for a, b in zip(hf[m]['outputs'], vllm[m]['outputs'], strict=True))}"
        f"/{len(hf[m]['outputs'])}"
        for m in MODALITIES
    }
    print(f"\nsame outputs (greedy, fixed length): {same}")


if __name__ == "__main__":
    main()
