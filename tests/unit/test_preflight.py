"""Pre-flight estimates (``vlmq submit --dry-run``): the worker's own counts, from headers only."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from PIL import Image, ImageFile

from tests.support.samples import (
    data_uri,
    make_image,
    png_header_only,
    save_image,
    save_video,
)
from vlmq.config.jsonl import parse_line
from vlmq.config.schemas import Request
from vlmq.config.settings import EngineSettings, MediaSettings, Settings
from vlmq.config.vision import image_tokens
from vlmq.producers.preflight import FleetRates, ModelProfile, Preflight, estimate_eta
from vlmq.producers.preflight.fleet import rates_from_entries

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "internvl")


@pytest.fixture(scope="module")
def models(checkpoint: Any) -> dict[str, Path]:
    return {family: checkpoint(family) for family in FAMILIES}


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("media")
    save_image(root / "a.png", size=(64, 64), seed=1)
    save_image(root / "photo.jpg", size=(1600, 1200), seed=2, format="JPEG")  # JPEG draft
    save_image(root / "tall.png", size=(40, 300), seed=3)
    save_image(root / "big.png", size=(800, 600), seed=4)  # over the tiny models' budgets
    exif = Image.Exif()
    exif[0x0112] = 6  # a quarter turn: the worker decodes it 120 wide, 320 high
    make_image((320, 120), seed=5).save(root / "rotated.jpg", exif=exif)
    save_video(root / "clip.mp4", n_frames=16, size=(64, 64), fps=8, seed=6)
    save_video(root / "long.mp4", n_frames=96, size=(128, 96), fps=8, seed=7)
    save_video(root / "one.mp4", n_frames=1, size=(64, 48), fps=8, seed=8)
    save_video(root / "live.mkv", n_frames=24, size=(64, 48), fps=8, seed=9, live=True)
    (root / "header.png").write_bytes(png_header_only(6000, 6000))  # no pixels at all
    (root / "bomb.png").write_bytes(png_header_only(30000, 30000))
    return root


def _user(*content: Any, **fields: Any) -> Request:
    return Request.model_validate(
        {"messages": [{"role": "user", "content": list(content)}], **fields}
    )


def _image(path: Path | str) -> dict[str, str]:
    return {"type": "image", "image": str(path)}


def _video(path: Path | str, **fields: Any) -> dict[str, Any]:
    return {"type": "video", "video": str(path), **fields}


def _requests(media: Path) -> list[Request]:
    return [
        Request.model_validate(
            {
                "messages": [
                    {"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "What is a queue?"},
                    {"role": "assistant", "content": "A line of waiting work."},
                    {"role": "user", "content": "And a batch?"},
                ]
            }
        ),
        _user(_image(media / "a.png"), "What is in the picture?"),
        _user("Compare", _image(media / "photo.jpg"), "with", _image(media / "tall.png")),
        _user(_image(media / "rotated.jpg"), _image(media / "big.png"), "Which is upright?"),
        _user({"type": "image_url", "image_url": {"url": data_uri(media / "a.png")}}, "colour?"),
        _user(_image(f"file://{media / 'a.png'}"), "again"),
        _user(_video(media / "clip.mp4"), "What moves?"),
        _user(_video(media / "long.mp4", fps=4, max_frames=6), "Summarise."),
        _user(_video(media / "long.mp4"), "Summarise at the default rate."),
        _user(_video(media / "live.mkv"), "A recording without duration or cues."),
        _user(_video(media / "one.mp4"), "One frame."),
        _user(_video(media / "clip.mp4"), _video(media / "long.mp4"), "Two clips."),
        _user(_image(media / "a.png"), _video(media / "clip.mp4"), "Both."),
    ]


def _settings(model: Path, media: Path, **engine: Any) -> Settings:
    return Settings(
        model=str(model),
        media=MediaSettings(local_roots=[str(media)]),
        engine=EngineSettings(**engine),
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_estimates_equal_the_workers(family: str, models: dict[str, Path], media: Path) -> None:
    from vlmq.workers.engine import Engine

    settings = _settings(models[family], media)
    engine = Engine(str(models[family]), settings.engine, settings.media).setup()
    preflight = Preflight(settings)
    assert preflight.profile.text.exact and not preflight.profile.assumptions
    try:
        for request in _requests(media):
            prepared = engine.prepare(request)
            assert prepared.error is None, (request.messages, prepared.error)
            estimate = preflight.estimate(request)
            assert estimate.prompt_tokens == prepared.prompt_tokens, request.messages
            assert estimate.problem is None and estimate.unknown_media == 0
            frames = sum(len(v.get("video", [])) for v in _video_parts(prepared.conversation))
            assert estimate.frames == frames
    finally:
        engine.close()


def _video_parts(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for m in conversation for p in m["content"] if p["type"] == "video"]


def test_a_huge_header_is_sized_without_reading_its_pixels(
    models: dict[str, Path], media: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_decoding(self: Any) -> None:
        raise AssertionError("pixels were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    preflight = Preflight(_settings(models["qwen2_5_vl"], media))
    # 6000 x 6000 RGB would be 108 MB of pixels; the file holds none (header only).
    estimate = preflight.estimate(_user(_image(media / "header.png"), "big"))
    vision = preflight.vision
    max_pixels, _ = vision.decode_targets(video=False)
    side = int((max_pixels or 0) ** 0.5)  # decoded at the processor's pixel budget
    assert estimate.visual_tokens == image_tokens(vision, side, side)
    assert estimate.problem is None
    # One past the worker's pixel limit is refused as the worker refuses it.
    estimate = preflight.estimate(_user(_image(media / "bomb.png"), "bigger"))
    assert estimate.problem is not None and estimate.problem[0] == "media_too_large"


def _lines(media: Path) -> list[str]:
    text = {"messages": [{"role": "user", "content": "hi"}]}
    image = {"messages": [{"role": "user", "content": [_image("a.png"), "what?"]}]}
    video = {"messages": [{"role": "user", "content": [_video(media / "clip.mp4"), "what?"]}]}
    openai = {
        "custom_id": "openai",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": image["messages"], "max_tokens": 7},
    }
    remote = {"messages": [{"role": "user", "content": [_image("https://example.com/a.jpg")]}]}
    remote_video = {"messages": [{"role": "user", "content": [_video("s3://bucket/clip.mp4")]}]}
    lines = [
        {**text, "custom_id": "t1", "max_new_tokens": 10},
        {**text, "custom_id": "t2"},  # the default max_new_tokens
        {**image, "custom_id": "i1", "max_new_tokens": 20},
        openai,
        {**video, "custom_id": "v1", "max_new_tokens": 30},
        {**remote, "custom_id": "r1", "max_new_tokens": 5},
        {**remote_video, "custom_id": "r2", "max_new_tokens": 5},
        {**text, "custom_id": "over-cap", "max_new_tokens": 5000},
        {"custom_id": "missing", "messages": [{"role": "user", "content": [_image("nope.png")]}]},
        {
            "custom_id": "too-many",
            "messages": [{"role": "user", "content": [_image("a.png")] * 17}],
        },
        {"custom_id": "no-messages", "messages": []},
    ]
    encoded = [json.dumps(line) for line in lines]
    return [*encoded[:3], "{not json", "", *encoded[3:]]


def test_a_file_is_counted_line_by_line(models: dict[str, Path], media: Path) -> None:
    preflight = Preflight(_settings(models["qwen2_5_vl"], media))
    preflight.add_lines(_lines(media), base_dir=media)
    report = preflight.report()
    assert report["lines"] == 12 and report["valid_lines"] == 10  # the blank line is skipped
    invalid = report["invalid_lines"]
    assert invalid["count"] == 2
    assert [(e["line"], e["code"]) for e in invalid["first"]] == [
        (4, "invalid_request"),
        (13, "invalid_request"),
    ]
    assert "not valid JSON" in invalid["first"][0]["message"]
    assert report["modality"] == {"text": 3, "image": 5, "video": 2}
    output = report["output_tokens"]
    # Defaults and the cap as the worker applies them: 128 for t2, missing and too-many.
    assert output["total"] == 10 + 128 + 20 + 7 + 30 + 5 + 5 + 2048 + 128 + 128
    assert output["default_used"] == 3 and output["cap"] == 2048
    failures = {e["custom_id"]: e["code"] for e in report["predicted_failures"]["first"]}
    assert failures == {
        "over-cap": "invalid_request",
        "missing": "media_fetch_failed",
        "too-many": "too_many_media",
    }
    assert report["media"]["images"] == {"read": 19, "unknown": 1, "failed": 1}
    assert report["media"]["videos"] == {"read": 1, "unknown": 1, "failed": 0}
    notes = " ".join(report["assumptions"])
    assert "https URLs are not fetched" in notes and "s3 URLs are not fetched" in notes
    assert "1 image(s) as 1280x720" in notes
    prompt = report["prompt_tokens"]
    assert prompt["total"] == prompt["text"] + prompt["visual"] > 0
    assert prompt["text_method"].startswith("exact")
    assert report["eta"] == {"seconds": None, "reason": "the fleet's rate was not read"}


def test_two_halves_merge_into_the_whole(models: dict[str, Path], media: Path) -> None:
    settings = _settings(models["qwen2_5_vl"], media)
    profile = ModelProfile.load(settings.model)
    lines = _lines(media)
    whole = Preflight(settings, profile)
    whole.add_lines(lines, base_dir=media)
    first, second = Preflight(settings, profile), Preflight(settings, profile)
    for number, text in enumerate(lines, start=1):
        if text.strip():
            half = first if number <= 6 else second
            half.add(parse_line(text, number), base_dir=media)
    assert first.merge(second).report() == whole.report()


def test_without_model_files_the_estimate_says_what_it_assumed(media: Path) -> None:
    settings = _settings(media / "no-such-model", media)
    report_of = Preflight(settings)
    report_of.add_lines([json.dumps({"messages": [{"role": "user", "content": "x" * 40}]})])
    report = report_of.report()
    assert report["model"]["family"] == "qwen2_5_vl"
    assert report["prompt_tokens"]["text"] == 10  # 40 characters / 4
    assert report["prompt_tokens"]["text_method"].startswith("approximate: characters / 4")
    assert any("not found" in note for note in report["assumptions"])


# --- the fleet's rate and the ETA -------------------------------------------------------------


def _beat(modalities: list[str], at: float, rows: int, generate_s: float) -> str:
    from vlmq.workers.engine.engine import EngineStats

    # What a worker's heartbeat carries (workers/fleet/service._announce, _engine_stats).
    stats = EngineStats(rows=rows, generate_s=generate_s, real_prompt_tokens=rows * 100)
    engine = {k: v for k, v in dataclasses.asdict(stats).items() if k != "batch_sizes"}
    return json.dumps({"modalities": modalities, "pid": 1, "at": at, "engine": engine})


def test_the_eta_uses_each_workers_measured_rate() -> None:
    now = 1_000_000.0
    entries = {
        "text@a:1": _beat(["text"], now - 5, rows=200, generate_s=10.0),  # 20 tasks/s
        "image,video@b:2": _beat(["image", "video"], now - 5, rows=40, generate_s=20.0),  # 2/s
        "image@c:3": _beat(["image"], now - 500, rows=10**6, generate_s=1.0),  # stale: left out
        "video@d:4": _beat(["video"], now - 5, rows=0, generate_s=0.0),  # no batch yet
    }
    rates = rates_from_entries(entries, max_age_s=90, now=now)
    assert rates.fresh == 3 and [w.name for w in rates.workers] == ["text@a:1", "image,video@b:2"]
    assert rates.as_dict()["tasks_per_s"] == {"image": 2.0, "text": 20.0, "video": 2.0}
    eta = estimate_eta({"text": 100, "image": 10, "video": 4}, rates)
    # The text worker needs 5 s; the other runs its images (5 s) then its videos (2 s).
    assert eta["seconds"] == 7.0 and eta["per_class_s"] == {"image": 5.0, "text": 5.0, "video": 2.0}
    assert estimate_eta({"video": 1, "text": 0}, rates)["seconds"] == 0.5


def test_no_measured_rate_means_no_eta_and_says_why() -> None:
    now = 1_000_000.0
    none = rates_from_entries({}, max_age_s=90, now=now)
    assert estimate_eta({"text": 1}, none) == {"seconds": None, "reason": none.reason}
    assert "no worker" in none.reason
    idle = rates_from_entries(
        {"text@a:1": _beat(["text"], now, rows=0, generate_s=0)}, max_age_s=90, now=now
    )
    assert "none has generated yet" in estimate_eta({"text": 1}, idle)["reason"]
    text_only = rates_from_entries(
        {"text@a:1": _beat(["text"], now, rows=5, generate_s=1)}, max_age_s=90, now=now
    )
    assert estimate_eta({"video": 3}, text_only) == {
        "seconds": None,
        "reason": "no measured worker serves video",
    }
    assert estimate_eta({"text": 1}, FleetRates(reason="Redis unreachable"))["seconds"] is None


def test_preflight_imports_no_torch(models: dict[str, Path], media: Path) -> None:
    line = {
        "messages": [{"role": "user", "content": [_image("a.png"), _video(media / "clip.mp4")]}]
    }
    code = (
        "import sys, json\n"
        "from pathlib import Path\n"
        "from vlmq.config.settings import Settings\n"
        "from vlmq.producers.preflight import Preflight\n"
        "import vlmq.producers.commands\n"
        f"preflight = Preflight(Settings(model={str(models['qwen3_vl'])!r}))\n"
        f"preflight.add_lines([{json.dumps(line)!r}], base_dir=Path({str(media)!r}))\n"
        "report = preflight.report()\n"
        "assert report['media']['images']['read'] == 1, report\n"
        "assert report['media']['videos']['read'] == 1, report\n"
        "banned = {'torch', 'transformers', 'torchvision'}\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in banned\n"
        "             or m.startswith('vlmq.workers'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_an_elongated_image_fails_as_the_worker_fails_it(
    models: dict[str, Path], media: Path
) -> None:
    (media / "strip.png").write_bytes(png_header_only(4000, 10))  # 400:1
    request = _user(_image(media / "strip.png"), "?")
    refused = Preflight(_settings(models["qwen2_5_vl"], media)).estimate(request)
    assert refused.problem == ("media_decode_failed", "image aspect ratio is more than 200:1")
    # Allowed by the worker's limit, the processor still refuses it while preparing.
    settings = _settings(models["qwen2_5_vl"], media)
    settings.media.max_aspect_ratio = 1000
    prepared = Preflight(settings).estimate(request)
    assert prepared.problem == ("internal_error", "could not prepare this request")
