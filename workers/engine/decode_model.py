"""A loaded VLM as the decode loop runs it: a prefill, then decode steps of its language model
and output head, one new token per row, each at its own position, against the slot cache.

Prefill (the vision encoder and the prompt) runs through the model's own ``generate`` for one
token, so positions, DeepStack features and padding are exactly what transformers does (and its
raw logits choose the first token); from then on every step is ``logits``. Rotary positions:
Qwen2.5-VL and Qwen3-VL take 3-D M-RoPE positions (a row's next text position plus the M-RoPE
offset its images and videos left), which for a new text token are the same number on each
axis; InternVL's language model takes 1-D positions. The mask is 4-D (rows x 1 x 1 x length,
True where a row's own tokens are), which transformers' mask helpers pass through as given.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from vlmq.workers.engine.slots import SlotView

__all__ = ["MROPE_FAMILIES", "DecodeModel", "Prefilled"]

MROPE_FAMILIES = ("qwen2_5_vl", "qwen3_vl")


def _cache_argument(forward: Any) -> str:
    """transformers 5.24 names the cache ``cache`` (``past_key_values`` deprecated); 5.17, the
    GPU machine's, only ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


@dataclass
class Prefilled:
    """A micro-batch after its prompt went through the model."""

    logits: torch.Tensor  # rows x vocab, float32: the first token's raw logits
    layers: list[
        tuple[torch.Tensor, torch.Tensor]
    ]  # per layer: keys, values (rows x heads x L x d)
    positions: torch.Tensor  # rows: the rotary position of each row's first new token


class DecodeModel:
    def __init__(self, model: Any, family: str, pad_id: int, eos_ids: list[int]) -> None:
        self.model = model
        self.pad_id = pad_id
        self.eos_ids = eos_ids
        self.language_model = model.model.language_model
        self.head = model.get_output_embeddings()
        self.mrope = family in MROPE_FAMILIES
        self.cache_argument = _cache_argument(self.language_model.forward)
        self.vocab = int(self.head.weight.shape[0])
        self.step = self._step

    def prefill(self, inputs: dict[str, Any]) -> Prefilled:
        """The prompt (and its images and videos) through ``generate`` for one token: its cache
        and the raw logits of the first new token. Checkpoint defaults (sampling, penalties) are
        switched off: the loop's controls choose every token."""
        output = self.model.generate(
            **inputs,
            max_new_tokens=1,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            repetition_penalty=None,
            return_dict_in_generate=True,
            output_logits=True,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_ids,
        )
        cache = output.get("cache") or output.get("past_key_values")
        layers = [(layer.keys, layer.values) for layer in cache.layers]
        positions = inputs["attention_mask"].sum(dim=1)
        deltas = getattr(self.model.model, "rope_deltas", None) if self.mrope else None
        if deltas is not None:
            # M-RoPE: the next text position plus the offset the row's images and videos left.
            positions = positions + deltas.view(-1).to(positions.device)
        return Prefilled(output.logits[0].float(), layers, positions)

    def logits(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        cache: SlotView,
    ) -> torch.Tensor:
        """Rows x vocab float32 logits of one step: ``tokens`` (rows,) at ``positions`` (rows,),
        attending where ``mask`` (rows x length, bool) is True."""
        rows = tokens.shape[0]
        if self.mrope:
            position_ids = positions.view(1, rows, 1).expand(3, rows, 1)
        else:
            position_ids = positions.view(rows, 1)
        with self._sdpa():
            return self.step(
                tokens.view(rows, 1), position_ids, mask.view(rows, 1, 1, mask.shape[1]), cache
            )

    def _step(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor,
        cache: SlotView,
    ) -> torch.Tensor:
        hidden = self.language_model(
            input_ids=tokens,
            position_ids=position_ids,
            attention_mask=mask,
            use_cache=True,
            **{self.cache_argument: cache},
        ).last_hidden_state
        return self.head(hidden[:, -1]).float()

    def compile(self) -> None:
        """The decode step through torch.compile (dynamic shapes: one compile for every
        bucket); prefill stays eager."""
        self.step = torch.compile(self._step, dynamic=True, mode="max-autotune-no-cudagraphs")

    @contextmanager
    def _sdpa(self) -> Iterator[None]:
        """A decode step attends with SDPA whatever the prefill uses: flash-attention 2 takes
        no 4-D mask (its own per-row cache lengths would need its kv-cache kernel)."""
        config = self.language_model.config
        chosen = getattr(config, "_attn_implementation", None)
        if chosen in (None, "sdpa", "eager"):
            yield
            return
        config._attn_implementation = "sdpa"
        try:
            yield
        finally:
            config._attn_implementation = chosen
