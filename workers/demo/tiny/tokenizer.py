"""A small byte-level BPE tokenizer, trained offline, wrapped as the families' real tokenizer class.

Real Qwen / InternVL3-hf checkpoints ship a ``Qwen2Tokenizer`` (byte-level BPE with Qwen2's
pre-tokenizer regex). We train the same pipeline on ``corpus.txt`` (a few thousand merges, in
milliseconds) so that the tokenizer behaves like the real one: same normalizer, pre-tokenizer,
decoder, special-token handling and class, only a much smaller vocabulary.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import Qwen2Tokenizer
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

# Target size of the trained BPE vocabulary. The corpus saturates a little above 2k entries at
# min_frequency=2, which is what we get; the cap only matters if the corpus grows.
BPE_VOCAB_SIZE = 3000
MODEL_MAX_LENGTH = 32768

Merge = tuple[str, str]

# Qwen2.5-VL / Qwen3-VL special tokens, in the order of the real ids 151643..151656.
QWEN_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# InternVLProcessor reads these four attributes from the tokenizer (named special tokens).
INTERNVL_NAMED_TOKENS: dict[str, str] = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}
# The other tokens InternVL3-hf adds on top of the Qwen2.5 tokenizer.
INTERNVL_EXTRA_TOKENS: tuple[str, ...] = (
    "<quad>",
    "</quad>",
    "<ref>",
    "</ref>",
    "<box>",
    "</box>",
)

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"


def corpus_text() -> str:
    """Return the committed training corpus (shipped as package data)."""
    return (
        resources.files("vlmq.workers.demo.tiny").joinpath("corpus.txt").read_text(encoding="utf-8")
    )


def _bpe_pipeline() -> Tokenizer:
    """An empty BPE tokenizer with exactly the normalizer/pre-tokenizer Qwen2Tokenizer builds."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train_bpe(text: str, vocab_size: int = BPE_VOCAB_SIZE) -> tuple[dict[str, int], list[Merge]]:
    """Train byte-level BPE on ``text``; return (vocab, merges) without any special token.

    The byte alphabet is always included, so any input (any language, any byte) stays encodable.
    Training is deterministic (merges are chosen by count, ties broken by pair ids): the same
    corpus gives the same tokenizer.json in every process.
    """
    tok = _bpe_pipeline()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    vocab = dict(sorted(tok.get_vocab().items(), key=lambda item: item[1]))
    return vocab, _merges_of(tok)


def _merges_of(tok: Tokenizer) -> list[Merge]:
    """Extract the merge list from a trained BPE tokenizer's serialized form.

    tokenizers >= 0.20 serializes merges as pairs, older versions as "a b" strings.
    """
    merges: list[Merge] = []
    for merge in json.loads(tok.to_str())["model"]["merges"]:
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        merges.append((left, right))
    return merges


def family_special_tokens(family: str) -> list[str]:
    """All special tokens of a family, in id order (appended after the BPE vocabulary)."""
    tokens = list(QWEN_SPECIAL_TOKENS)
    if family == "internvl":
        tokens += list(INTERNVL_NAMED_TOKENS.values()) + list(INTERNVL_EXTRA_TOKENS)
    return tokens


def build_tokenizer(family: str, chat_template: str | None = None) -> Qwen2Tokenizer:
    """Train the BPE and wrap it as ``Qwen2Tokenizer`` with the family's special tokens.

    Special tokens are put into the vocabulary ourselves, after the BPE entries (as in the real
    checkpoints), so their ids are fixed and do not depend on the order in which
    ``Qwen2Tokenizer`` registers eos/pad.
    """
    vocab, merges = train_bpe(corpus_text())
    specials = family_special_tokens(family)
    base = len(vocab)
    for i, token in enumerate(specials):
        vocab[token] = base + i

    kwargs: dict[str, Any] = {
        "vocab": vocab,
        "merges": merges,
        "unk_token": None,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "model_max_length": MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
    }
    if family == "internvl":
        kwargs["extra_special_tokens"] = dict(INTERNVL_NAMED_TOKENS)
    tokenizer = Qwen2Tokenizer(**kwargs)

    named = set(INTERNVL_NAMED_TOKENS.values()) if family == "internvl" else set()
    rest = [t for t in specials if t not in named and t not in (EOS_TOKEN, PAD_TOKEN)]
    tokenizer.add_special_tokens({"extra_special_tokens": rest}, replace_extra_special_tokens=False)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    _check_ids(tokenizer, vocab, specials)
    return tokenizer


def _check_ids(tokenizer: Qwen2Tokenizer, vocab: dict[str, int], specials: list[str]) -> None:
    """Fail loudly if wrapping moved a special token or failed to mark it special."""
    for token in specials:
        ids = tokenizer.encode(token, add_special_tokens=False)
        if ids != [vocab[token]]:
            raise RuntimeError(f"special token {token!r} encodes to {ids}, expected {vocab[token]}")
