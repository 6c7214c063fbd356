"""Log-probabilities of the generated tokens, per row, in OpenAI's chat shape.

``LogprobRecorder`` is the first logits processor of a step, so it sees the model's raw
logits (before penalties, constraints and temperature; what vLLM calls raw logprobs): it
keeps the log-softmax of the rows that asked, and once the step's token is known (the next
call, or ``finish`` after the last step) takes that token's log-probability and the top
``k``. Values stay on the device until ``finish``: one copy per row at the end, not per step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import LogitsProcessor

from vlmq.workers.engine.completions import logprob_entry

__all__ = ["LogprobRecorder", "openai_logprobs"]


class LogprobRecorder(LogitsProcessor):
    def __init__(self, top: Sequence[int | None]) -> None:
        # top[row]: None for a row without logprobs, else how many alternatives it wants.
        self.rows = [row for row, k in enumerate(top) if k is not None]
        self.k = max((k or 0 for k in top if k is not None), default=0)
        self.top = [top[row] or 0 for row in self.rows]
        self._pending: torch.Tensor | None = None
        self._chosen: list[torch.Tensor] = []
        self._top_values: list[torch.Tensor] = []
        self._top_ids: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if not self.rows:
            return scores
        if self._pending is not None:
            self._resolve(input_ids[:, -1])
        picked = scores.index_select(0, torch.tensor(self.rows, device=scores.device))
        self._pending = torch.log_softmax(picked.float(), dim=-1)
        return scores

    def _resolve(self, tokens: torch.Tensor) -> None:
        assert self._pending is not None
        chosen = tokens.index_select(0, torch.tensor(self.rows, device=tokens.device))
        self._chosen.append(self._pending.gather(1, chosen.unsqueeze(1)).squeeze(1))
        if self.k:
            values, ids = torch.topk(self._pending, self.k, dim=-1)
            self._top_values.append(values)
            self._top_ids.append(ids)
        self._pending = None

    def finish(self, generated: torch.Tensor) -> dict[int, list[dict[str, Any]]]:
        """Per row that asked: one entry per generated position, {logprob, top: [(id, lp)]}.
        ``generated`` is the output's generated part (rows x steps)."""
        if not self.rows:
            return {}
        if self._pending is not None:
            self._resolve(generated[:, len(self._chosen)])
        chosen = torch.stack(self._chosen, dim=1).tolist() if self._chosen else []
        values = torch.stack(self._top_values, dim=1).tolist() if self._top_values else []
        ids = torch.stack(self._top_ids, dim=1).tolist() if self._top_ids else []
        out: dict[int, list[dict[str, Any]]] = {}
        for j, row in enumerate(self.rows):
            k = self.top[j]
            out[row] = [
                {
                    "logprob": chosen[j][step],
                    "top": list(zip(ids[j][step][:k], values[j][step][:k], strict=True))
                    if k
                    else [],
                }
                for step in range(len(chosen[j]) if chosen else 0)
            ]
        return out


def openai_logprobs(
    token_bytes: Callable[[int], bytes],
    token_ids: Sequence[int],
    steps: Sequence[dict[str, Any]],
) -> dict[str, Any]:
    """OpenAI's ``choices[i].logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``
    for the row's own tokens (its trimmed length)."""
    content = []
    for token_id, step in zip(token_ids, steps, strict=False):
        entry = logprob_entry(token_bytes, token_id, step["logprob"])
        entry["top_logprobs"] = [logprob_entry(token_bytes, i, lp) for i, lp in step["top"]]
        content.append(entry)
    return {"content": content}
