"""The model's processor, once per thread that prepares or collates, with per-media caching.

A Hugging Face processor is not safe to share between threads (its tokenizer switches padding
and truncation on and off around every call), so each collating thread loads its own, once
(``ProcessorSet.for_thread``). Each of them has its image and video processors wrapped so
that every image or video is processed on its own and its output kept in the worker's media
cache, keyed by a hash of its pixels and the processor call's settings: a clip asked four
questions runs through the video processor once. The outputs of these processors are
per-item tensors concatenated along the first dimension (checked for all three families in
the tests: per-item processing gives the same tensors as one call over the list).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

from PIL import Image

from vlmq.workers.engine.mmcounts import count_placeholders_in_numpy
from vlmq.workers.engine.placeholders import RunLengthTokenizer
from vlmq.workers.media.cache import MediaCache
from vlmq.workers.media.prepared.pixels import KEY_ATTRIBUTE

__all__ = ["ProcessorSet", "tensor_bytes"]


def tensor_bytes(value: Any) -> int:
    """Bytes held by the tensors in a processor output."""
    total = 0
    for item in value.values():
        if hasattr(item, "element_size") and hasattr(item, "nelement"):
            total += int(item.element_size() * item.nelement())
    return total


def _is_video(item: Any) -> bool:
    """One video: a list of frames, or a 4-D array of them."""
    if isinstance(item, list | tuple):
        return bool(item) and not isinstance(item[0], list | tuple)
    return getattr(item, "ndim", 0) == 4


def _flatten(media: Any, videos: bool) -> list[Any] | None:
    """The items of a (possibly per-sample nested) media argument, in the order the
    processor flattens them; None for a shape this wrapper does not know."""
    if not isinstance(media, list | tuple):
        return None
    items: list[Any] = []
    for entry in media:
        if videos and _is_video(entry):
            items.append(entry)
        elif isinstance(entry, list | tuple):
            inner = _flatten(entry, videos)
            if inner is None:
                return None
            items += inner
        elif not videos and (isinstance(entry, Image.Image) or hasattr(entry, "shape")):
            items.append(entry)
        else:
            return None
    return items


def _pixels_key(item: Any) -> str:
    """A content hash of an image, a frame list or an array: the cache key of its output.
    Frames read back from the frame store come named (``Pixels.as_tensor``): their
    name is the key, instead of a hash of ~29 MB a clip."""
    named = getattr(item, KEY_ATTRIBUTE, None)
    if isinstance(named, str):
        shape = tuple(item.shape)
        return hashlib.blake2b(f"pixels:{named}:{shape}".encode(), digest_size=20).hexdigest()
    digest = hashlib.blake2b(digest_size=20)
    for part in item if isinstance(item, list | tuple) else [item]:
        if isinstance(part, Image.Image):
            digest.update(f"{part.mode}{part.size}".encode())
            digest.update(part.tobytes())
        else:
            array = part.detach().cpu().contiguous().numpy() if hasattr(part, "detach") else part
            digest.update(f"{array.dtype}{array.shape}".encode())
            digest.update(memoryview(array).cast("B"))
    return digest.hexdigest()


def _combine(outputs: Sequence[Any]) -> Any:
    """One output for the whole call: per-item tensors concatenated, lists joined."""
    import torch

    first = outputs[0]
    combined: dict[str, Any] = {}
    for name in first:
        values = [o[name] for o in outputs]
        if isinstance(values[0], torch.Tensor):
            combined[name] = torch.cat(values)
        elif isinstance(values[0], list):
            combined[name] = [x for v in values for x in v]
        else:
            combined[name] = values[0]
    return type(first)(data=combined, tensor_type=None)


class _CachingMediaProcessor:
    """Stands in for a processor's image or video processor: the same call, one item at a
    time, each item's output cached under its pixels' hash and the call's settings.

    Attribute access falls through to the wrapped processor, so the multimodal processor
    around it (which reads sizes, merge sizes, placeholders from it) sees no difference.
    """

    def __init__(self, inner: Any, media_arg: str, cache: MediaCache) -> None:
        self._inner = inner
        self._media_arg = media_arg
        self._cache = cache

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        media = args[0] if args else kwargs.get(self._media_arg)
        items = _flatten(media, videos=self._media_arg == "videos")
        metadata = kwargs.get("video_metadata")
        if len(args) > 1 or not items or (metadata is not None and len(metadata) != len(items)):
            return self._inner(*args, **kwargs)  # a call this wrapper does not know: as is
        rest = {k: v for k, v in kwargs.items() if k not in (self._media_arg, "video_metadata")}
        outputs = [
            self._one(item, rest, metadata[i] if metadata is not None else None)
            for i, item in enumerate(items)
        ]
        return _combine(outputs)

    def _one(self, item: Any, rest: dict[str, Any], metadata: Any) -> Any:
        call = dict(rest, **{self._media_arg: [item]})
        if metadata is not None:
            call["video_metadata"] = [metadata]
        key = f"{self._media_arg}:{_pixels_key(item)}:{metadata!r}:{sorted(rest.items())!r}"
        value, _ = self._cache.get_or_compute(key, lambda: self._inner(**call), tensor_bytes)
        return value


class ProcessorSet:
    """The processors of one engine: the model thread's own (``primary``: serial collation,
    re-collating a split micro-batch), one loaded per collating thread (``for_thread``), and
    one for length estimates shared under a lock (an estimate is a millisecond of template
    rendering and tokenizing, not worth a processor per fetching thread). All of them run
    media through the caching image and video processors."""

    def __init__(self, primary: Any, load: Callable[[], Any], cache: MediaCache) -> None:
        self._load = load
        self._cache = cache
        self.primary = self._wrap(primary)
        self._estimator = self._wrap(load())
        self._estimate_lock = threading.Lock()
        self._local = threading.local()
        self._count_lock = threading.Lock()
        self.loaded = 2

    def for_thread(self) -> Any:
        """This thread's own processor, loaded on its first call."""
        processor = getattr(self._local, "processor", None)
        if processor is None:
            processor = self._local.processor = self._wrap(self._load())
            with self._count_lock:
                self.loaded += 1
        return processor

    def estimate(self, use: Callable[[Any], int]) -> int:
        """``use(processor)`` on the shared estimating processor, one caller at a time."""
        with self._estimate_lock:
            return use(self._estimator)

    def _wrap(self, processor: Any) -> Any:
        tokenizer = getattr(processor, "tokenizer", None)
        if tokenizer is not None and not isinstance(tokenizer, RunLengthTokenizer):
            processor.tokenizer = RunLengthTokenizer(tokenizer, _placeholders(processor))
            count_placeholders_in_numpy(processor)
        if self._cache.budget_bytes > 0:
            for attribute, arg in (("image_processor", "images"), ("video_processor", "videos")):
                inner = getattr(processor, attribute, None)
                if inner is not None and not isinstance(inner, _CachingMediaProcessor):
                    setattr(processor, attribute, _CachingMediaProcessor(inner, arg, self._cache))
        return processor


def _placeholders(processor: Any) -> list[str]:
    """The processor's media placeholder tokens that its tokenizer keeps whole."""
    added = processor.tokenizer.get_added_vocab()
    tokens = {getattr(processor, name, None) for name in ("image_token", "video_token")}
    return sorted(token for token in tokens if isinstance(token, str) and token in added)
