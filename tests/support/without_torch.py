"""A vlmq process that cannot import torch: what a prepare worker and a noop worker must run
without (a model worker's imports cost ~8 s of CPU a start)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from vlmq.config.settings import Settings

__all__ = ["run_without_torch"]

ROOT = Path(__file__).resolve().parents[2]

# Put first in the script: an import of any of these fails.
_BLOCK = """
import sys
for name in ("torch", "torchvision", "transformers"):
    sys.modules[name] = None
"""


def run_without_torch(
    script: str, settings: Settings, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a fresh Python with torch, torchvision and transformers unimportable,
    as a vlmq process of ``settings``' Redis and results store (and ``env`` besides)."""
    environment = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "VLMQ_REDIS_URL": settings.redis_url,
        "VLMQ_RESULTS_URL": settings.results_url,
        "VLMQ_S3_ENDPOINT_URL": settings.s3_endpoint_url or "",
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        **env,
    }
    return subprocess.run(
        [sys.executable, "-c", _BLOCK + script],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
