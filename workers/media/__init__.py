"""Media for VLM requests: fetch (with SSRF, size and time limits) and decode.

The loader is ``loader.py`` (``MediaLoader``); images and video decode in ``image.py`` and
``video.py``; prepared media (the frame store) is under ``prepared/``. The names most callers
use are re-exported here.
"""

from __future__ import annotations

from vlmq.workers.media.cache import MediaCache
from vlmq.workers.media.fetch import MediaFetcher, MediaKind
from vlmq.workers.media.image import Downscale, decode_image
from vlmq.workers.media.loader import (
    ImageDecoder,
    LoadCounts,
    MediaLoader,
    VideoDecoder,
    frames_bytes,
    image_bytes,
    video_bytes,
)
from vlmq.workers.media.prepared.framestore import FrameStore
from vlmq.workers.media.prepared.pixels import Pixels
from vlmq.workers.media.video import DecodedVideo, decode_video

__all__ = [
    "DecodedVideo",
    "Downscale",
    "FrameStore",
    "ImageDecoder",
    "LoadCounts",
    "MediaCache",
    "MediaFetcher",
    "MediaKind",
    "MediaLoader",
    "Pixels",
    "VideoDecoder",
    "decode_image",
    "decode_video",
    "frames_bytes",
    "image_bytes",
    "video_bytes",
]
