"""One mixed batch of constrained, multi-completion, logprob and plain requests, and the checks
its results must pass: shared by the engine tests, ``vlmq run``, the fleet and the OpenAI batch
API tests (issue 13).

Random weights make unconstrained output gibberish, so a constrained row that parses and
validates is a strong test. Checks need ``jsonschema`` (a dev dependency).
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["CHOICES", "DATE", "SCHEMA", "check_record", "mixed_lines", "openai_line"]

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "category": {"enum": ["shoe", "shirt", "hat"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "size": {
            "type": "object",
            "properties": {"w": {"type": "integer", "minimum": 0, "maximum": 999}},
            "required": ["w"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "category", "tags", "size"],
    "additionalProperties": False,
}
# ASCII digits: llguidance's \d, like Python's, is any Unicode digit.
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
CHOICES = ["yes", "no", "not sure"]
# A random model closes a JSON string by chance (a token starting with a quote): sampled with
# this seed and room, it ends on all three tiny checkpoints (in 127, 3 and 18 tokens: the first
# of seeds 0-39 that ends on all three, measured with the sampler of sampling.py).
JSON_OBJECT = {"temperature": 1.0, "seed": 25, "max_new_tokens": 1000}


def _messages(text: str, image: str | None) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    if image:
        content.insert(0, {"type": "image", "image": image})
    return [{"role": "user", "content": content}]


def mixed_lines(image: str) -> list[dict[str, Any]]:
    """vlmq JSONL lines; ``custom_id`` says what each asks (``check_record`` dispatches on it).
    ``image`` is a path or URL the workers can read."""
    schema_format = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}
    rows: list[tuple[str, str, str | None, dict[str, Any]]] = [
        (
            "schema",
            "Describe the item.",
            image,
            {"response_format": schema_format, "max_new_tokens": 200},
        ),
        (
            "json_object",
            "Any JSON.",
            None,
            {"response_format": {"type": "json_object"}, **JSON_OBJECT},
        ),
        ("regex", "When?", None, {"regex": DATE}),
        ("choice", "Is it a cat?", image, {"choice": CHOICES}),
        ("n3", "Three ideas.", None, {"n": 3, "temperature": 0.8, "seed": 7}),
        (
            "logprobs",
            "Explain queues.",
            None,
            {"logprobs": True, "top_logprobs": 3, "max_new_tokens": 8},
        ),
        ("plain_text", "Tell me about batches and padding.", None, {"max_new_tokens": 12}),
        ("plain_image", "What is in the picture?", image, {"max_new_tokens": 12}),
    ]
    return [
        {"custom_id": key, "messages": _messages(text, img), **fields}
        for key, text, img, fields in rows
    ]


_OPENAI_NAMES = {"max_new_tokens": "max_tokens"}


def openai_line(line: dict[str, Any], model: str = "vlmq") -> dict[str, Any]:
    """The same request as an OpenAI Batch line (image parts as ``image_url``)."""
    messages = []
    for message in line["messages"]:
        content = [
            {"type": "image_url", "image_url": {"url": part["image"]}}
            if part["type"] == "image"
            else part
            for part in message["content"]
        ]
        messages.append({"role": message["role"], "content": content})
    body = {"model": model, "messages": messages}
    for key, value in line.items():
        if key not in ("custom_id", "messages"):
            body[_OPENAI_NAMES.get(key, key)] = value
    return {
        "custom_id": line["custom_id"],
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": body,
    }


def _texts(record: dict[str, Any]) -> list[str]:
    """The completions of a vlmq result record or of an OpenAI chat completion body."""
    if "object" in record:  # chat.completion
        return [choice["message"]["content"] for choice in record["choices"]]
    return [c["text"] for c in record.get("choices") or []] or [record["output"]]


def _finish(record: dict[str, Any]) -> str:
    if "object" in record:
        return str(record["choices"][0]["finish_reason"])
    return str(record["finish_reason"])


def _logprobs(record: dict[str, Any]) -> dict[str, Any] | None:
    choices = record.get("choices") or []
    return choices[0].get("logprobs") if choices else None


def check_record(custom_id: str, record: dict[str, Any]) -> None:
    """Assert that one result (a vlmq record, or an OpenAI chat completion body) honours what
    line ``custom_id`` of ``mixed_lines`` asked."""
    import jsonschema

    texts = _texts(record)
    if custom_id == "schema":
        assert _finish(record) == "stop", texts[0][:200]
        value = json.loads(texts[0])
        jsonschema.validate(value, SCHEMA)
        # Properties come in the schema's order (generation follows it, as OpenAI's does).
        assert list(value) == [k for k in SCHEMA["properties"] if k in value], list(value)
        if "object" not in record:
            assert record["parsed"] == json.loads(texts[0])
    elif custom_id == "json_object":
        assert _finish(record) == "stop", texts[0][:200]
        assert isinstance(json.loads(texts[0]), dict)
    elif custom_id == "regex":
        assert re.fullmatch(DATE, texts[0]), texts[0]
    elif custom_id == "choice":
        assert texts[0] in CHOICES, texts[0]
    elif custom_id == "n3":
        assert len(texts) == 3 and len(set(texts)) > 1, texts
    elif custom_id == "logprobs":
        logprobs = _logprobs(record)
        assert logprobs is not None and len(logprobs["content"]) >= 1
        for entry in logprobs["content"]:
            assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 3
    else:
        assert custom_id.startswith("plain"), custom_id
        assert len(texts) == 1
