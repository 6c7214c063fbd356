"""Decode fetched video bytes into sampled RGB frames (the CPU reference: FFmpeg via PyAV).

Every limit comes from :class:`MediaSettings` and is a hard error, checked before frames are
decoded where possible. Decoder exceptions never reach a client: their text can carry object
reprs and addresses, so each becomes a ``MediaDecodeFailed`` with a fixed message.
"""

from __future__ import annotations

import bisect
import io
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Literal

import av
from PIL import Image

from vlmq.config.errors import InvalidRequest, MediaDecodeFailed, MediaTooLarge, VlmqError
from vlmq.config.media_checks import check_aspect_ratio, demuxed_span, open_video_container
from vlmq.config.settings import MediaSettings
from vlmq.config.vision import sampled_frame_count
from vlmq.workers.media.image import Downscale
from vlmq.workers.media.prepared.pixels import Pixels

if TYPE_CHECKING:
    from vlmq.workers.media.devpixels import DeviceFrames

__all__ = [
    "SAMPLING_MODES",
    "DecodedVideo",
    "Sampling",
    "SamplingMode",
    "check_header_resolution",
    "decode_video",
    "plan_sample_times",
    "resolve_sampling",
]

# exact: the frame on screen at each sample time (the reference); keyframes: the keyframe
# nearest each sample time, one frame decoded per sample (opt-in, cheaper, not exact).
SamplingMode = Literal["exact", "keyframes"]
SAMPLING_MODES: tuple[SamplingMode, ...] = ("exact", "keyframes")

_VIDEO_FAILED = "could not decode video"
# Seconds a frame's timestamp may sit before a sample time and still be taken:
# half a frame period absorbs rounding in container timestamps.
_EPSILON_S = 1e-6
# Without a keyframe index, decode forward instead of seeking when the next
# sample is at most this far ahead (a seek would land on an earlier keyframe).
_FORWARD_WINDOW_S = 1.0
# Unreferenced frames are skipped only while the next sample is more than the decoder's
# reorder depth plus this many frames ahead, so the frame on screen at a sample is decoded.
_SKIP_MARGIN_FRAMES = 4


@dataclass
class DecodedVideo:
    """Sampled RGB frames plus what the processor needs to place them in time."""

    # Decoded here: Pillow frames; read back from the frame store: ``Pixels`` (planar);
    # decoded on the processor's GPU (nvdec.py): ``DeviceFrames``, never stored.
    frames: list[Image.Image] | Pixels | DeviceFrames
    fps: float  # source frame rate
    duration_s: float
    frame_indices: list[int]  # index of each frame in the source
    total_frames: int
    width: int
    height: int


@dataclass(frozen=True)
class _Probe:
    """What the container says about the stream, before decoding anything."""

    fps: float
    duration_s: float
    total_frames: int
    indexed: bool  # complete metadata and a seek index: sampling may seek


@dataclass
class _Picked:
    image: Image.Image
    index: int


@dataclass(frozen=True)
class Sampling:
    """How frames are taken from a video, every default resolved: what changes the sampled
    pixels (the frame store's and the media cache's keys hold it)."""

    fps: float
    max_frames: int
    mode: SamplingMode = "exact"


def resolve_sampling(
    settings: MediaSettings,
    fps: float | None = None,
    max_frames: int | None = None,
    mode: str | None = None,
) -> Sampling:
    """A request's sampling with the settings' defaults and caps applied, or InvalidRequest."""
    target_fps = settings.video_fps if fps is None else fps
    if not (isinstance(target_fps, (int, float)) and math.isfinite(target_fps)) or target_fps <= 0:
        raise InvalidRequest("video fps must be a positive number", field="fps")
    cap = settings.video_max_frames if max_frames is None else max_frames
    if not isinstance(cap, int) or cap < 1:
        raise InvalidRequest("max_frames must be a positive integer", field="max_frames")
    chosen = settings.video_sampling if mode is None else mode
    if chosen not in SAMPLING_MODES:
        raise InvalidRequest("must be 'exact' or 'keyframes'", field="video_sampling")
    return Sampling(float(target_fps), min(cap, settings.video_max_frames), chosen)


def decode_video(
    data: bytes,
    settings: MediaSettings,
    fps: float | None = None,
    max_frames: int | None = None,
    downscale: Downscale | None = None,
    sampling: str | None = None,
) -> DecodedVideo:
    """Sample frames evenly over the video at ``fps`` (capped by ``max_frames``
    and ``settings.video_max_frames``), decoding as few frames as possible; each sampled
    frame is downscaled (``downscale``) in the same pass that converts it to RGB.
    ``sampling`` (default ``settings.video_sampling``): ``exact`` or ``keyframes``."""
    plan = resolve_sampling(settings, fps, max_frames, sampling)
    try:
        return _decode_video(data, settings, plan, downscale)
    except VlmqError:
        raise
    except Exception:  # av.FFmpegError, and ValueError/OSError/MemoryError from PyAV
        raise MediaDecodeFailed(_VIDEO_FAILED) from None


def _decode_video(
    data: bytes, settings: MediaSettings, plan: Sampling, downscale: Downscale | None
) -> DecodedVideo:
    with open_video_container(io.BytesIO(data), settings) as container:
        stream = _video_stream(container)
        check_header_resolution(stream, settings)
        probe = _probe(container, stream) or _probe_by_demuxing(data, settings)
        _check_duration(probe, settings)
        times = plan_sample_times(
            probe.duration_s, probe.fps, probe.total_frames, plan.fps, plan.max_frames
        )
        budget = _DecodeBudget(settings.video_max_decoded_frames)
        containers = _Containers(data, settings, container)
        picked = None
        if plan.mode == "keyframes":
            picked = _sample_keyframes(containers, settings, probe, times, budget, downscale)
        if picked is None:  # exact, or no keyframe could be located: the exact sampler
            picked = _even_count(_sample(containers, settings, probe, times, budget, downscale))
    if not picked:
        raise MediaDecodeFailed("video has no decodable frames")
    width, height = picked[0].image.size
    return DecodedVideo(
        frames=[p.image for p in picked],
        fps=probe.fps,
        duration_s=probe.duration_s,
        frame_indices=[p.index for p in picked],
        total_frames=probe.total_frames,
        width=width,
        height=height,
    )


def _video_stream(container: Any, thread_type: str = "SLICE") -> Any:
    if not container.streams.video:
        raise MediaDecodeFailed("media has no video stream")
    stream = container.streams.video[0]
    # Slice threads, not frame threads: several clips decode at once on the preprocessing
    # threads, and frame threading's hand-offs cost more than they give (measured on 720p
    # H.264, 4 clips on 2 threads: 3.99 s slice, 5.00 s auto; ``video_thread_type``).
    stream.thread_type = thread_type
    return stream


def check_header_resolution(stream: Any, settings: MediaSettings) -> None:
    """The stream's size against the limits, before anything is decoded (the CPU path checks
    frames again one by one; the device path has only this)."""
    width, height = stream.codec_context.width or 0, stream.codec_context.height or 0
    if width * height > settings.video_max_pixels_per_frame:
        raise MediaTooLarge("video resolution is too large")
    check_aspect_ratio(width, height, settings, "video")


def _stream_fps(stream: Any) -> float | None:
    for rate in (stream.average_rate, stream.guessed_rate, stream.base_rate):
        if rate and rate > 0:
            return float(rate)
    return None


def _stream_duration_s(container: Any, stream: Any) -> float | None:
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration:
        return float(container.duration) / av.time_base
    return None


def _probe(container: Any, stream: Any) -> _Probe | None:
    """Frame rate, duration and frame count from container metadata, or None
    when the container does not say enough (then the packets are counted)."""
    fps = _stream_fps(stream)
    duration = _stream_duration_s(container, stream)
    frames = stream.frames if stream.frames and stream.frames > 0 else None
    if fps is None or (duration is None and frames is None):
        return None
    if frames is None:
        frames = max(1, round((duration or 0.0) * fps))  # e.g. Matroska has no frame count
    if duration is None:
        duration = frames / fps
    return _Probe(fps=fps, duration_s=duration, total_frames=frames, indexed=_has_index(stream))


def _has_index(stream: Any) -> bool:
    """Seek only in streams with a demuxer index (GIF has none: its frames are
    then decoded in order, which also gives exact source indices)."""
    entries = getattr(stream, "index_entries", None)
    return entries is None or len(entries) > 0  # None: PyAV too old to say


def _probe_by_demuxing(data: bytes, settings: MediaSettings) -> _Probe:
    """Count packets without decoding them (cheap), bounded by the decode budget."""
    with open_video_container(io.BytesIO(data), settings) as container:
        stream = _video_stream(container)
        count, duration = demuxed_span(container, stream, settings)
        fps = _stream_fps(stream)
    if fps is None:
        fps = count / duration if duration > 0 else 1.0
    if duration <= 0:
        duration = count / fps
    return _Probe(fps=fps, duration_s=duration, total_frames=count, indexed=False)


def _check_duration(probe: _Probe, settings: MediaSettings) -> None:
    if probe.duration_s > settings.video_max_duration_s:
        raise MediaTooLarge("video is too long")


def plan_sample_times(
    duration_s: float, source_fps: float, total_frames: int, target_fps: float, max_frames: int
) -> list[float]:
    """Sample times (seconds from the first frame) at the centres of equal
    segments: ``duration * target_fps`` of them, clamped to [2, max_frames]
    and to the frame count, and even whenever that leaves at least 2 (Qwen
    groups frames in temporal pairs)."""
    # The count is shared with the producer's pre-flight estimate (config/vision.py).
    count = sampled_frame_count(duration_s, total_frames, target_fps, max_frames)
    span = max(duration_s, count / source_fps if source_fps > 0 else 0.0)
    return [(i + 0.5) * span / count for i in range(count)]


def _even_count(picked: list[_Picked]) -> list[_Picked]:
    # A stream shorter than its metadata can leave an odd number of samples.
    if len(picked) > 2 and len(picked) % 2:
        return picked[:-1]
    return picked


class _DecodeBudget:
    """Counts decoded frames across seeks so a long GOP cannot burn CPU."""

    def __init__(self, limit: int) -> None:
        self._left = limit

    def spend(self) -> None:
        self._left -= 1
        if self._left < 0:
            raise MediaTooLarge("video needs too many frames decoded")


class _SeekUnusable(Exception):
    """Seeking did not behave (no timestamps, or the demuxer refused)."""


@dataclass
class _Decoded:
    frame: Any
    seconds: float  # presentation time from the start of the stream
    index: int


class _FrameCursor:
    """Decodes forward with one frame of look-ahead and answers "which frame
    is on screen at time t": the last frame starting at or before t. That rule
    holds for variable frame rates too (e.g. GIF delays in centiseconds)."""

    def __init__(self, context: _StreamContext) -> None:
        self._ctx = context
        self._frames: Iterator[Any] | None = None
        self._current: _Decoded | None = None
        self._ahead: _Decoded | None = None
        self._ordinal = 0

    def restart(self, frames: Iterator[Any]) -> None:
        self._frames, self._current, self._ahead = frames, None, None

    @property
    def position(self) -> float | None:
        """Time of the furthest frame decoded since the last restart."""
        latest = self._ahead or self._current
        return latest.seconds if latest is not None else None

    def frame_at(self, t: float) -> _Decoded | None:
        while True:
            self._ctx.skip_unneeded(self.position, t)
            nxt = self._peek()
            if nxt is None or nxt.seconds > t + _EPSILON_S:
                # Before the first frame (after a seek that overshot), take the next one.
                return self._current or nxt
            self._current, self._ahead = nxt, None

    def _peek(self) -> _Decoded | None:
        if self._ahead is None and self._frames is not None:
            frame = next(self._frames, None)
            if frame is not None:
                self._ahead = self._ctx.describe(frame, self._ordinal)
                self._ordinal += 1
        return self._ahead


class _StreamContext:
    """Per-stream timing and the checks every decoded frame goes through."""

    def __init__(
        self,
        stream: Any,
        settings: MediaSettings,
        probe: _Probe,
        budget: _DecodeBudget,
        sequential: bool,
    ) -> None:
        self.stream = stream
        self.settings = settings
        self.fps = probe.fps
        self.budget = budget
        self.sequential = sequential
        self.time_base: Fraction = stream.time_base or Fraction(1, 1)
        self.start_pts: int = stream.start_time or 0
        self._skip = "DEFAULT"
        reorder = getattr(stream.codec_context, "reorder_depth", None)
        self._skip_after_frames = _SKIP_MARGIN_FRAMES + (
            reorder if isinstance(reorder, int) else 16
        )

    def skip_unneeded(self, position: float | None, t: float) -> None:
        """Frames nothing refers to are not decoded while the next sample is still more
        than a few frames ahead (the decoder's reorder depth plus a margin): the frames
        kept are exactly those of a full decode. In order (``sequential``) every frame
        counts for its index, so none is skipped."""
        far = (
            self.settings.video_skip_unreferenced
            and not self.sequential
            and position is not None
            and (t - position) * (self.fps or 30.0) > self._skip_after_frames
        )
        mode = "NONREF" if far else "DEFAULT"
        if mode != self._skip:
            self.stream.codec_context.skip_frame = mode
            self._skip = mode

    def pts_of(self, seconds: float) -> int:
        return self.start_pts + math.floor(Fraction(seconds) / self.time_base)

    def describe(self, frame: Any, ordinal: int) -> _Decoded:
        self.budget.spend()
        # Resolution can change mid-stream: every frame is checked, not the header.
        if frame.width * frame.height > self.settings.video_max_pixels_per_frame:
            raise MediaTooLarge("video resolution is too large")
        check_aspect_ratio(frame.width, frame.height, self.settings, "video")
        if frame.pts is None:
            if not self.sequential:
                raise _SeekUnusable
            return _Decoded(frame, ordinal / self.fps, ordinal)
        seconds = float((frame.pts - self.start_pts) * self.time_base)
        if seconds > self.settings.video_max_duration_s:
            raise MediaTooLarge("video is too long")
        # In order, the ordinal is exact; after seeks only the time is known.
        index = ordinal if self.sequential else max(0, round(seconds * self.fps))
        return _Decoded(frame, seconds, index)


class _Containers:
    """Containers over one clip for its samplers: the probe's own for the first that asks,
    a new one for any after (a fallback starts over). Opening one runs FFmpeg's stream
    probe, which decodes a frame: ~25 ms for a ~340 KB keyframe of a 720p clip, ~70 ms for
    an ~810 KB one, a tenth of keyframe sampling's cost (bench/README.md)."""

    def __init__(self, data: bytes, settings: MediaSettings, first: Any) -> None:
        self.data = data
        self.settings = settings
        self._first = first

    @contextmanager
    def open(self) -> Iterator[Any]:
        first, self._first = self._first, None
        if first is not None:
            yield first  # closed by whoever opened it
            return
        with open_video_container(io.BytesIO(self.data), self.settings) as container:
            yield container


def _sample(
    containers: _Containers,
    settings: MediaSettings,
    probe: _Probe,
    times: list[float],
    budget: _DecodeBudget,
    downscale: Downscale | None,
) -> list[_Picked]:
    if probe.indexed and settings.video_seek:
        try:
            return _sample_frames(containers, settings, probe, times, budget, False, downscale)
        except _SeekUnusable:
            pass  # fall back to decoding in order, still within the same budget
    return _sample_frames(containers, settings, probe, times, budget, True, downscale)


def _sample_frames(
    containers: _Containers,
    settings: MediaSettings,
    probe: _Probe,
    times: list[float],
    budget: _DecodeBudget,
    sequential: bool,
    downscale: Downscale | None,
) -> list[_Picked]:
    """Seeking mode: per sample, seek to the keyframe before it only when that
    keyframe lies past what is already decoded, so the cost follows the number
    of samples and the GOP, not the length. Sequential mode (containers without
    usable metadata or seeking) decodes in order and stops after the last sample."""
    picked: list[_Picked] = []
    with containers.open() as container:
        stream = _video_stream(container, settings.video_thread_type)
        ctx = _StreamContext(stream, settings, probe, budget, sequential)
        cursor = _FrameCursor(ctx)
        cursor.restart(container.decode(stream))
        for t in times:
            if not sequential and _must_seek(ctx, cursor.position, t):
                _seek(container, ctx, t)
                cursor.restart(container.decode(stream))
            decoded = cursor.frame_at(t)
            if decoded is None:
                break
            picked.append(_Picked(_frame_to_image(decoded.frame, downscale), decoded.index))
    return picked


# --- keyframe sampling (opt-in) --------------------------------------------------------------


def _sample_keyframes(
    containers: _Containers,
    settings: MediaSettings,
    probe: _Probe,
    times: list[float],
    budget: _DecodeBudget,
    downscale: Downscale | None,
) -> list[_Picked] | None:
    """Each sample time served by the keyframe nearest it: the keyframes' times come from
    demuxing (no decoding), then each distinct keyframe chosen is decoded alone (a seek to
    it, non-key frames discarded by the decoder), so a sample costs one frame whatever the
    GOP. Samples that share a nearest keyframe share its frame (and its index: the metadata
    tells the processor where each frame really is). None when the stream has no keyframe
    with a timestamp or will not seek to one: the exact sampler is used instead."""
    with containers.open() as container:
        stream = _video_stream(container, settings.video_thread_type)
        ctx = _StreamContext(stream, settings, probe, budget, sequential=False)
        keyframes = _keyframe_times(container, stream, ctx, times[-1])
        if not keyframes:
            return None
        chosen = [_nearest(keyframes, t) for t in times]
        decoded: dict[float, _Picked] = {}
        for seconds in chosen:
            if seconds not in decoded:
                picked = _decode_keyframe(container, ctx, seconds, downscale)
                if picked is None:
                    return None
                decoded[seconds] = picked
    return [decoded[seconds] for seconds in chosen]


def _keyframe_times(container: Any, stream: Any, ctx: _StreamContext, last: float) -> list[float]:
    """Sorted times of the keyframes up to the first one at or past ``last``, from packet
    flags alone (demuxing reads, never decodes)."""
    times: list[float] = []
    for packet in container.demux(stream):
        if packet.pts is None or packet.size == 0 or not packet.is_keyframe:
            continue
        seconds = float((packet.pts - ctx.start_pts) * ctx.time_base)
        if seconds > ctx.settings.video_max_duration_s:
            raise MediaTooLarge("video is too long")
        times.append(seconds)
        if seconds >= last:
            break
    return sorted(set(times))


def _nearest(keyframes: list[float], t: float) -> float:
    """The keyframe time closest to ``t`` (the earlier one on a tie)."""
    after = bisect.bisect_left(keyframes, t)
    candidates = keyframes[max(0, after - 1) : after + 1]
    return min(candidates, key=lambda k: (abs(k - t), k))


def _decode_keyframe(
    container: Any, ctx: _StreamContext, seconds: float, downscale: Downscale | None
) -> _Picked | None:
    """The keyframe at ``seconds`` alone: seek to it, demux to its packet (a seek that lands
    on an earlier keyframe skips it unread), decode that packet and drain the decoder. Fed on
    through ``container.decode``, a decoder that reorders holds the frame back until the
    next keyframe is decoded too: measured 3x the cost of one keyframe."""
    try:
        container.seek(ctx.pts_of(seconds), stream=ctx.stream, backward=True)
    except av.FFmpegError:
        return None
    target = ctx.pts_of(seconds - _EPSILON_S)
    codec = ctx.stream.codec_context
    for packet in container.demux(ctx.stream):
        if packet.pts is None or not packet.is_keyframe or packet.pts < target:
            continue
        frames = [*codec.decode(packet), *codec.decode(None)]  # None drains: no wait
        if not frames:
            return None
        try:
            found = ctx.describe(frames[0], 0)
        except _SeekUnusable:
            return None
        return _Picked(_frame_to_image(found.frame, downscale), found.index)
    return None


def _must_seek(ctx: _StreamContext, position: float | None, t: float) -> bool:
    if position is None:
        return t > _FORWARD_WINDOW_S
    if t <= position:
        return False  # already decoded past it
    keyframe = _keyframe_before(ctx.stream, ctx.pts_of(t))
    if keyframe is not None:
        # A seek restarts the decoder (its frame threads drain and refill): taken only when
        # it skips more frames than it costs (``video_seek_min_skip_frames``).
        skipped_s = float((keyframe - ctx.start_pts) * ctx.time_base) - position
        return skipped_s * (ctx.fps or 30.0) > ctx.settings.video_seek_min_skip_frames
    return t - position > _FORWARD_WINDOW_S


def _seek(container: Any, ctx: _StreamContext, t: float) -> None:
    try:
        container.seek(ctx.pts_of(t), stream=ctx.stream, backward=True)
    except av.FFmpegError:
        raise _SeekUnusable from None


def _keyframe_before(stream: Any, target_pts: int) -> int | None:
    """Timestamp of the keyframe at or before target from the demuxer index
    (exposed by recent PyAV); None when unknown. Some demuxers fill the index
    lazily (Matroska reads its cues on the first seek), so an index that does
    not reach the target is not trusted."""
    entries = getattr(stream, "index_entries", None)
    if not entries or entries[len(entries) - 1].timestamp < target_pts:
        return None
    position = entries.search_timestamp(target_pts, backward=True)
    if position < 0:
        return None
    timestamp: int = entries[position].timestamp
    return timestamp


def _frame_to_image(frame: Any, downscale: Downscale | None) -> Image.Image:
    """RGB24, downscaled in the same swscale pass when the processor needs less."""
    size = (frame.width, frame.height)
    target = downscale.size_for(size) if downscale is not None else size
    if target == size:
        image: Image.Image = frame.to_image()
        return image
    width, height = target
    scaled: Image.Image = frame.to_image(width=width, height=height, interpolation="AREA")
    return scaled
