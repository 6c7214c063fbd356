"""A processor's checks over the placeholder runs in a batch, in NumPy.

After tokenizing, a transformers processor counts each modality's placeholders twice over
(``_check_special_mm_tokens``: the ids as Python lists, the text with a regular expression)
and writes every token's modality type (``create_mm_token_type_ids``: a Python list per
row, which ``BatchFeature`` then turns back into a tensor). With a 1080p photo's ~2,700
placeholders that is ~1.4 ms of a GPU worker's CPU per photo, more than the run-length
tokenizing it follows (bench/README.md, the prepare tier). On a padded batch (a 2-D array,
which is what vlmq's collation asks for) the same counts and types are a few array
operations; anything else goes to the library's own method.

Each stand-in is installed only where it gives the library's answer: the text count
reproduces the library's pattern (a placeholder not preceded by the control-token marker),
and the type ids are compared with the library's on a probe of every placeholder id when
the processor is loaded. A count that does not match goes to the library's check, so its
error is the library's own.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["count_placeholders_in_numpy"]

_MODALITIES = ("image", "video", "audio")


def count_placeholders_in_numpy(processor: Any) -> None:
    """Replace the processor's placeholder checks with their NumPy form where they agree."""
    counts = _Counts(processor)
    if counts.marker is not None and callable(
        getattr(type(processor), "_check_special_mm_tokens", None)
    ):
        processor._check_special_mm_tokens = counts.check
    if (
        callable(getattr(type(processor), "create_mm_token_type_ids", None))
        and counts.types_agree()
    ):
        processor.create_mm_token_type_ids = counts.types


class _Counts:
    def __init__(self, processor: Any) -> None:
        self._processor = processor
        self._library_check = processor._check_special_mm_tokens
        self._library_types = getattr(processor, "create_mm_token_type_ids", None)
        self.marker = _library_marker()
        self.served = 0  # batches these answered (tests read it)

    def check(self, text: Any, text_inputs: Any, modalities: list[str]) -> None:
        ids = text_inputs["input_ids"]
        if getattr(ids, "ndim", 0) != 2 or not isinstance(text, list) or len(text) != len(ids):
            return self._library_check(text, text_inputs, modalities)
        rows = np.asarray(ids)
        for modality in modalities:
            token = getattr(self._processor, f"{modality}_token", None)
            token_id = getattr(self._processor, f"{modality}_token_id", None)
            if token is None or token_id is None:
                continue
            in_ids = (rows == token_id).sum(axis=1).tolist()
            if in_ids != [self._in_text(sample, token) for sample in text]:
                return self._library_check(text, text_inputs, modalities)
        self.served += 1
        return None

    def _in_text(self, sample: str, token: str) -> int:
        # The library's pattern, "(?<!marker)token", found without a regular expression: a
        # placeholder cannot overlap itself, so occurrences less the marked ones.
        found = sample.count(token)
        return found - sample.count(f"{self.marker}{token}") if found and self.marker else found

    def types(self, input_ids: Any) -> Any:
        if getattr(input_ids, "ndim", 0) != 2:
            return self._library_types(input_ids)  # type: ignore[misc]
        rows = np.asarray(input_ids)
        types = np.zeros_like(rows)
        for code, modality in enumerate(_MODALITIES, start=1):
            wanted = [
                i for i in getattr(self._processor, f"{modality}_token_ids", []) if i is not None
            ]
            if wanted:
                types[np.isin(rows, wanted)] = code
        return types

    def types_agree(self) -> bool:
        """Whether ``types`` gives the library's answer on every placeholder id and a text id."""
        if self._library_types is None:
            return False
        ids = [0]
        for modality in _MODALITIES:
            ids += [
                i
                for i in getattr(self._processor, f"{modality}_token_ids", []) or []
                if i is not None
            ]
        probe = np.array([ids, ids[::-1]], dtype=np.int64)
        try:
            expected = np.asarray(self._library_types(probe.tolist()))
        except Exception:  # a library method that this probe breaks: it stays as it is
            return False
        return expected.shape == probe.shape and bool((expected == self.types(probe)).all())


def _library_marker() -> str | None:
    """The control-token marker in the library's placeholder pattern; None when the pattern
    is not the one ``check`` reproduces (then the library's check stays)."""
    from transformers import processing_utils

    marker = getattr(processing_utils, "_CONTROL_TOKEN_START", None)
    pattern = getattr(processing_utils, "_UNMARKED", None)
    if isinstance(marker, str) and marker and pattern == f"(?<!{marker})":
        return marker
    return None
