"""Build deterministic random-weight checkpoints of the real VLM architectures, offline.

The checkpoints load through ``AutoModelForImageTextToText.from_pretrained(dir)`` and
``AutoProcessor.from_pretrained(dir)`` exactly like the real ones, so the whole serving path
(processor, chat template, padding, generate) runs in CI without downloading weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    GotOcr2ImageProcessor,
    InternVLConfig,
    InternVLForConditionalGeneration,
    InternVLProcessor,
    InternVLVideoProcessor,
    PreTrainedConfig,
    PreTrainedModel,
    ProcessorMixin,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2Tokenizer,
    Qwen2VLImageProcessor,
    Qwen2VLVideoProcessor,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)

from vlmq.workers.demo.tiny.specs import FAMILIES, SIZES, get_spec
from vlmq.workers.demo.tiny.tokenizer import EOS_TOKEN, PAD_TOKEN, build_tokenizer

# Embedding rows are padded to a multiple of this, as the real checkpoints pad 151665 -> 151936.
_VOCAB_MULTIPLE = 64


@dataclasses.dataclass(frozen=True)
class FamilyClasses:
    """The real transformers classes that make up one family's checkpoint."""

    config: Callable[..., PreTrainedConfig]
    model: Callable[..., PreTrainedModel]
    processor: Callable[..., ProcessorMixin]
    image_processor: Callable[..., Any]
    video_processor: Callable[..., Any]


FAMILY_CLASSES: dict[str, FamilyClasses] = {
    "qwen2_5_vl": FamilyClasses(
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    ),
    "qwen3_vl": FamilyClasses(
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLProcessor,
        Qwen2VLImageProcessor,
        Qwen3VLVideoProcessor,
    ),
    "internvl": FamilyClasses(
        InternVLConfig,
        InternVLForConditionalGeneration,
        InternVLProcessor,
        GotOcr2ImageProcessor,
        InternVLVideoProcessor,
    ),
}


def chat_template(family: str) -> str:
    """The family's chat template, a copy of the published one (shipped as package data)."""
    name = f"chat_template_{family}.jinja"
    return resources.files("vlmq.workers.demo.tiny").joinpath(name).read_text(encoding="utf-8")


def _check_family_size(family: str, size: str) -> None:
    """Reject unknown names early, with the valid choices in the message."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {SIZES}")


def _padded_vocab(n_tokens: int) -> int:
    """Smallest multiple of ``_VOCAB_MULTIPLE`` that holds ``n_tokens``."""
    return -(-n_tokens // _VOCAB_MULTIPLE) * _VOCAB_MULTIPLE


def _text_config(spec_text: dict[str, Any], tokenizer: Qwen2Tokenizer) -> dict[str, Any]:
    """Text-config kwargs: vocabulary sized to the tokenizer, Qwen's bos/eos/pad ids."""
    text = dict(spec_text)
    needed = _padded_vocab(len(tokenizer))
    text["vocab_size"] = max(text.get("vocab_size") or 0, needed)
    pad_id = _token_id(tokenizer, PAD_TOKEN)
    text.setdefault("bos_token_id", pad_id)  # Qwen uses <|endoftext|> as bos in config.json
    text.setdefault("eos_token_id", _token_id(tokenizer, EOS_TOKEN))
    text.setdefault("pad_token_id", pad_id)
    return text


def _token_id(tokenizer: Qwen2Tokenizer, token: str) -> int:
    """Id of a single token; the builder only asks for tokens it put into the vocabulary."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(token_id, int):
        raise TypeError(f"expected one id for {token!r}, got {token_id!r}")
    return token_id


def build_config(family: str, size: str, tokenizer: Qwen2Tokenizer) -> PreTrainedConfig:
    """Build the family's real config class from the size's overrides and the tokenizer's ids.

    Cheap (no weights), so it is also how the "real" sizes are checked.
    """
    _check_family_size(family, size)
    spec = get_spec(family, size)
    text = _text_config(spec["text"], tokenizer)
    vision = dict(spec["vision"])
    top = dict(spec["top"])
    if family == "internvl":
        return InternVLConfig(
            text_config=text,
            vision_config=vision,
            image_token_id=_token_id(tokenizer, "<IMG_CONTEXT>"),
            **top,
        )
    vision["out_hidden_size"] = text["hidden_size"]  # the merger projects into the LLM width
    return FAMILY_CLASSES[family].config(
        text_config=text,
        vision_config=vision,
        image_token_id=_token_id(tokenizer, "<|image_pad|>"),
        video_token_id=_token_id(tokenizer, "<|video_pad|>"),
        vision_start_token_id=_token_id(tokenizer, "<|vision_start|>"),
        vision_end_token_id=_token_id(tokenizer, "<|vision_end|>"),
        **top,
    )


def build_generation_config(tokenizer: Qwen2Tokenizer) -> GenerationConfig:
    """Stop on <|im_end|> (and <|endoftext|>) and pad with <|endoftext|>, as the instruct models.

    The real instruct checkpoints also ship sampling defaults (temperature, top_p ...); we leave
    them out so ``generate`` is greedy unless the caller asks otherwise.
    """
    eos = _token_id(tokenizer, EOS_TOKEN)
    pad = _token_id(tokenizer, PAD_TOKEN)
    return GenerationConfig(bos_token_id=pad, eos_token_id=[eos, pad], pad_token_id=pad)


def build_processor(family: str, size: str, tokenizer: Qwen2Tokenizer) -> ProcessorMixin:
    """Assemble the family's processor (image + video processor, tokenizer, chat template)."""
    _check_family_size(family, size)
    spec = get_spec(family, size)
    classes = FAMILY_CLASSES[family]
    image_processor = classes.image_processor(**spec["image_processor"])
    video_processor = classes.video_processor(**spec["video_processor"])
    return classes.processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=chat_template(family),
        **spec.get("processor", {}),
    )


def build_model(config: PreTrainedConfig, family: str, seed: int) -> PreTrainedModel:
    """Instantiate random weights reproducibly: same seed and config give identical tensors.

    The global RNG is forked so that building a checkpoint does not reseed the caller's RNG.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = FAMILY_CLASSES[family].model(config)
    return model.eval()


def _on_meta(config: PreTrainedConfig, family: str, dtype: torch.dtype) -> PreTrainedModel:
    """The family's model on the meta device: its shapes, no memory, no initialisation."""
    model_class: Any = FAMILY_CLASSES[family].model
    with torch.device("meta"):
        model: PreTrainedModel = model_class._from_config(config, dtype=dtype)
    return model


def build_model_fast(
    config: PreTrainedConfig, family: str, seed: int, device: str, dtype: str
) -> PreTrainedModel:
    """Random weights made where they will run: a meta-device instance materialised on
    ``device`` in ``dtype``, then the model's own ``initialize_weights`` (normal(0,
    initializer_range), ones for norms, RoPE buffers) and weight tying. Seconds on a GPU for
    the real sizes, where :func:`build_model`'s CPU init takes a minute or more. Deterministic
    per device, not byte-identical to :func:`build_model`."""
    model = _on_meta(config, family, getattr(torch, dtype))
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives every module its own storage: tie again
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.initialize_weights()
    return model.eval()


def count_parameters(family: str, size: str) -> int:
    """Parameter count of a size's model, from a meta-device instance (instant, no memory)."""
    tokenizer = build_tokenizer(family, chat_template=chat_template(family))
    model = _on_meta(build_config(family, size, tokenizer), family, torch.bfloat16)
    return sum(p.numel() for p in model.parameters())


def build_tiny_model(
    out_dir: str | Path,
    family: str,
    size: str = "tiny",
    seed: int = 0,
    *,
    device: str | None = None,
    dtype: str = "float32",
) -> Path:
    """Write a random-weight checkpoint of ``family`` at ``size`` into ``out_dir``; return it.

    The directory gets config.json, generation_config.json, model.safetensors, the tokenizer
    files, the processor configs and chat_template.jinja, i.e. what ``save_pretrained`` writes
    for a real checkpoint. Files with the same names are overwritten; other files are kept.
    The same family/size/seed always produce byte-identical weights and tokenizer files.

    With ``device`` the weights are made there, in ``dtype`` (:func:`build_model_fast`): the
    way to build the real-dimension sizes on a GPU machine.
    """
    _check_family_size(family, size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(family, chat_template=chat_template(family))
    config = build_config(family, size, tokenizer)
    if device is None:
        model = build_model(config, family, seed)
    else:
        model = build_model_fast(config, family, seed, device, dtype)
    model.generation_config = build_generation_config(tokenizer)
    model.save_pretrained(out)
    build_processor(family, size, tokenizer).save_pretrained(out)
    return out
