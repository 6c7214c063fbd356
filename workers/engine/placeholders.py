"""Tokenize a processor's prompt with its media placeholders run-length encoded.

A VLM processor writes each image or video into the prompt as its placeholder token repeated
once per visual token (a 1080p photo: ~2,700 ``<|image_pad|>``; 16 frames of a 720p clip:
~5,800) and tokenizes that text: ~2.5 ms of a GPU worker's CPU per photo and ~6 ms per clip,
where the rest of the prompt takes 0.1 ms (bench/README.md, the prepare tier). A placeholder
is a special token the tokenizer splits out before anything else, so a run of it tokenizes as
that many copies of its id whatever surrounds it: each run is tokenized as one and expanded
in the ids, then the batch is padded as the tokenizer would have. The ids are checked: a
result whose placeholder count does not match the runs found (a tokenizer that does not
split the token) is thrown away and the text tokenized as it is, so the output is always the
tokenizer's own (tested per family against the plain call).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

__all__ = ["RunLengthTokenizer", "unwrapped"]

# Tokenizer arguments whose values the run-length path reproduces; any other argument (or a
# value other than these) goes to the tokenizer as it is.
_HANDLED: dict[str, tuple[Any, ...]] = {
    "padding": (True, False, "longest", "do_not_pad"),
    "padding_side": ("left", "right", None),
    "return_tensors": ("pt", "np", None),
    "add_special_tokens": (True, False),
    "return_attention_mask": (True, None),
    "truncation": (False, None),
    "max_length": (None,),
    "pad_to_multiple_of": (None,),
    "return_token_type_ids": (False, None),
    "verbose": (True, False),
}


class RunLengthTokenizer:
    """Stands in for a processor's tokenizer: ``__call__`` on texts with placeholder runs
    is run-length encoded; everything else (and every attribute) is the tokenizer's."""

    def __init__(self, inner: Any, placeholders: list[str]) -> None:
        self._inner = inner
        self._ids = {token: int(inner.convert_tokens_to_ids(token)) for token in placeholders}
        alternatives = "|".join(re.escape(token) for token in placeholders)
        self._runs = re.compile(f"((?:{alternatives}))\\1*") if placeholders else None
        self._doubled = [token * 2 for token in placeholders]
        self._served = 0  # calls the run-length path answered (tests read it)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:  # a setting the processor changes (padding_side...) is the tokenizer's
            setattr(self._inner, name, value)

    def __len__(self) -> int:
        return len(self._inner)

    @property
    def wrapped(self) -> Any:
        return self._inner

    @property
    def served(self) -> int:
        """How many calls the run-length path answered (the rest went to the tokenizer)."""
        return self._served

    def __call__(self, text: Any = None, *args: Any, **kwargs: Any) -> Any:
        # Processors pass a batch (a list); one text alone is the tokenizer's (it adds the
        # batch axis to tensors of one text, which ``pad`` does not).
        if not isinstance(text, list) or not self._handles(text, args, kwargs):
            return self._inner(text, *args, **kwargs)
        encoded = []
        for sample in text:
            ids = self._encode(sample, kwargs.get("add_special_tokens", True))
            if ids is None:
                return self._inner(text, *args, **kwargs)
            encoded.append(ids)
        self._served += 1
        padding, tensors = kwargs.get("padding", False), kwargs.get("return_tensors")
        side = kwargs.get("padding_side") or self._inner.padding_side
        pad_id = self._inner.pad_token_id
        to_longest = padding in (True, "longest") and side in ("left", "right")
        if to_longest and tensors in ("pt", "np") and pad_id is not None:
            return _padded(encoded, int(pad_id), side, tensors)
        rows = [ids.tolist() for ids in encoded]
        features = {"input_ids": rows, "attention_mask": [[1] * len(row) for row in rows]}
        return self._inner.pad(
            features,
            padding=padding,
            padding_side=kwargs.get("padding_side"),
            return_tensors=tensors,
        )

    def _handles(self, texts: list[Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        if self._runs is None or args or not texts:
            return False
        if not all(isinstance(sample, str) for sample in texts):
            return False
        if not any(doubled in sample for sample in texts for doubled in self._doubled):
            return False  # no run to shorten: the plain call is as fast
        for name, value in kwargs.items():
            allowed = _HANDLED.get(name)
            if allowed is None or not any(value is a or value == a for a in allowed):
                return False
        return True

    def _encode(self, text: str, add_special_tokens: bool) -> np.ndarray | None:
        """The ids of ``text`` with every placeholder run tokenized once and expanded; None
        when the tokenizer did not keep each run's placeholder as one id."""
        assert self._runs is not None
        runs: list[tuple[int, int]] = []  # (placeholder id, run length), in order

        def one(match: re.Match[str]) -> str:
            token = match.group(1)
            runs.append((self._ids[token], len(match.group(0)) // len(token)))
            return token

        short = self._runs.sub(one, text)
        ids = self._inner(short, add_special_tokens=add_special_tokens)["input_ids"]
        placeholder_ids = {run_id for run_id, _ in runs}
        found = [i for i, token_id in enumerate(ids) if token_id in placeholder_ids]
        if len(found) != len(runs):
            return None
        if any(ids[i] != token_id for i, (token_id, _) in zip(found, runs, strict=True)):
            return None
        pieces: list[Any] = []
        start = 0
        for index, (token_id, length) in zip(found, runs, strict=True):
            pieces += [ids[start:index], np.full(length, token_id, dtype=np.int64)]
            start = index + 1
        pieces.append(ids[start:])
        return np.concatenate([np.asarray(piece, dtype=np.int64) for piece in pieces])


def _padded(encoded: list[np.ndarray], pad_id: int, side: str, tensors: str) -> Any:
    """The batch padded to its longest row as the tokenizer pads (``pad_id``, mask 0 on
    the padding side), built in NumPy: from Python lists, ``torch.tensor`` costs ~7 ms per
    16 photos' ids and as much again for their mask."""
    width = max(len(ids) for ids in encoded)
    ids = np.full((len(encoded), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(encoded), width), dtype=np.int64)
    for row, sample in enumerate(encoded):
        span = slice(width - len(sample), width) if side == "left" else slice(0, len(sample))
        ids[row, span] = sample
        mask[row, span] = 1
    # Imported here: model.py imports this module, and a prepare worker, which imports the
    # fleet (and through it model.py) but never tokenizes, runs without torch.
    import torch
    from transformers import BatchEncoding

    if tensors == "pt":
        return BatchEncoding(
            {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)}
        )
    return BatchEncoding({"input_ids": ids, "attention_mask": mask})


def unwrapped(tokenizer: Any) -> Any:
    """The tokenizer itself, whether or not a processor's is a ``RunLengthTokenizer``."""
    return tokenizer.wrapped if isinstance(tokenizer, RunLengthTokenizer) else tokenizer
