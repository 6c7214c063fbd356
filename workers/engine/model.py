"""Model lifecycle: resolve device, dtype and attention, then load once.

Loading happens in :func:`load_model`, called from a worker's or a CLI's setup
step, never at import: importing this module does not import torch.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Any

from vlmq.config.errors import ConfigError
from vlmq.config.settings import EngineSettings
from vlmq.workers.engine.placeholders import unwrapped

__all__ = [
    "LoadedModel",
    "eos_token_ids",
    "load_model",
    "load_processor",
    "resolve_attention",
    "resolve_device",
    "resolve_dtype",
]

log = logging.getLogger(__name__)

FAMILIES = {
    "qwen2_5_vl": "qwen2_5_vl",
    "qwen3_vl": "qwen3_vl",
    "internvl": "internvl",
}


@dataclass
class LoadedModel:
    """A model and its processor, ready for padded batched generation."""

    name: str
    model: Any
    processor: Any
    family: str
    device: str
    dtype: str
    attn_implementation: str
    context_length: int

    @property
    def tokenizer(self) -> Any:
        # The processor's may be wrapped for prompts (processors.py): the tokenizer itself.
        return unwrapped(self.processor.tokenizer)


def resolve_device(requested: str) -> str:
    import torch

    if requested != "auto":
        if requested.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device {requested} requested but CUDA is not available")
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(requested: str, device: str) -> str:
    """bf16 on GPUs that support it, fp32 on CPU (bf16 on CPU is slow and lossy)."""
    if requested != "auto":
        return requested
    if device.startswith("cuda"):
        import torch

        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "float32"


def flash_attention_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def resolve_attention(requested: str, device: str, dtype: str) -> str:
    """flash_attention_2 on CUDA in half precision when installed, else SDPA."""
    if requested != "auto":
        return requested
    half = dtype in ("bfloat16", "float16")
    if device.startswith("cuda") and half and flash_attention_available():
        return "flash_attention_2"
    return "sdpa"


def detect_family(model_type: str) -> str:
    for family in FAMILIES:
        if model_type.startswith(family):
            return family
    raise ConfigError(
        f"unsupported model type {model_type!r}: expected Qwen2.5-VL, Qwen3-VL or InternVL"
    )


def _context_length(config: Any) -> int:
    text_config = getattr(config, "text_config", config)
    return int(getattr(text_config, "max_position_embeddings", 32768))


def eos_token_ids(generation_eos: Any, tokenizer: Any) -> set[int]:
    """Where a row ends: the generation config's EOS id(s) and the tokenizer's (chat models
    end turns with one and pad with the other), the same for every engine."""
    listed = generation_eos if isinstance(generation_eos, list) else [generation_eos]
    return {int(i) for i in listed if i is not None} | {int(tokenizer.eos_token_id)}


def load_processor(name: str, settings: EngineSettings) -> Any:
    """The model's processor, set up for padded batches: each thread that collates loads
    its own (processors are not thread-safe)."""
    from transformers import AutoImageProcessor, AutoProcessor

    processor = AutoProcessor.from_pretrained(name)
    if settings.image_processor_backend != "torchvision":
        # The video processors have only the torchvision backend: swap the image one alone.
        processor.image_processor = AutoImageProcessor.from_pretrained(
            name, backend=settings.image_processor_backend
        )
    # Decoder-only generation pads on the left so every row ends at the same
    # position and new tokens are appended right after each prompt.
    processor.tokenizer.padding_side = "left"
    if processor.tokenizer.pad_token_id is None:
        processor.tokenizer.pad_token = processor.tokenizer.eos_token
    return processor


def processor_device(settings: EngineSettings, device: str) -> str | None:
    """Where the image and video processors run: on a CUDA model's device when the
    torchvision backend is used and ``processor_device`` is auto (the pil one runs on the
    CPU only); None leaves them on the CPU."""
    if (
        settings.processor_device == "auto"
        and device.startswith("cuda")
        and settings.image_processor_backend == "torchvision"
    ):
        return device
    return None


def load_model(name: str, settings: EngineSettings) -> LoadedModel:
    """Load model + processor exactly as for a real checkpoint (local dir or hub id)."""
    import torch
    from transformers import AutoModelForImageTextToText

    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    attn = resolve_attention(settings.attn_implementation, device, dtype)
    log.info("loading model %s on %s (%s, %s)", name, device, dtype, attn)
    model = AutoModelForImageTextToText.from_pretrained(
        name, dtype=getattr(torch, dtype), attn_implementation=attn
    )
    model.to(device)  # type: ignore[arg-type]
    model.eval()
    processor = load_processor(name, settings)
    return LoadedModel(
        name=name,
        model=model,
        processor=processor,
        family=detect_family(model.config.model_type),
        device=device,
        dtype=dtype,
        attn_implementation=attn,
        context_length=_context_length(model.config),
    )
