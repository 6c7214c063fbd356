"""The OpenAI File, Batch, chat completion and model objects, shaped so the official client
parses them.

Field names, types and literals follow ``openai.types.FileObject``, ``openai.types.Batch``,
``openai.types.chat.ChatCompletion`` (and ``ChatCompletionChunk``) and ``openai.types.Model``;
they also document the routes in /openapi.json.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from vlmq.config.schemas import MAX_PARTS, bounded_conversation

__all__ = [
    "BatchCreate",
    "BatchError",
    "BatchErrors",
    "BatchList",
    "BatchObject",
    "BatchStatus",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionCreate",
    "ChatMessage",
    "Conversation",
    "FileList",
    "FileObject",
    "Model",
    "ModelList",
    "RequestCounts",
]

BatchStatus = Literal[
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
]


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class BatchCreate(BaseModel):
    # Newer clients send fields we do not use (output_expires_after): ignore them.
    model_config = ConfigDict(extra="ignore")

    input_file_id: str = Field(min_length=1, max_length=200)
    endpoint: Literal["/v1/chat/completions"]
    completion_window: str = Field("24h", pattern=r"^[1-9][0-9]{0,3}h$", description="Hours")
    metadata: dict[str, str] | None = Field(None, description="Up to 16 string pairs")


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchError(BaseModel):
    code: str | None = None
    message: str | None = None
    line: int | None = None
    param: str | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatus
    created_at: int
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: BatchErrors | None = None
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts
    metadata: dict[str, str] | None = None
    # vlmq's own: the validation pass's estimate (lines, modality mix, prompt tokens with the
    # visual ones, output tokens); clients that do not know it ignore it.
    preflight: dict[str, Any] | None = None
    # vlmq's own: a file of the lines finished so far, read as a snapshot each time (from
    # in_progress on; openai/partial_output.py); clients that do not know it ignore it.
    vlmq_partial_output_file_id: str | None = None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatCompletionMessage
    finish_reason: Literal["stop", "length"]
    logprobs: ChoiceLogprobs | None = None


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(BaseModel):
    """A task's result as OpenAI chat completion (``GET /v1/tasks/{id}/result?format=openai``;
    built by ``mapping.to_chat_completion``, as batch output lines are)."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: CompletionUsage


class ChatMessage(BaseModel):
    """One turn; content parts are Hugging Face or OpenAI chat parts."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant"]
    content: str | list[dict[str, Any]]


# The turns of a body, counted before any is built (config/schemas.py MAX_PARTS).
Conversation = Annotated[list[ChatMessage], BeforeValidator(bounded_conversation)]
_PARTS = f"At most {MAX_PARTS} content parts in all (a turn counts one at least)"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool | None = Field(None, description="A last chunk with the usage")


class ChatCompletionCreate(BaseModel):
    """``POST /v1/chat/completions``: OpenAI's body. Its sampling fields, ``response_format``
    (``json_schema`` and ``json_object`` included) and vLLM's extensions
    (``repetition_penalty``, ``min_tokens``, ``structured_outputs``, ``guided_*``) map onto a
    vlmq request as in a Batch API line; fields vlmq does not implement (``tools``,
    ``logit_bias``, ``user``, ...) are ignored, as an OpenAI-compatible server does."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(description="Recorded; the fleet's workers decide (GET /v1/models)")
    messages: Conversation = Field(min_length=1, description=_PARTS)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    response_format: dict[str, Any] | None = Field(
        None, description="{type: text | json_object | json_schema, json_schema}"
    )
    stream: bool | None = Field(None, description="Server-Sent Events (the whole text at once)")
    stream_options: StreamOptions | None = None


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: ChunkDelta
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    """One event of a ``stream: true`` answer (``data: <chunk>``, then ``data: [DONE]``)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: CompletionUsage | None = None


class Model(BaseModel):
    """A model the fleet serves: one or more live workers announce it in their heartbeat."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(description="The oldest current heartbeat of its workers (Unix s)")
    owned_by: str = "vlmq"
    # vlmq's own: the modality classes its workers take, and how many workers serve it.
    modalities: list[str] = Field(default_factory=list)
    workers: int = 0


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]
