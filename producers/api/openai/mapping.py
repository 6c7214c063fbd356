"""vlmq result records as OpenAI answers: a chat completion, a Batch output line, a Batch
error line. Pure functions: the chat route, the tasks route, the Batch output files and
``vlmq results --format openai`` all answer through them."""

from __future__ import annotations

import time
from typing import Any

__all__ = ["to_chat_completion", "to_openai_error", "to_openai_output"]


def _openai_choices(record: dict[str, Any]) -> list[dict[str, Any]]:
    """OpenAI ``choices``: every completion when the record has them (n > 1 or logprobs),
    else the one ``output``."""
    completions = record.get("choices") or [
        {"index": 0, "text": record.get("output"), "finish_reason": record.get("finish_reason")}
    ]
    return [
        {
            "index": choice.get("index", index),
            "message": {"role": "assistant", "content": choice.get("text") or ""},
            "finish_reason": choice.get("finish_reason") or "stop",
            "logprobs": choice.get("logprobs"),
        }
        for index, choice in enumerate(completions)
    ]


def to_chat_completion(record: dict[str, Any]) -> dict[str, Any]:
    """A succeeded result record as an OpenAI chat completion body (``chat.completion``)."""
    usage = record.get("usage") or {}
    # Already summed over the choices by the worker.
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    created = int((record.get("timings") or {}).get("finished_at") or time.time())
    return {
        "id": f"chatcmpl-{record['id']}",
        "object": "chat.completion",
        "created": created,
        "model": record.get("model") or "vlmq",
        "choices": _openai_choices(record),
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }


def to_openai_output(record: dict[str, Any]) -> dict[str, Any]:
    """One line of an OpenAI Batch output file."""
    body = to_chat_completion(record)
    return {
        "id": f"batch_req_{record['id']}",
        "custom_id": record.get("custom_id"),
        "response": {"status_code": 200, "request_id": record["id"], "body": body},
        "error": None,
    }


def to_openai_error(record: dict[str, Any]) -> dict[str, Any]:
    """One line of an OpenAI Batch error file (failed tasks and invalid lines)."""
    error = record.get("error") or {"code": "internal_error", "message": "internal error"}
    task_id = record.get("id") or f"line-{record.get('line')}"
    return {
        "id": f"batch_req_{task_id}",
        "custom_id": record.get("custom_id"),
        "response": None,
        "error": {
            "code": error.get("code"),
            "message": error.get("message"),
            **({"line": record["line"]} if record.get("line") else {}),
        },
    }
