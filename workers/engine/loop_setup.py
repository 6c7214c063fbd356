"""How a loaded model gets its decode loop: sizes from the settings, CUDA graphs where they
apply, torch.compile with an on-disk cache when asked."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from vlmq.config.settings import EngineSettings
from vlmq.workers.engine.constraints import SlotConstraints
from vlmq.workers.engine.decode_model import DecodeModel
from vlmq.workers.engine.decoder import Decoder
from vlmq.workers.engine.gputime import DeviceTimer
from vlmq.workers.engine.graphs import CudaGraphs, StepRunner, cuda_graphs_wanted
from vlmq.workers.engine.model import LoadedModel

if TYPE_CHECKING:
    from vlmq.workers.engine.runner import BatchRunner

__all__ = ["build_decoder", "compile_cache_dir"]

log = logging.getLogger(__name__)

# Positions per slot when neither the setting nor a shorter context says otherwise.
DEFAULT_MAX_LENGTH = 8192


def build_decoder(loaded: LoadedModel, settings: EngineSettings, runner: BatchRunner) -> Decoder:
    decode = settings.decode
    model = DecodeModel(loaded.model, loaded.family, runner.pad_id, sorted(runner.eos_ids))
    if decode.compile:
        _compile(model, decode.compile_cache_dir)
    on_cuda = loaded.device.startswith("cuda")
    graphs = on_cuda and cuda_graphs_wanted(decode.cuda_graphs, loaded.device)
    slots = decode.slots or settings.max_batch_size
    max_length = decode.max_length or min(loaded.context_length, DEFAULT_MAX_LENGTH)
    with torch.inference_mode():
        decoder = Decoder(
            model,
            slots=slots,
            max_length=max_length,
            sync_every=decode.sync_every,
            max_steps=settings.max_new_tokens_cap,
            eos_ids=sorted(runner.eos_ids),
            constraints=SlotConstraints(runner.grammars, slots, pinned=on_cuda),
            decode=runner.decode_text,
            runner=StepRunner(CudaGraphs(loaded.device) if graphs else None),
            timer=DeviceTimer(loaded.device),
            device=loaded.device,
        )
    log.info(
        "decode loop: %d slots, up to %d positions each, CUDA graphs %s%s",
        slots,
        max_length,
        "on" if graphs else "off",
        ", compiled" if decode.compile else "",
    )
    return decoder


def compile_cache_dir(setting: str | None) -> Path:
    return Path(setting).expanduser() if setting else Path.home() / ".cache" / "vlmq" / "inductor"


def _compile(model: DecodeModel, cache_dir: str | None) -> None:
    """Compile the language model's forward once for every bucket (dynamic shapes), with
    inductor's caches on disk so a restarted worker reuses the kernels and graphs."""
    folder = compile_cache_dir(cache_dir)
    folder.mkdir(parents=True, exist_ok=True)
    # Read by inductor when it first compiles: set before any compile in this process.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(folder))
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    model.compile()
    log.info("decode step compiled with torch.compile (cache: %s)", folder)
