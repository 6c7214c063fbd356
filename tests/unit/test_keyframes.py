"""Keyframe sampling (opt-in): each sample time served by its nearest keyframe, one frame
decoded per sample; exact sampling stays the default."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tests.support.samples import data_uri, make_video_bytes, read_frame_code
from vlmq.config.errors import InvalidRequest, MediaTooLarge
from vlmq.config.schemas import Request
from vlmq.config.settings import MediaSettings
from vlmq.workers.media import MediaCache, MediaLoader, decode_video
from vlmq.workers.media.video import plan_sample_times, resolve_sampling

pytestmark = pytest.mark.unit

FPS = 30
GOP = 15


@pytest.fixture(scope="module")
def clip() -> bytes:
    """4 s at 30 fps, a keyframe every 15 frames (x264: closed GOPs, B-frames)."""
    return make_video_bytes(n_frames=120, size=(96, 64), fps=FPS, codec="libx264", gop=GOP)


def _nearest_keyframe(t: float, frames: int = 120) -> int:
    keyframes = range(0, frames, GOP)
    return min(keyframes, key=lambda k: (abs(k / FPS - t), k))


def test_exact_stays_the_default(clip: bytes) -> None:
    assert MediaSettings().video_sampling == "exact"
    assert resolve_sampling(MediaSettings()).mode == "exact"
    default = decode_video(clip, MediaSettings(), 4.0, 16)
    exact = decode_video(clip, MediaSettings(), 4.0, 16, sampling="exact")
    assert default.frame_indices == exact.frame_indices


def test_each_sample_is_its_nearest_keyframe(clip: bytes) -> None:
    video = decode_video(clip, MediaSettings(), 4.0, 16, sampling="keyframes")
    times = plan_sample_times(4.0, FPS, 120, 4.0, 16)
    assert len(video.frames) == len(times) == 16  # the count of exact sampling
    assert video.frame_indices == [_nearest_keyframe(t) for t in times]
    # The frames are those keyframes (each frame carries its index in a code row).
    assert [read_frame_code(f) for f in video.frames] == video.frame_indices


def test_one_frame_is_decoded_per_distinct_keyframe(clip: bytes) -> None:
    """With a decode budget of 8 frames, keyframe sampling of 16 samples fits (8 distinct
    keyframes) where exact sampling, which decodes from a keyframe up to each sample, does
    not."""
    tight = MediaSettings(video_max_decoded_frames=8)
    video = decode_video(clip, tight, 4.0, 16, sampling="keyframes")
    assert len(set(video.frame_indices)) == 8
    with pytest.raises(MediaTooLarge):
        decode_video(clip, tight, 4.0, 16, sampling="exact")


def test_the_setting_applies_unless_the_request_says(clip: bytes) -> None:
    keyed = MediaSettings(video_sampling="keyframes")
    by_setting = decode_video(clip, keyed, 4.0, 16)
    assert all(i % GOP == 0 for i in by_setting.frame_indices)
    overridden = decode_video(clip, keyed, 4.0, 16, sampling="exact")
    assert overridden.frame_indices == decode_video(clip, MediaSettings(), 4.0, 16).frame_indices
    with pytest.raises(InvalidRequest):
        decode_video(clip, MediaSettings(), 4.0, 16, sampling="nearest")


def test_the_request_field(clip: bytes) -> None:
    def video_part(**extra: object) -> dict[str, object]:
        return {"type": "video", "video": "s3://b/c.mp4", **extra}

    def request(part: dict[str, object]) -> Request:
        return Request.model_validate({"messages": [{"role": "user", "content": [part]}]})

    assert request(video_part()).parts("video")[0].video_sampling is None
    part = request(video_part(video_sampling="keyframes")).parts("video")[0]
    assert part.video_sampling == "keyframes"
    with pytest.raises(ValidationError):
        request(video_part(video_sampling="fast"))


def test_a_stream_without_a_seek_index_still_samples_right() -> None:
    """A GIF: no demuxer index, every frame a keyframe (or, if it cannot seek, the exact
    sampler): each sample is a real frame with its true index."""
    gif = make_video_bytes(n_frames=12, size=(64, 48), fps=8, container="gif", codec="gif")
    exact = decode_video(gif, MediaSettings(), 4.0, 6)
    keyed = decode_video(gif, MediaSettings(), 4.0, 6, sampling="keyframes")
    assert len(keyed.frames) == len(exact.frames)
    assert [read_frame_code(f) for f in keyed.frames] == keyed.frame_indices


def test_the_cache_keeps_the_two_modes_apart(clip: bytes) -> None:
    loader = MediaLoader(MediaSettings(), cache=MediaCache(64 * 1024 * 1024))
    source = data_uri(clip, "video/mp4")
    exact = loader.load_video(source, 4.0, 16)
    keyed = loader.load_video(source, 4.0, 16, sampling="keyframes")
    assert exact.frame_indices != keyed.frame_indices
    assert loader.load_video(source, 4.0, 16, sampling="keyframes").frame_indices == (
        keyed.frame_indices
    )
    assert loader.thread_hits() == 1
