"""Per-family, per-size dimensions of the tiny checkpoints.

Every size is just a dict of overrides applied on top of the real config classes, so a new size
(for instance the published dimensions of a real checkpoint) is one more entry here, not new code.

Each entry has these sections (all plain dicts, copied before use):

- ``text``: kwargs of the family's text config (``Qwen2_5_VLTextConfig``, ``Qwen3VLTextConfig``,
  ``Qwen2Config``). ``vocab_size: None`` means "as many rows as the trained tokenizer needs".
- ``vision``: kwargs of the family's vision config.
- ``top``: kwargs of the top-level config (``Qwen2_5_VLConfig`` ...), besides token ids.
- ``image_processor`` / ``video_processor``: kwargs of the image and video processor. The compact
  presets keep the real resizing/tiling logic but cap the number of visual tokens, so CPU tests
  see tens of visual tokens per image instead of hundreds.
- ``processor``: extra kwargs of the processor (``image_seq_length`` for InternVL).
"""

from __future__ import annotations

import copy
from typing import Any

FAMILIES: tuple[str, ...] = ("qwen2_5_vl", "qwen3_vl", "internvl")
SIZES: tuple[str, ...] = ("tiny", "small", "real")

Spec = dict[str, dict[str, Any]]

# Mean/std used by the real checkpoints (CLIP for Qwen2.5-VL, 0.5 for Qwen3-VL, ImageNet for
# InternVL3-hf).
_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
_HALF = [0.5, 0.5, 0.5]
_IMAGENET_MEAN = [0.485, 0.456, 0.406]
_IMAGENET_STD = [0.229, 0.224, 0.225]

# ---------------------------------------------------------------------------------------------
# Processor presets. "compact" is shared by tiny and small so both sizes see the same prompts.
# ---------------------------------------------------------------------------------------------

# Qwen2.5-VL: factor 28 (patch 14 x merge 2). Images get 16..64 visual tokens; video frames get
# 4..16 tokens per 2-frame temporal patch (a 64x64 frame becomes 56x56: 4 tokens).
_QWEN25_COMPACT_PROC: Spec = {
    "image_processor": {
        "size": {"shortest_edge": 112 * 112, "longest_edge": 28 * 28 * 64},
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": _CLIP_MEAN,
        "image_std": _CLIP_STD,
    },
    "video_processor": {
        "size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 16},
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": _CLIP_MEAN,
        "image_std": _CLIP_STD,
        "cap_pixels_per_frame": True,
    },
}
_QWEN25_REAL_PROC: Spec = {
    "image_processor": {
        "size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 16384},
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": _CLIP_MEAN,
        "image_std": _CLIP_STD,
    },
    "video_processor": {
        "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28},
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": _CLIP_MEAN,
        "image_std": _CLIP_STD,
        "cap_pixels_per_frame": True,
    },
}

# Qwen3-VL: factor 32 (patch 16 x merge 2). The video size is a budget over all frames
# (t * h * w), as in the real processor. do_sample_frames/fps stay at the real defaults (True, 2).
_QWEN3_COMPACT_PROC: Spec = {
    "image_processor": {
        "size": {"shortest_edge": 128 * 128, "longest_edge": 32 * 32 * 64},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": _HALF,
        "image_std": _HALF,
    },
    "video_processor": {
        "size": {"shortest_edge": 4096, "longest_edge": 32 * 32 * 4 * 32},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": _HALF,
        "image_std": _HALF,
        "fps": 2,
        "min_frames": 4,
        "max_frames": 768,
        "do_sample_frames": True,
        "cap_pixels_per_frame": True,
    },
}
_QWEN3_REAL_PROC: Spec = {
    "image_processor": {
        "size": {"shortest_edge": 65536, "longest_edge": 16777216},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": _HALF,
        "image_std": _HALF,
    },
    "video_processor": {
        "size": {"shortest_edge": 4096, "longest_edge": 25165824},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": _HALF,
        "image_std": _HALF,
        "fps": 2,
        "min_frames": 4,
        "max_frames": 768,
        "do_sample_frames": True,
        "cap_pixels_per_frame": True,
    },
}

# InternVL: 112x112 tiles (instead of 448) and at most 4 tiles + thumbnail, 16 tokens per tile
# (instead of 256). The vision tower's image_size must equal the tile size.
_INTERNVL_COMPACT_PROC: Spec = {
    "image_processor": {
        "size": {"height": 112, "width": 112},
        "crop_to_patches": True,
        "min_patches": 1,
        "max_patches": 4,
        "image_mean": _IMAGENET_MEAN,
        "image_std": _IMAGENET_STD,
    },
    "video_processor": {
        "size": {"height": 112, "width": 112},
        "image_mean": _IMAGENET_MEAN,
        "image_std": _IMAGENET_STD,
    },
    "processor": {"image_seq_length": 16},
}
_INTERNVL_REAL_PROC: Spec = {
    "image_processor": {
        "size": {"height": 448, "width": 448},
        "crop_to_patches": True,
        "min_patches": 1,
        "max_patches": 12,
        "image_mean": _IMAGENET_MEAN,
        "image_std": _IMAGENET_STD,
    },
    "video_processor": {
        "size": {"height": 448, "width": 448},
        "image_mean": _IMAGENET_MEAN,
        "image_std": _IMAGENET_STD,
    },
    "processor": {"image_seq_length": 256},
}

# ---------------------------------------------------------------------------------------------
# Model dimensions.
# ---------------------------------------------------------------------------------------------

_QWEN25: dict[str, Spec] = {
    "tiny": {
        "text": {
            "vocab_size": None,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            # head_dim 16 -> mrope_section must sum to 8.
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e6,
                "mrope_section": [2, 3, 3],
            },
        },
        "vision": {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [1],
            "tokens_per_second": 2,
        },
        "top": {"tie_word_embeddings": False},
        **_QWEN25_COMPACT_PROC,
    },
    "small": {
        "text": {
            "vocab_size": None,
            "hidden_size": 512,
            "intermediate_size": 1536,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            # head_dim 64 -> sum 32, same 2:3:3 split as the real [16, 24, 24].
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e6,
                "mrope_section": [8, 12, 12],
            },
        },
        "vision": {
            "depth": 2,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_heads": 4,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [1],
            "tokens_per_second": 2,
        },
        "top": {"tie_word_embeddings": False},
        **_QWEN25_COMPACT_PROC,
    },
    # Qwen/Qwen2.5-VL-3B-Instruct config.json (published dimensions).
    "real": {
        "text": {
            "vocab_size": 151936,
            "hidden_size": 2048,
            "intermediate_size": 11008,
            "num_hidden_layers": 36,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "max_position_embeddings": 128000,
            "rms_norm_eps": 1e-6,
            "sliding_window": 32768,
            "max_window_layers": 70,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e6,
                "mrope_section": [16, 24, 24],
            },
        },
        "vision": {
            "depth": 32,
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31],
            "tokens_per_second": 2,
            "hidden_act": "silu",
        },
        "top": {"tie_word_embeddings": True},
        **_QWEN25_REAL_PROC,
    },
}

_QWEN3: dict[str, Spec] = {
    "tiny": {
        "text": {
            "vocab_size": None,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5e6,
                "mrope_section": [4, 2, 2],
                "mrope_interleaved": True,
            },
        },
        "vision": {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 256,
            "deepstack_visual_indexes": [0],
        },
        "top": {"tie_word_embeddings": False},
        **_QWEN3_COMPACT_PROC,
    },
    "small": {
        "text": {
            "vocab_size": None,
            "hidden_size": 512,
            "intermediate_size": 1536,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 64,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5e6,
                "mrope_section": [12, 10, 10],
                "mrope_interleaved": True,
            },
        },
        "vision": {
            "depth": 2,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_heads": 4,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 256,
            "deepstack_visual_indexes": [0, 1],
        },
        "top": {"tie_word_embeddings": False},
        **_QWEN3_COMPACT_PROC,
    },
    # Qwen/Qwen3-VL-2B-Instruct config.json (published dimensions).
    "real": {
        "text": {
            "vocab_size": 151936,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5e6,
                "mrope_section": [24, 20, 20],
                "mrope_interleaved": True,
            },
        },
        "vision": {
            "depth": 24,
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_heads": 16,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [5, 11, 17],
            "hidden_act": "gelu_pytorch_tanh",
        },
        "top": {"tie_word_embeddings": True},
        **_QWEN3_REAL_PROC,
    },
}

_INTERNVL: dict[str, Spec] = {
    "tiny": {
        "text": {
            "model_type": "qwen2",
            "vocab_size": None,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        },
        "vision": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": [112, 112],
            "patch_size": [14, 14],
            "attention_bias": True,
        },
        "top": {"downsample_ratio": 0.5, "image_seq_length": 16, "tie_word_embeddings": False},
        **_INTERNVL_COMPACT_PROC,
    },
    "small": {
        "text": {
            "model_type": "qwen2",
            "vocab_size": None,
            "hidden_size": 512,
            "intermediate_size": 1536,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        },
        "vision": {
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "image_size": [112, 112],
            "patch_size": [14, 14],
            "attention_bias": True,
        },
        "top": {"downsample_ratio": 0.5, "image_seq_length": 16, "tie_word_embeddings": False},
        **_INTERNVL_COMPACT_PROC,
    },
    # OpenGVLab/InternVL3-2B-hf config.json (published dimensions: Qwen2.5-1.5B text model,
    # InternViT-300M-448px-V2.5 vision tower), as best known.
    "real": {
        "text": {
            "model_type": "qwen2",
            "vocab_size": 151674,
            "hidden_size": 1536,
            "intermediate_size": 8960,
            "num_hidden_layers": 28,
            "num_attention_heads": 12,
            "num_key_value_heads": 2,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        },
        "vision": {
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_hidden_layers": 24,
            "num_attention_heads": 16,
            "image_size": [448, 448],
            "patch_size": [14, 14],
            "attention_bias": True,
            "use_qk_norm": False,
            "layer_scale_init_value": 0.1,
            "norm_type": "layer_norm",
            "hidden_act": "gelu",
        },
        "top": {"downsample_ratio": 0.5, "image_seq_length": 256, "tie_word_embeddings": False},
        **_INTERNVL_REAL_PROC,
    },
}

_SPECS: dict[str, dict[str, Spec]] = {
    "qwen2_5_vl": _QWEN25,
    "qwen3_vl": _QWEN3,
    "internvl": _INTERNVL,
}


def get_spec(family: str, size: str) -> Spec:
    """Return a deep copy of the overrides for one family and size, so callers may mutate it."""
    if family not in _SPECS:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    if size not in _SPECS[family]:
        raise ValueError(f"unknown size {size!r} for {family}; expected one of {SIZES}")
    return copy.deepcopy(_SPECS[family][size])
