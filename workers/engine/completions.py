"""A request's completions as result fields, the same for every engine (torch-free).

``Generated`` is one completion; ``result_choices`` gives the result fields beyond ``output``:
``choices`` (with n > 1 or logprobs) and ``parsed`` (with a JSON constraint).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vlmq.config.schemas import Choice, FinishReason, Request

__all__ = ["Generated", "completion_seed", "logprob_entry", "parsed_json", "result_choices"]


@dataclass
class Generated:
    """One completion (one row, or a greedy row's copy)."""

    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    logprobs: dict[str, Any] | None = None


def parsed_json(text: str, finish_reason: FinishReason) -> Any:
    """A JSON-constrained completion that finished is JSON by construction; one cut at its
    token limit may not be (None)."""
    if finish_reason != FinishReason.STOP:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def result_choices(request: Request, choices: Sequence[Generated]) -> dict[str, Any]:
    """The result fields about completions beyond ``output``."""
    params = request.generation
    constraint = params.constraint
    as_json = constraint is not None and constraint.json
    fields: dict[str, Any] = {}
    if as_json:
        fields["parsed"] = parsed_json(choices[0].text, choices[0].finish_reason)
    if params.wants_choices:
        fields["choices"] = [
            Choice(
                index=i,
                text=choice.text,
                finish_reason=choice.finish_reason,
                logprobs=choice.logprobs,
                parsed=parsed_json(choice.text, choice.finish_reason) if as_json else None,
            )
            for i, choice in enumerate(choices)
        ]
    return fields


def completion_seed(seed: int, index: int) -> int:
    """The seed of completion ``index`` of a request seeded ``seed``: the first keeps the
    request's seed (n=1 is unchanged), the others get their own stream, so completion i is
    reproducible whatever else runs beside it."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def logprob_entry(
    token_bytes: Callable[[int], bytes], token_id: int, logprob: float
) -> dict[str, Any]:
    """One token of OpenAI's ``logprobs.content``: its text, logprob and exact bytes. A
    byte-level token can be part of one UTF-8 character: ``bytes`` is exact, ``token`` shows
    what decodes."""
    raw = token_bytes(int(token_id))
    return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}
