"""Decoding media: image formats and limits, video sampling, the loader, samples."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import av
import pytest
from PIL import Image

from tests.support.samples import (
    data_uri,
    encode,
    frame_code_modulus,
    make_audio_bytes,
    make_image,
    make_video_bytes,
    png_header_only,
    read_frame_code,
    save_image,
    save_video,
)
from vlmq.config.errors import InvalidRequest, MediaDecodeFailed, MediaTooLarge, VlmqError
from vlmq.config.settings import MediaSettings
from vlmq.workers.media import DecodedVideo, MediaLoader, decode_image, decode_video
from vlmq.workers.media.video import plan_sample_times

pytestmark = pytest.mark.unit

SETTINGS = MediaSettings()


# --- images --------------------------------------------------------------------


@pytest.mark.parametrize("format", ["JPEG", "PNG", "WEBP", "GIF"])
def test_allowed_image_formats_round_trip(format: str) -> None:
    source = make_image((48, 32), seed=3)
    image = decode_image(encode(source, format), SETTINGS)
    assert image.mode == "RGB" and image.size == (48, 32)


@pytest.mark.parametrize("format", ["BMP", "TIFF", "PPM", "ICO"])
def test_disallowed_image_formats_rejected(format: str) -> None:
    with pytest.raises(MediaDecodeFailed):
        decode_image(encode(make_image((16, 16)), format), SETTINGS)


def test_format_allowlist_comes_from_settings() -> None:
    data = encode(make_image((16, 16)), "PNG")
    with pytest.raises(MediaDecodeFailed):
        decode_image(data, MediaSettings(image_formats=["JPEG"]))


def test_bomb_header_is_too_large_before_any_pixels() -> None:
    bomb = png_header_only(30000, 30000)
    assert len(bomb) < 100
    with pytest.raises(MediaTooLarge):
        decode_image(bomb, SETTINGS)


def test_pillow_own_bomb_error_maps_to_too_large() -> None:
    # Past twice Pillow's global limit, Pillow raises in open(); same answer.
    settings = MediaSettings(max_image_pixels=10**10)
    with pytest.raises(MediaTooLarge):
        decode_image(png_header_only(20000, 20000), settings)


def test_pixel_limit_is_a_hard_error_from_settings() -> None:
    data = encode(make_image((64, 64)), "PNG")
    with pytest.raises(MediaTooLarge):
        decode_image(data, MediaSettings(max_image_pixels=64 * 64 - 1))
    assert decode_image(data, MediaSettings(max_image_pixels=64 * 64)).size == (64, 64)


@pytest.mark.parametrize("format", ["PNG", "JPEG"])
def test_truncated_images_rejected(format: str) -> None:
    data = encode(make_image((128, 128), seed=1), format)
    with pytest.raises(MediaDecodeFailed):
        decode_image(data[: len(data) // 2], SETTINGS)


@pytest.mark.parametrize("data", [b"", b"\0" * 64, bytes(range(256)) * 8, b"\x89PNG\r\n\x1a\n"])
def test_garbage_bytes_rejected(data: bytes) -> None:
    with pytest.raises(MediaDecodeFailed) as info:
        decode_image(data, SETTINGS)
    assert info.value.message == "could not decode image"  # no Pillow text, no repr


def test_animated_gif_gives_first_frame() -> None:
    frames = [Image.new("RGB", (8, 8), color) for color in ((255, 0, 0), (0, 0, 255))]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:], duration=100)
    image = decode_image(buffer.getvalue(), SETTINGS)
    assert image.getpixel((4, 4)) == (255, 0, 0)


def test_transparency_composited_on_white() -> None:
    rgba = Image.new("RGBA", (4, 4), (0, 0, 0, 0))
    image = decode_image(encode(rgba, "PNG"), SETTINGS)
    assert image.mode == "RGB" and image.getpixel((0, 0)) == (255, 255, 255)


def test_grayscale_and_palette_become_rgb() -> None:
    for mode in ("L", "P", "1"):
        image = decode_image(encode(make_image((8, 8)).convert(mode), "PNG"), SETTINGS)
        assert image.mode == "RGB"


def test_exif_orientation_applied() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise on display
    data = encode(make_image((40, 20)), "JPEG", exif=exif)
    assert decode_image(data, SETTINGS).size == (20, 40)


# --- video sampling --------------------------------------------------------------


@pytest.fixture(scope="module")
def clip() -> bytes:
    return make_video_bytes(n_frames=16, size=(64, 64), fps=8)  # 2 s


def assert_frames_match_indices(video: DecodedVideo) -> None:
    """The stamped code in each frame is the source index the sampler reported."""
    modulus = frame_code_modulus(video.width)
    assert [read_frame_code(f) for f in video.frames] == [i % modulus for i in video.frame_indices]


@pytest.mark.parametrize(
    ("fps", "max_frames", "expected"),
    [
        (None, None, [2, 6, 10, 14]),  # default 2 fps over 2 s
        (8.0, None, list(range(16))),  # every frame
        (8.0, 5, [2, 6, 10, 14]),  # capped at 5, then even: 4
        (8.0, 6, [1, 4, 6, 9, 12, 14]),
        (100.0, 1000, list(range(16))),  # never more than the frames / settings cap
        (0.1, None, [4, 12]),  # never fewer than 2
        (1.0, None, [4, 12]),
    ],
)
def test_sampling_counts_and_positions(
    clip: bytes, fps: float | None, max_frames: int | None, expected: list[int]
) -> None:
    video = decode_video(clip, SETTINGS, fps=fps, max_frames=max_frames)
    assert video.frame_indices == expected
    assert len(video.frames) == len(expected)
    assert_frames_match_indices(video)
    assert (video.total_frames, video.width, video.height) == (16, 64, 64)
    assert video.fps == pytest.approx(8.0)
    assert video.duration_s == pytest.approx(2.0)
    assert all(f.mode == "RGB" and f.size == (64, 64) for f in video.frames)


@pytest.mark.parametrize("max_frames", [2, 3, 5, 7, 9, 15, 16])
@pytest.mark.parametrize("fps", [0.5, 1.5, 3.0, 5.0, 8.0])
def test_sample_counts_are_even(clip: bytes, fps: float, max_frames: int) -> None:
    video = decode_video(clip, SETTINGS, fps=fps, max_frames=max_frames)
    assert len(video.frames) >= 2 and len(video.frames) % 2 == 0
    assert len(video.frames) <= max_frames


def test_settings_cap_frames_even_when_request_asks_more(clip: bytes) -> None:
    video = decode_video(clip, MediaSettings(video_max_frames=6), fps=8.0, max_frames=100)
    assert len(video.frames) == 6


def test_plan_sample_times_is_evenly_spaced() -> None:
    times = plan_sample_times(10.0, 30.0, 300, target_fps=2.0, max_frames=8)
    assert times == pytest.approx([0.625 + 1.25 * i for i in range(8)])
    assert plan_sample_times(0.0, 25.0, 1, 2.0, 16) == pytest.approx([0.02])  # one frame


@pytest.mark.parametrize(
    ("container", "codec"),
    [("mkv", "mpeg4"), ("avi", "mpeg4"), ("mp4", "libx264"), ("webm", "libvpx"), ("gif", "gif")],
)
def test_other_containers_sample_the_same_frames(container: str, codec: str) -> None:
    if codec not in av.codecs_available:
        pytest.skip(f"FFmpeg build lacks {codec}")
    data = make_video_bytes(n_frames=16, fps=8, container=container, codec=codec)
    video = decode_video(data, SETTINGS, fps=2.0)
    assert video.frame_indices == [2, 6, 10, 14]
    assert_frames_match_indices(video)


def test_long_video_is_sampled_by_seeking_within_a_small_decode_budget() -> None:
    data = make_video_bytes(n_frames=600, size=(32, 32), fps=25, gop=12)  # 24 s
    # Decoding all would need 600; every seek is taken (even those skipping few frames).
    settings = MediaSettings(video_max_decoded_frames=250, video_seek_min_skip_frames=0)
    video = decode_video(data, settings, fps=2.0)
    assert len(video.frames) == 16 and video.total_frames == 600
    # The frame on screen at the centre of each of 16 equal segments.
    assert video.frame_indices == [int((i + 0.5) * 600 / 16) for i in range(16)]
    assert_frames_match_indices(video)


def test_decode_budget_is_enforced() -> None:
    data = make_video_bytes(n_frames=200, size=(32, 32), fps=25, gop=200)  # one keyframe
    with pytest.raises(MediaTooLarge):
        decode_video(data, MediaSettings(video_max_decoded_frames=50), fps=2.0)


def test_unknown_duration_is_counted_then_decoded_in_order() -> None:
    data = make_video_bytes(n_frames=40, fps=8, container="mkv", live=True)
    with av.open(io.BytesIO(data), mode="r") as container:  # the premise: no duration, no count
        assert container.duration is None and container.streams.video[0].frames == 0
    video = decode_video(data, SETTINGS, fps=2.0)
    assert video.total_frames == 40 and video.duration_s == pytest.approx(5.0)
    assert video.frame_indices == [2, 6, 10, 14, 18, 22, 26, 30, 34, 38]
    assert_frames_match_indices(video)


def test_unknown_length_video_over_budget_is_too_large() -> None:
    data = make_video_bytes(n_frames=40, fps=8, container="mkv", live=True)
    with pytest.raises(MediaTooLarge):
        decode_video(data, MediaSettings(video_max_decoded_frames=20))


def test_audio_only_file_has_no_video_stream() -> None:
    with pytest.raises(MediaDecodeFailed) as info:
        decode_video(make_audio_bytes(container="mp4", codec="aac"), SETTINGS)
    assert info.value.message == "media has no video stream"


@pytest.mark.parametrize("container", ["mpegts", "nut"])
def test_disallowed_container_rejected(container: str) -> None:
    with pytest.raises(MediaDecodeFailed):
        decode_video(make_video_bytes(container=container), SETTINGS)


def test_container_allowlist_comes_from_settings(clip: bytes) -> None:
    with pytest.raises(MediaDecodeFailed):
        decode_video(clip, MediaSettings(video_formats=["matroska,webm"]))


@pytest.mark.parametrize(
    "data", [b"", b"\0" * 1000, bytes(range(256)) * 40, b"\x00\x00\x00\x18ftypmp42" + b"\0" * 64]
)
def test_garbage_video_rejected(data: bytes) -> None:
    with pytest.raises(MediaDecodeFailed) as info:
        decode_video(data, SETTINGS)
    assert "<" not in info.value.message and "0x" not in info.value.message


def test_truncated_video_rejected(clip: bytes) -> None:
    with pytest.raises(MediaDecodeFailed):
        decode_video(clip[: len(clip) // 2], SETTINGS)


def test_frame_resolution_cap(clip: bytes) -> None:
    with pytest.raises(MediaTooLarge):
        decode_video(clip, MediaSettings(video_max_pixels_per_frame=64 * 64 - 1))


def test_duration_cap(clip: bytes) -> None:
    with pytest.raises(MediaTooLarge):
        decode_video(clip, MediaSettings(video_max_duration_s=1.5))


@pytest.mark.parametrize(
    ("fps", "max_frames"), [(0.0, None), (-1.0, None), (float("nan"), None), (None, 0)]
)
def test_invalid_sampling_request(clip: bytes, fps: float | None, max_frames: int | None) -> None:
    with pytest.raises(InvalidRequest):
        decode_video(clip, SETTINGS, fps=fps, max_frames=max_frames)


# --- loader and samples ------------------------------------------------------------


def test_loader_image_and_video_from_data_uris(clip: bytes) -> None:
    loader = MediaLoader(SETTINGS)
    png = encode(make_image((20, 10)), "PNG")
    assert loader.load_image(data_uri(png, "image/png")).size == (20, 10)
    video = loader.load_video(data_uri(clip, "video/mp4"), fps=4.0, max_frames=4)
    assert video.frame_indices == [2, 6, 10, 14]


def test_loader_from_local_files(tmp_path: Path) -> None:
    image_path = save_image(tmp_path / "x.webp", size=(24, 24), seed=2, format="WEBP")
    video_path = save_video(tmp_path / "x.mkv", n_frames=8, fps=4)
    loader = MediaLoader(MediaSettings(local_roots=[str(tmp_path)]))
    assert loader.load_image(f"file://{image_path}").size == (24, 24)
    assert len(loader.load_video(str(video_path)).frames) == 4


def test_loader_accepts_decoded_images() -> None:
    loader = MediaLoader(SETTINGS)
    rgb = make_image((8, 8))
    assert loader.load_image(rgb) is rgb
    assert loader.load_image(rgb.convert("L")).mode == "RGB"
    with pytest.raises(MediaTooLarge):
        MediaLoader(MediaSettings(max_image_pixels=10)).load_image(rgb)
    with pytest.raises(InvalidRequest):
        loader.load_image(b"bytes")  # type: ignore[arg-type]


def test_samples_are_deterministic() -> None:
    assert make_image((32, 32), seed=5).tobytes() == make_image((32, 32), seed=5).tobytes()
    assert make_image((32, 32), seed=5).tobytes() != make_image((32, 32), seed=6).tobytes()
    assert make_video_bytes(n_frames=4) == make_video_bytes(n_frames=4)
    assert data_uri(b"abc", "image/png") == "data:image/png;base64,YWJj"


def test_decode_errors_are_client_safe() -> None:
    cases: list[tuple[bytes, Any]] = [
        (b"\xff\xd8\xff" + b"\0" * 32, decode_image),
        (png_header_only(30000, 30000), decode_image),
        (b"RIFF\0\0\0\0AVI LIST", decode_video),
    ]
    for data, decode in cases:
        with pytest.raises(VlmqError) as info:
            decode(data, SETTINGS)
        message = info.value.to_dict()["message"]
        assert not any(m in message for m in ("<", "0x", "Error", "Traceback", "object at"))


def test_unreferenced_frames_are_skipped_between_samples_and_the_samples_are_exact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vlmq.workers.media import video as decode_module

    data = make_video_bytes(n_frames=250, size=(64, 64), fps=25, gop=50, codec="libx264")
    decoded: list[int] = []
    spend = decode_module._DecodeBudget.spend

    def counting(budget: Any) -> None:
        decoded[-1] += 1
        spend(budget)

    monkeypatch.setattr(decode_module._DecodeBudget, "spend", counting)
    videos = []
    for skip in (False, True):
        decoded.append(0)
        videos.append(decode_video(data, MediaSettings(video_skip_unreferenced=skip), fps=1.0))
    full, skipped = videos
    assert skipped.frame_indices == full.frame_indices
    assert [f.tobytes() for f in skipped.frames] == [f.tobytes() for f in full.frames]
    assert_frames_match_indices(skipped)
    assert decoded[1] < decoded[0] * 0.8  # x264's B-frames between samples were not decoded
