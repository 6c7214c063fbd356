from __future__ import annotations

import pytest
from pydantic import ValidationError

from vlmq.config.schemas import GenerationParams, Modality, Request


def _request(content, **kw):
    return Request.model_validate({"messages": [{"role": "user", "content": content}], **kw})


def test_string_content_becomes_a_text_part():
    request = _request("hello")
    assert request.messages[0].content[0].type == "text"
    assert request.modality is Modality.TEXT


def test_hf_parts_with_every_source_key_are_normalised():
    request = _request(
        [
            {"type": "image", "image": "a.png"},
            {"type": "image", "url": "file:///tmp/b.png"},
            {"type": "image", "path": "c.png"},
            {"type": "text", "text": "compare"},
        ]
    )
    sources = [p.source for p in request.parts("image")]
    assert sources == ["a.png", "file:///tmp/b.png", "c.png"]
    assert request.modality is Modality.IMAGE


def test_openai_image_url_and_video_url_parts_are_normalised():
    request = _request(
        [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}},
            {"type": "text", "text": "describe"},
        ]
    )
    assert request.parts("image")[0].source.startswith("data:image/png")
    assert request.parts("video")[0].source == "https://example.com/v.mp4"
    assert request.modality is Modality.VIDEO


def test_modality_is_video_over_image_over_text():
    assert _request([{"type": "image", "image": "x"}]).modality is Modality.IMAGE
    mixed = _request([{"type": "image", "image": "x"}, {"type": "video", "video": "y"}])
    assert mixed.modality is Modality.VIDEO


def test_unknown_part_type_names_the_field():
    with pytest.raises(ValidationError) as info:
        _request([{"type": "audio", "audio": "x"}])
    assert "unknown content part type" in str(info.value)


def test_media_part_without_source_is_rejected():
    with pytest.raises(ValidationError):
        _request([{"type": "image"}])


def test_generation_fields_are_lifted_from_the_top_level():
    request = _request("hi", max_new_tokens=7, temperature=0.5, stop="END", seed=3)
    assert request.generation.max_new_tokens == 7
    assert request.generation.stop == ["END"]
    assert request.generation.sampling is True


@pytest.mark.parametrize("stop", ["", "\ud800", ["ok", "a\udfffb"]])
def test_stop_strings_that_cannot_be_matched_are_refused(stop):
    """A row's text is matched as UTF-8 bytes; a lone surrogate has none."""
    with pytest.raises(ValidationError, match="stop strings"):
        _request("hi", stop=stop)


def test_openai_max_tokens_alias():
    assert _request("hi", max_tokens=5).generation.max_new_tokens == 5


def test_greedy_by_default():
    assert GenerationParams().sampling is False
    assert GenerationParams(temperature=0).sampling is False
    assert GenerationParams(temperature=0.7, do_sample=False).sampling is False


def test_a_conversation_needs_a_user_turn():
    with pytest.raises(ValidationError):
        Request.model_validate({"messages": [{"role": "system", "content": "x"}]})


def test_multi_turn_with_system_prompt():
    request = Request.model_validate(
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": [{"type": "text", "text": "again"}]},
            ]
        }
    )
    assert [m.role for m in request.messages] == ["system", "user", "assistant", "user"]


def test_requests_round_trip_through_json():
    request = _request(
        [{"type": "video", "video": "v.mp4", "fps": 1, "max_frames": 8}],
        custom_id="c1",
        max_new_tokens=3,
    )
    again = Request.model_validate_json(request.model_dump_json())
    assert again == request


def test_relative_local_paths_resolve_against_a_base(tmp_path):
    request = _request(
        [
            {"type": "image", "image": "media/a.png"},
            {"type": "image", "image": "/abs/b.png"},
            {"type": "image", "image": "https://example.com/c.png"},
            {"type": "video", "video": "file:///d.mp4"},
        ]
    )
    sources = [p.source for m in request.resolve_local_paths(tmp_path).messages for p in m.content]
    assert sources == [
        str(tmp_path / "media/a.png"),
        "/abs/b.png",
        "https://example.com/c.png",
        "file:///d.mp4",
    ]
