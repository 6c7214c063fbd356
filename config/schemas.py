"""Request and result schemas: the wire contract between producers and workers.

A request is one conversation. Producers accept the Hugging Face chat format
(``{"type": "image", "image": ...}``) and OpenAI chat content parts
(``{"type": "image_url", "image_url": {"url": ...}}``) and normalise both into
one canonical form, so workers see a single shape:

    {"type": "text",  "text": "..."}
    {"type": "image", "source": "<path | file:// | http(s):// | s3:// | data:>"}
    {"type": "video", "source": "...", "fps": 2.0, "max_frames": 16, "video_sampling": "exact"}
"""

from __future__ import annotations

import uuid
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from vlmq.config.constraints import (
    MAX_CHOICE_CHARS,
    MAX_CHOICES,
    MAX_GRAMMAR_CHARS,
    Constraint,
    ConstraintError,
    constraint_of,
)
from vlmq.config.ids import ID_MAX_LENGTH, ID_PATTERN

__all__ = [
    "MAX_N",
    "MAX_PARTS",
    "MAX_TOP_LOGPROBS",
    "Choice",
    "FinishReason",
    "GenerationParams",
    "ImagePart",
    "Message",
    "Modality",
    "Request",
    "Result",
    "TextPart",
    "Usage",
    "VideoPart",
    "bounded_conversation",
    "count_parts",
    "new_task_id",
]


class Modality(str, Enum):
    """The routing class of a request: decides which queue and worker serve it."""

    TEXT = "text"
    IMAGE = "image"
    VIDEO = "video"


class FinishReason(str, Enum):
    STOP = "stop"
    LENGTH = "length"


def new_task_id() -> str:
    return uuid.uuid4().hex


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TextPart(_Part):
    type: Literal["text"] = "text"
    text: str


class ImagePart(_Part):
    type: Literal["image"] = "image"
    source: str = Field(min_length=1)


class VideoPart(_Part):
    type: Literal["video"] = "video"
    source: str = Field(min_length=1)
    fps: float | None = Field(None, gt=0, le=60)
    max_frames: int | None = Field(None, ge=2, le=4096)
    # exact: the frame on screen at each sample time; keyframes: the keyframe nearest each
    # sample time (cheaper, timestamps off by up to half a GOP); None: the worker's setting.
    video_sampling: Literal["exact", "keyframes"] | None = None


Part = Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]


def _source_of(raw: dict[str, Any], kind: str) -> Any:
    """The media source of a HF or OpenAI part, whichever key carries it."""
    for key in ("source", kind, f"{kind}_url", "url", "path"):
        value = raw.get(key)
        if isinstance(value, dict):  # OpenAI: {"image_url": {"url": ...}}
            value = value.get("url")
        if value:
            return value
    return None


def normalise_part(raw: Any) -> dict[str, Any]:
    """Map one HF or OpenAI content part onto the canonical part shape."""
    if isinstance(raw, str):
        return {"type": "text", "text": raw}
    if not isinstance(raw, dict):
        raise ValueError("a content part must be an object or a string")
    kind = raw.get("type")
    if kind in ("text", "input_text"):
        return {"type": "text", "text": raw.get("text")}
    if kind in ("image", "image_url", "input_image"):
        return {"type": "image", "source": _source_of(raw, "image")}
    if kind in ("video", "video_url", "input_video"):
        part: dict[str, Any] = {"type": "video", "source": _source_of(raw, "video")}
        for key in ("fps", "max_frames", "video_sampling"):
            if raw.get(key) is not None:
                part[key] = raw[key]
        return part
    raise ValueError(f"unknown content part type {str(kind)[:40]!r}")


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    role: Literal["system", "user", "assistant"]
    content: list[Part]

    @field_validator("content", mode="before")
    @classmethod
    def _normalise_content(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [{"type": "text", "text": value}]
        if isinstance(value, list):
            return [normalise_part(part) for part in value]
        raise ValueError("content must be a string or a list of parts")


# A request's content parts, at most (a turn whose content is a string is one part, an empty
# turn counts one). A part costs about 2 KB of Python objects wherever a request is parsed
# (the API, a worker) against a few bytes of JSON: a 30 MB body of a million one-word turns
# took an API process to 2.5 GB (docs/reliability.md). Counted before any turn is built.
MAX_PARTS = 4096


def _content_of(turn: Any) -> Any:
    return turn.get("content") if isinstance(turn, dict) else getattr(turn, "content", None)


def count_parts(turns: Any) -> int:
    """The content parts of a conversation as given (turns as dicts or models; anything else
    counts nothing: validation refuses it)."""
    if not isinstance(turns, list):
        return 0
    return sum(
        max(1, len(content)) if isinstance(content := _content_of(turn), list) else 1
        for turn in turns
    )


def bounded_conversation(turns: Any) -> Any:
    """Refuse a conversation of more than MAX_PARTS content parts before a model is built
    for any of its turns (a before-validator of ``messages``)."""
    if isinstance(turns, list) and (len(turns) > MAX_PARTS or count_parts(turns) > MAX_PARTS):
        raise ValueError(f"at most {MAX_PARTS} content parts in all (a turn counts one at least)")
    return turns


# One request's completions are rows of one padded batch: a bound keeps a request's share of a
# micro-batch sane (OpenAI allows 128; batch jobs rarely ask for more than a handful).
MAX_N = 16
MAX_TOP_LOGPROBS = 20
_CONSTRAINT_FIELDS = ("response_format", "regex", "choice", "grammar")


class GenerationParams(BaseModel):
    """Per-request generation settings; ``None`` means the worker's default.

    Sampling: ``temperature``, ``top_p``, ``seed``, ``n`` completions (completion i of a seeded
    request is reproducible whatever its batch-mates), penalties, ``min_tokens``; ``logprobs``
    and ``top_logprobs`` per generated token. Constraints, at most one: OpenAI
    ``response_format`` (``json_object``, ``json_schema``), ``regex``, ``choice``, ``grammar``
    (Lark); checked here without torch (config/constraints.py), so a bad one fails at submit
    naming its field.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_new_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=5)
    top_p: float | None = Field(None, gt=0, le=1)
    do_sample: bool | None = None
    stop: list[str] = Field(default_factory=list, max_length=8)
    seed: int | None = Field(None, ge=0, lt=2**63)
    n: int | None = Field(None, ge=1, le=MAX_N)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    min_tokens: int | None = Field(None, ge=0)
    response_format: dict[str, Any] | None = None
    regex: str | None = Field(None, min_length=1, max_length=MAX_GRAMMAR_CHARS)
    choice: list[Annotated[str, Field(max_length=MAX_CHOICE_CHARS)]] | None = Field(
        None, min_length=1, max_length=MAX_CHOICES
    )
    grammar: str | None = Field(None, min_length=1, max_length=MAX_GRAMMAR_CHARS)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else (value or [])

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value: list[str]) -> list[str]:
        if any(not s for s in value):
            raise ValueError("stop strings must not be empty")
        for stop in value:  # a stop is matched on the UTF-8 bytes a row decodes to
            try:
                stop.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(
                    "stop strings must be valid Unicode (no lone surrogates)"
                ) from None
        return value

    @field_validator("response_format")
    @classmethod
    def _response_format_shape(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        kind = value.get("type")
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError("type must be 'text', 'json_object' or 'json_schema'")
        if kind != "json_schema":
            return {"type": kind}
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError("json_schema must be an object with a 'schema' object")
        name = spec.get("name", "response")
        if not isinstance(name, str) or not 1 <= len(name) <= 64:
            raise ValueError("json_schema.name must be a string of 1-64 characters")
        if not isinstance(spec.get("strict", False), bool | None):
            raise ValueError("json_schema.strict must be a boolean")
        kept = {k: spec[k] for k in ("name", "description", "schema", "strict") if k in spec}
        return {"type": kind, "json_schema": kept}

    @model_validator(mode="after")
    def _consistent(self) -> GenerationParams:
        set_ = [name for name in _CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if self.response_format == {"type": "text"}:
            set_.remove("response_format")
        if len(set_) > 1:
            raise ValueError(f"at most one constraint per request; got {', '.join(set_)}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.min_tokens and self.max_new_tokens and self.min_tokens > self.max_new_tokens:
            raise ValueError("min_tokens is larger than max_new_tokens")
        try:
            constraint_of(self.response_format, self.regex, self.choice, self.grammar)
        except ConstraintError as exc:
            raise PydanticCustomError(
                "invalid_constraint",
                "{field}: {reason}",
                {"field": exc.field, "reason": exc.reason},
            ) from None
        return self

    @property
    def sampling(self) -> bool:
        """Sample when asked, or when a positive temperature implies it."""
        if self.do_sample is not None:
            return self.do_sample
        return bool(self.temperature)

    @property
    def constraint(self) -> Constraint | None:
        """The request's constraint with its grammar (checked when the request was made)."""
        return constraint_of(self.response_format, self.regex, self.choice, self.grammar)

    @property
    def completions(self) -> int:
        return self.n or 1

    @property
    def wants_choices(self) -> bool:
        """Results carry ``choices`` when more than one completion or logprobs are asked."""
        return self.completions > 1 or bool(self.logprobs)


GENERATION_FIELDS = tuple(GenerationParams.model_fields)


class Request(BaseModel):
    """One conversation to run; the unit of queueing, batching and results."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(default_factory=new_task_id, pattern=ID_PATTERN, max_length=ID_MAX_LENGTH)
    custom_id: str | None = Field(None, max_length=512)
    job_id: str | None = Field(None, pattern=ID_PATTERN, max_length=ID_MAX_LENGTH)
    messages: Annotated[list[Message], BeforeValidator(bounded_conversation)] = Field(min_length=1)
    generation: GenerationParams = Field(default_factory=GenerationParams)

    @model_validator(mode="before")
    @classmethod
    def _lift_generation_fields(cls, data: Any) -> Any:
        """Accept generation fields at the top level, as bulk JSONL lines do."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        generation = data.get("generation") or {}
        if not isinstance(generation, dict):
            raise ValueError("generation must be an object")
        generation = dict(generation)
        if "max_tokens" in data and "max_new_tokens" not in data:
            data["max_new_tokens"] = data.pop("max_tokens")
        for key in GENERATION_FIELDS:
            if key in data:
                generation[key] = data.pop(key)
        data["generation"] = generation
        return data

    @model_validator(mode="after")
    def _has_user_turn(self) -> Request:
        if not any(m.role == "user" for m in self.messages):
            raise ValueError("a conversation needs at least one user message")
        return self

    @property
    def modality(self) -> Modality:
        """``video`` if any video, else ``image`` if any image, else ``text``."""
        kinds = {part.type for message in self.messages for part in message.content}
        if "video" in kinds:
            return Modality.VIDEO
        if "image" in kinds:
            return Modality.IMAGE
        return Modality.TEXT

    def parts(self, kind: str) -> list[Any]:
        return [p for m in self.messages for p in m.content if p.type == kind]

    def media_sources(self) -> tuple[str, ...]:
        """The videos' then the images' sources: what a request is about, as a sort key
        (``()`` for text)."""
        return tuple(p.source for kind in ("video", "image") for p in self.parts(kind))

    def resolve_local_paths(self, base: Path) -> Request:
        """A copy whose relative local media paths are made absolute under ``base``.

        Workers accept only absolute local paths (a relative path means nothing
        on another machine); entry points that read a file resolve against it.
        """
        messages = [
            message.model_copy(update={"content": [_resolved(p, base) for p in message.content]})
            for message in self.messages
        ]
        return self.model_copy(update={"messages": messages})


def _resolved(part: Any, base: Path) -> Any:
    source = getattr(part, "source", None)
    if source is None or "://" in source or source.startswith(("data:", "/")):
        return part
    return part.model_copy(update={"source": str((base / source).resolve())})


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class Choice(BaseModel):
    """One completion of a request (OpenAI's ``choices[i]``, with vlmq's text field)."""

    index: int
    text: str
    finish_reason: FinishReason
    logprobs: dict[str, Any] | None = None
    parsed: Any = None


class Result(BaseModel):
    """Exactly one per request: an output, or an error with a stable code."""

    model_config = ConfigDict(extra="ignore")

    id: str
    custom_id: str | None = None
    job_id: str | None = None
    status: Literal["succeeded", "failed"]
    model: str | None = None
    modality: Modality | None = None
    output: str | None = None
    finish_reason: FinishReason | None = None
    usage: Usage = Field(default_factory=Usage)
    error: dict[str, Any] | None = None
    batch_id: str | None = None
    batch_size: int | None = None
    padding_ratio: float | None = None
    timings: dict[str, float] = Field(default_factory=dict)
    worker: str | None = None
    tenant: str | None = None  # who the task belongs to (the fleet sets it when it settles)
    # Its GPU time and cost (config/cost.py Pricing.charge), set by the fleet when it settles.
    cost: dict[str, Any] | None = None
    # With n > 1 or logprobs: every completion (choices[0] is ``output``).
    choices: list[Choice] | None = None
    # With a JSON constraint: ``output`` parsed (None when it did not finish, e.g. length).
    parsed: Any = None
