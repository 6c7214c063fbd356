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
        texts = [text] if isinstance(text, str) else text
        if not self._handles(texts, args, kwargs):
            return self._inner(text, *args, **kwargs)
        encoded = []
        for sample in texts:
            ids = self._encode(sample, kwargs.get("add_special_tokens", True))
            if ids is None:
                return self._inner(text, *args, **kwargs)
            encoded.append(ids)
        self._served += 1
        masks = [[1] * len(ids) for ids in encoded]
        single = not isinstance(text, list)
        features = {
            "input_ids": encoded[0] if single else encoded,
            "attention_mask": masks[0] if single else masks,
        }
        return self._inner.pad(
            features,
            padding=kwargs.get("padding", False),
            padding_side=kwargs.get("padding_side"),
            return_tensors=kwargs.get("return_tensors"),
        )

    def _handles(self, texts: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        if self._runs is None or args or not isinstance(texts, list) or not texts:
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

    def _encode(self, text: str, add_special_tokens: bool) -> list[int] | None:
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
        out: list[int] = []
        start = 0
        for index, (token_id, length) in zip(found, runs, strict=True):
            out += ids[start:index]
            out += [token_id] * length
            start = index + 1
        out += ids[start:]
        return out


def unwrapped(tokenizer: Any) -> Any:
    """The tokenizer itself, whether or not a processor's is a ``RunLengthTokenizer``."""
    return tokenizer.wrapped if isinstance(tokenizer, RunLengthTokenizer) else tokenizer
