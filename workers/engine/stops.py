"""Stop strings: where a row's text reaches one, and which tokens can make it do so.

One rule for both decode paths: after ``g`` generated tokens (``g`` past the row's
``min_tokens``), a row stops when one of its stop strings appears in the decoded text of its last
few tokens (``window``: the longest stop's length plus 4 tokens). transformers' generate asks it
after every token (``RowStopper``); the decode loop asks it only on the steps that can change the
answer: a stop string that appears after token ``g`` ends in the bytes of token ``g``, so only a
token holding the last byte of one of the row's stop strings (``StopTable.ends``) or the first
step past ``min_tokens`` makes the loop look, every few steps, on the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache

import numpy as np

__all__ = ["StopTable", "first_stop", "stop_window"]

Decode = Callable[[list[int]], str]


def stop_window(stops: Sequence[str]) -> int:
    """Tokens of tail text to decode: a stop string spans at most len(s) tokens; a little more."""
    return max((len(s) for s in stops), default=0) + 4


def first_stop(
    decode: Decode,
    ids: Sequence[int],
    stops: Sequence[str],
    min_tokens: int,
    start: int,
    end: int,
) -> int | None:
    """The first count of generated tokens g in (start, end] (g > min_tokens) at which a stop
    string appears in the decoded tail of ``ids[:g]``; None if none does."""
    if not stops:
        return None
    window = stop_window(stops)
    for g in range(max(start, min_tokens) + 1, end + 1):
        size = min(window, g)
        tail = decode(list(ids[g - size : g])) if size else ""
        if any(stop in tail for stop in stops):
            return g
    return None


class StopTable:
    """Per model: for a set of stop strings, the tokens whose bytes hold the last byte of one of
    them (a vocabulary-wide boolean mask). Built from each token's exact bytes once; a mask per
    last byte is kept (at most 256)."""

    def __init__(self, token_bytes: Callable[[int], bytes], vocab_size: int) -> None:
        self._token_bytes = token_bytes
        self.vocab_size = vocab_size
        self._tokens: list[bytes] | None = None
        self._by_byte = lru_cache(maxsize=256)(self._holding)

    def ends(self, stops: Sequence[str]) -> np.ndarray:
        """vocab_size booleans: True where a token may complete one of ``stops``."""
        mask = np.zeros(self.vocab_size, dtype=bool)
        for last in {stop.encode("utf-8")[-1] for stop in stops if stop}:
            mask |= self._by_byte(last)
        return mask

    def _holding(self, byte: int) -> np.ndarray:
        if self._tokens is None:
            self._tokens = [self._token_bytes(i) for i in range(self.vocab_size)]
        return np.fromiter((byte in t for t in self._tokens), dtype=bool, count=self.vocab_size)
