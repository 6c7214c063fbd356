"""What pre-flight needs of the model, read from its files without loading it.

``config.json`` gives the family and context length; the processor configs give the visual
token arithmetic (``config.vision.VisionProfile``); ``tokenizer.json`` and the chat template
give exact text tokens, rendered and counted as the worker's estimate does
(``workers/engine/estimate._rendered_tokens``), through ``tokenizers`` and ``jinja2`` (no
torch, no transformers). Whatever cannot be read falls back to a stated default: the
family's transformers defaults for the vision numbers, a chars/4 count for the text, each
named in ``assumptions``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from vlmq.config.model_files import find_model_dir, processor_specs, read_json
from vlmq.config.vision import VisionProfile

__all__ = ["ModelProfile", "TextCounter"]

DEFAULT_FAMILY_CONFIG = {"model_type": "qwen2_5_vl"}
# Characters per token of the fallback text estimate (English prose with a BPE tokenizer).
CHARS_PER_TOKEN = 4
_SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _chat_template(directory: Path) -> str | None:
    """The chat template the processor uses: chat_template.jinja, chat_template.json, then
    the processor's or the tokenizer's config."""
    try:
        return (directory / "chat_template.jinja").read_text(encoding="utf-8")
    except OSError:
        pass
    for name in ("chat_template.json", "processor_config.json", "tokenizer_config.json"):
        template = (read_json(directory / name) or {}).get("chat_template")
        if isinstance(template, str):
            return template
    return None


def _special_tokens(directory: Path) -> dict[str, str]:
    """The tokenizer's special tokens by name: the template may print them."""
    config = read_json(directory / "tokenizer_config.json") or {}
    tokens = {}
    for name in _SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


def _compile_template(source: str) -> Any:
    """The template in the sandbox transformers renders it in, with the same helpers."""
    import jinja2
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    # Older versions have known sandbox escapes (transformers refuses them too).
    if tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit()) < (3, 1, 6):
        raise ImportError("jinja2 older than 3.1.6")
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


@dataclass
class TextCounter:
    """Prompt text tokens of a placeholder conversation (``config.vision.template_stub``):
    exact with the model's tokenizer and template, else characters / 4 plus one token per
    placeholder."""

    tokenizer: Any = None
    template: Any = None
    special_tokens: dict[str, str] = field(default_factory=dict)
    reason: str = ""  # why the count is approximate ("" when exact)

    @property
    def exact(self) -> bool:
        return self.tokenizer is not None and self.template is not None

    @property
    def method(self) -> str:
        if self.exact:
            return "exact: the model's chat template and tokenizer"
        return f"approximate: characters / {CHARS_PER_TOKEN} ({self.reason})"

    def count(self, stub: list[dict[str, Any]]) -> int:
        if self.exact:
            text = self.template.render(
                messages=stub,
                tools=None,
                documents=None,
                add_generation_prompt=True,
                **self.special_tokens,
            )
            return len(self.tokenizer.encode(text, add_special_tokens=False).ids)
        chars = sum(len(p.get("text") or "") for m in stub for p in m["content"])
        placeholders = sum(1 for m in stub for p in m["content"] if p["type"] != "text")
        return math.ceil(chars / CHARS_PER_TOKEN) + placeholders

    @classmethod
    def load(cls, directory: Path | None) -> TextCounter:
        if directory is None:
            return cls(reason="model files not found")
        template = _chat_template(directory)
        if template is None:
            return cls(reason="no chat template in the model files")
        if not (directory / "tokenizer.json").is_file():
            return cls(reason="no tokenizer.json in the model files")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            return cls(reason="the tokenizers package is not installed")
        try:
            compiled = _compile_template(template)
            tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        except ImportError:
            return cls(reason="jinja2 >= 3.1.6 is not installed")
        except Exception as exc:  # a template this sandbox cannot compile, a bad tokenizer
            return cls(reason=f"could not load the tokenizer or template: {type(exc).__name__}")
        return cls(tokenizer, compiled, _special_tokens(directory))


@dataclass
class ModelProfile:
    """The model as pre-flight sees it: build once (``load``) and share between estimates;
    tokenizing is thread-safe."""

    name: str
    vision: VisionProfile
    text: TextCounter
    assumptions: list[str] = field(default_factory=list)

    @classmethod
    def load(cls, name: str) -> ModelProfile:
        """From the files of model ``name`` (``settings.model``): a local directory or a
        hub id already in the Hugging Face cache."""
        directory = find_model_dir(name)
        assumptions = []
        config = read_json(directory / "config.json") if directory is not None else None
        if config is None:
            config = DEFAULT_FAMILY_CONFIG
            assumptions.append(
                f"model files of {name!r} not found: visual tokens use Qwen2.5-VL's defaults"
            )
        processor, image, video = processor_specs(directory) if directory else ({}, {}, {})
        if directory is not None and not image:
            assumptions.append("no processor config in the model files: transformers' defaults")
        vision = VisionProfile.from_configs(config, image, video, processor)
        text = TextCounter.load(directory)
        if not text.exact:
            assumptions.append(f"text tokens {text.method}")
        return cls(name, vision, text, assumptions)
