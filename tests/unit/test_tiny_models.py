"""Tiny random-weight checkpoints behave like the real ones through the public HF entry points.

Each family is built once (module fixture), loaded with AutoModelForImageTextToText +
AutoProcessor, and a left-padded mixed batch (text, 1 image, 2 interleaved images, a pre-decoded
video, multi-turn) must generate, per request, exactly the tokens the request generates alone.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchvision")
pytest.importorskip("transformers")

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402
from transformers import AutoModelForImageTextToText, AutoProcessor  # noqa: E402

from vlmq.workers.demo.tiny import FAMILIES, SIZES, build_config, build_tiny_model, get_spec  # noqa: E402
from vlmq.workers.demo.tiny.builder import FAMILY_CLASSES  # noqa: E402
from vlmq.workers.demo.tiny.tokenizer import build_tokenizer  # noqa: E402

pytestmark = pytest.mark.unit

VIDEO_FPS = 2.0
N_FRAMES = 8

# Visual placeholder token each family's processor expands, and how many a 64x64 image and an
# 8-frame 64x64 video become with the compact processor presets.
PLACEHOLDER = {
    "qwen2_5_vl": "<|image_pad|>",
    "qwen3_vl": "<|image_pad|>",
    "internvl": "<IMG_CONTEXT>",
}
VIDEO_PLACEHOLDER = {
    "qwen2_5_vl": "<|video_pad|>",
    "qwen3_vl": "<|video_pad|>",
    "internvl": "<IMG_CONTEXT>",
}
EXPECTED_IMAGE_TOKENS = {"qwen2_5_vl": 16, "qwen3_vl": 16, "internvl": 16}
EXPECTED_VIDEO_TOKENS = {"qwen2_5_vl": 16, "qwen3_vl": 16, "internvl": 128}
# Published parameter counts of Qwen2.5-VL-3B, Qwen3-VL-2B, InternVL3-2B (in billions).
REAL_PARAMS_B = {"qwen2_5_vl": (3.6, 3.9), "qwen3_vl": (2.0, 2.3), "internvl": (2.0, 2.2)}


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _image(rng: np.random.Generator, width: int, height: int, colour: tuple[int, int, int]) -> Any:
    """A solid colour plus seeded noise, so different images give different pixels."""
    base = np.full((height, width, 3), colour, dtype=np.int16)
    noise = rng.integers(-40, 40, size=(height, width, 3))
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))


@pytest.fixture(scope="module")
def media() -> dict[str, Any]:
    rng = np.random.default_rng(1234)
    return {
        "red64": _image(rng, 64, 64, (200, 30, 30)),
        "blue64": _image(rng, 64, 64, (30, 30, 200)),
        "green96x80": _image(rng, 96, 80, (30, 200, 30)),
        "grey64": _image(rng, 64, 64, (128, 128, 128)),
        "frames": [_image(rng, 64, 64, (30 * i, 100, 220 - 20 * i)) for i in range(N_FRAMES)],
    }


def _requests(media: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """The mixed batch: text+system, one image, two interleaved images, video, multi-turn."""
    return [
        [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Hello there, what colour is the sky?"},
        ],
        [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": media["red64"]},
                    {"type": "text", "text": "Describe the image."},
                ],
            }
        ],
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Compare"},
                    {"type": "image", "image": media["green96x80"]},
                    {"type": "text", "text": "with"},
                    {"type": "image", "image": media["blue64"]},
                    {"type": "text", "text": "please."},
                ],
            }
        ],
        [
            {
                "role": "user",
                "content": [
                    {"type": "video", "video": media["frames"]},
                    {"type": "text", "text": "What happens in the video?"},
                ],
            }
        ],
        [
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello, how can I help?"},
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": media["grey64"]},
                    {"type": "text", "text": "Count the dots."},
                ],
            },
        ],
    ]


def _n_videos(conversation: list[dict[str, Any]]) -> int:
    return sum(
        1
        for message in conversation
        if isinstance(message["content"], list)
        for part in message["content"]
        if part.get("type") == "video"
    )


def _processor_kwargs(batch: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """padding + one metadata entry per video, in batch order; frames are used as given."""
    kwargs: dict[str, Any] = {"padding": True}
    n_videos = sum(_n_videos(conversation) for conversation in batch)
    if n_videos:
        meta = {
            "total_num_frames": N_FRAMES,
            "fps": VIDEO_FPS,
            "frames_indices": list(range(N_FRAMES)),
        }
        kwargs["video_metadata"] = [dict(meta) for _ in range(n_videos)]
        kwargs["do_sample_frames"] = False
    return kwargs


def _encode(processor: Any, batch: list[list[dict[str, Any]]]) -> Any:
    return processor.apply_chat_template(
        batch,
        tokenize=True,
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
        processor_kwargs=_processor_kwargs(batch),
    )


def _generate(model: Any, inputs: Any) -> tuple[list[list[int]], Any]:
    """Greedy 8 tokens; return the new tokens per row and the first-step raw logits."""
    with torch.inference_mode():
        out = model.generate(
            **inputs,
            max_new_tokens=8,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    new = out.sequences[:, inputs["input_ids"].shape[1] :]
    return new.tolist(), out.logits[0]


# ----------------------------------------------------------------------------------------------
# fixtures
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built(checkpoint: Any) -> dict[str, Path]:
    """The run's shared checkpoints (tests/conftest.py): what every other test loads."""
    return {family: checkpoint(family) for family in FAMILIES}


@pytest.fixture(scope="module")
def loaded(built: dict[str, Path]) -> dict[str, tuple[Any, Any]]:
    result = {}
    for family, path in built.items():
        model = AutoModelForImageTextToText.from_pretrained(
            path, dtype=torch.float32, attn_implementation="sdpa"
        ).eval()
        processor = AutoProcessor.from_pretrained(path)
        processor.tokenizer.padding_side = "left"
        result[family] = (model, processor)
    return result


# ----------------------------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_rebuild_is_byte_identical(family: str, built: dict[str, Path], tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again", family, seed=0)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _sha256(again / name) == _sha256(built[family] / name), name
    other_seed = build_tiny_model(tmp_path / "seed1", family, seed=1)
    assert _sha256(other_seed / "model.safetensors") != _sha256(built[family] / "model.safetensors")


@pytest.mark.parametrize("family", FAMILIES)
def test_loads_as_the_real_classes(family: str, loaded: dict[str, tuple[Any, Any]]) -> None:
    model, processor = loaded[family]
    classes = FAMILY_CLASSES[family]
    assert type(model) is classes.model
    assert type(processor) is classes.processor
    assert type(processor.image_processor) is classes.image_processor
    assert type(processor.video_processor) is classes.video_processor
    assert type(processor.tokenizer).__name__ == "Qwen2Tokenizer"

    tokenizer = processor.tokenizer
    assert 2000 <= len(tokenizer) <= 4096
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert model.generation_config.eos_token_id[0] == im_end
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    assert model.config.text_config.vocab_size >= len(tokenizer)
    for token in ("<|im_start|>", "<|im_end|>", PLACEHOLDER[family], VIDEO_PLACEHOLDER[family]):
        assert tokenizer.encode(token, add_special_tokens=False) == [
            tokenizer.convert_tokens_to_ids(token)
        ]
    if family == "internvl":
        assert model.config.image_token_id == tokenizer.context_image_token_id
        assert (tokenizer.start_image_token, tokenizer.end_image_token) == ("<img>", "</img>")
        assert tokenizer.video_token == "<video>"
    else:
        assert model.config.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
        assert model.config.video_token_id == tokenizer.convert_tokens_to_ids("<|video_pad|>")


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_template_matches_the_real_format(
    family: str, loaded: dict[str, tuple[Any, Any]], media: dict[str, Any]
) -> None:
    _, processor = loaded[family]
    image = {"type": "image", "image": media["red64"]}
    video = {"type": "video", "video": media["frames"]}
    conversation = [
        {"role": "user", "content": [{"type": "text", "text": "A"}, image, image, video]},
        {"role": "assistant", "content": "B"},
        {"role": "user", "content": "C"},
    ]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True)
    with_system = processor.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "C"}],
        add_generation_prompt=False,
    )
    tail = (
        "<|im_start|>assistant\nB<|im_end|>\n<|im_start|>user\nC<|im_end|>\n<|im_start|>assistant\n"
    )
    if family == "internvl":
        user = "<|im_start|>user\nA<IMG_CONTEXT>\n<IMG_CONTEXT>\n<video>\n<|im_end|>\n"
        assert text == user + tail
    else:
        img = "<|vision_start|><|image_pad|><|vision_end|>"
        vid = "<|vision_start|><|video_pad|><|vision_end|>"
        user = f"<|im_start|>user\nA{img}{img}{vid}<|im_end|>\n"
        default_system = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        assert text == (default_system if family == "qwen2_5_vl" else "") + user + tail
    assert with_system == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nC<|im_end|>\n"


@pytest.mark.parametrize("family", FAMILIES)
def test_visual_token_counts_are_modest(
    family: str, loaded: dict[str, tuple[Any, Any]], media: dict[str, Any]
) -> None:
    _, processor = loaded[family]
    frames = np.stack([np.asarray(frame) for frame in media["frames"]])  # (T, H, W, 3) uint8
    batch = [
        [{"role": "user", "content": [{"type": "image", "image": media["red64"]}]}],
        [{"role": "user", "content": [{"type": "video", "video": frames}]}],
    ]
    inputs = _encode(processor, batch)
    ids = inputs["input_ids"]
    image_id = processor.tokenizer.convert_tokens_to_ids(PLACEHOLDER[family])
    video_id = processor.tokenizer.convert_tokens_to_ids(VIDEO_PLACEHOLDER[family])
    assert int((ids[0] == image_id).sum()) == EXPECTED_IMAGE_TOKENS[family]
    assert int((ids[1] == video_id).sum()) == EXPECTED_VIDEO_TOKENS[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_batch_generates_what_each_request_generates_alone(
    family: str, loaded: dict[str, tuple[Any, Any]], media: dict[str, Any]
) -> None:
    model, processor = loaded[family]
    requests = _requests(media)
    inputs = _encode(processor, requests)
    assert (inputs["attention_mask"][:, 0] == 0).any(), "expected left padding in the batch"
    assert bool(inputs["attention_mask"][:, -1].all()), "left padding keeps the last column real"
    batch_tokens, batch_logits = _generate(model, inputs)

    for row, request in enumerate(requests):
        alone_tokens, alone_logits = _generate(model, _encode(processor, [request]))
        assert batch_tokens[row] == alone_tokens[0], f"request {row} diverged in the batch"
        torch.testing.assert_close(batch_logits[row], alone_logits[0], atol=1e-4, rtol=1e-4)

    # Random weights must not collapse to one repeated token, or the check above proves nothing.
    assert len({token for tokens in batch_tokens for token in tokens}) > 8


@pytest.mark.parametrize("family", FAMILIES)
def test_pixels_reach_the_model(
    family: str, loaded: dict[str, tuple[Any, Any]], media: dict[str, Any]
) -> None:
    model, processor = loaded[family]

    def first_logits(image: Any) -> Any:
        request = [
            {
                "role": "user",
                "content": [{"type": "image", "image": image}, {"type": "text", "text": "What?"}],
            }
        ]
        with torch.inference_mode():
            return model(**_encode(processor, [request])).logits[0, -1]

    assert not torch.allclose(first_logits(media["red64"]), first_logits(media["blue64"]))


@pytest.mark.parametrize("family", FAMILIES)
def test_real_dims_configs_construct(family: str) -> None:
    config = build_config(family, "real", build_tokenizer(family))
    with torch.device("meta"):  # no memory: shapes only
        model = FAMILY_CLASSES[family].model(config)
    params_b = sum(p.numel() for p in model.parameters()) / 1e9
    low, high = REAL_PARAMS_B[family]
    assert low <= params_b <= high


@pytest.mark.parametrize("family", ("qwen2_5_vl", "qwen3_vl"))
@pytest.mark.parametrize("size", SIZES)
def test_mrope_section_sums_to_half_head_dim(family: str, size: str) -> None:
    text = get_spec(family, size)["text"]
    head_dim = text.get("head_dim", text["hidden_size"] // text["num_attention_heads"])
    assert sum(text["rope_parameters"]["mrope_section"]) == head_dim // 2


def test_unknown_names_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="family"):
        build_tiny_model(tmp_path, "llava")
    with pytest.raises(ValueError, match="size"):
        build_tiny_model(tmp_path, "qwen3_vl", size="huge")
