"""xgrammar vs llguidance on vlmq's tokenizers: the measurement behind the choice (issue 13).

For each engine and each tokenizer (a tiny checkpoint's, ~3k tokens, and optionally a
151,643-token byte-level BPE trained here, Qwen's vocabulary size):

* tokenizer info: built once per model;
* compile, cold: a constraint seen for the first time (JSON schema, json_object, a date
  regex, a choice list, a Lark grammar);
* per request once compiled: what a row pays to get a matcher of an already compiled
  constraint (xgrammar: a GrammarMatcher over the cached CompiledGrammar; llguidance: a
  deep copy of a template matcher);
* per-token mask at batch 16: 16 matchers of mixed constraints walk forward together, one
  random allowed token each per step; the figure is the time to fill the 16 rows' bitmask
  per step, then to accept the 16 tokens.

    python -m bench.grammar_engines [--vocab PATH/tokenizer.json] [--steps 64] [--repeats 3]

The engines run on the CPU only (the bitmask is filled on the host in both), so the
figures transfer to a GPU worker's host.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "category": {"enum": ["shoe", "shirt", "hat", "bag"]},
        "price": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "size": {
            "type": "object",
            "properties": {"w": {"type": "integer"}, "h": {"type": "integer"}},
            "required": ["w", "h"],
        },
    },
    "required": ["name", "category", "tags", "size"],
}
DATE = r"\d{4}-\d{2}-\d{2}"
CHOICE = ["cat", "dog", "bird", "none of these"]
LARK = 'start: "yes" | "no" | "maybe " NUMBER\nNUMBER: /[0-9]+/'


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - started


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab: int, stops: list[int]) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info, self.info_s = _timed(
            lambda: xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=vocab, stop_token_ids=stops
            )
        )
        self.vocab = vocab
        self.batch = xgr.BatchGrammarMatcher(max_threads=2)

    def compiler(self) -> Any:
        return self.xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=True)

    def compile(self, compiler: Any, kind: str) -> Any:
        if kind == "schema":
            return compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
        if kind == "json_object":
            return compiler.compile_builtin_json_grammar()
        if kind == "regex":
            return compiler.compile_regex(DATE)
        if kind == "choice":
            return compiler.compile_regex("|".join(_escape(c) for c in CHOICE))
        return compiler.compile_lark(LARK)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, rows: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(rows, self.vocab)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def done(self, matcher: Any) -> bool:
        return bool(matcher.is_terminated())


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab: int, stops: list[int]) -> None:
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        self.tok, self.info_s = _timed(
            lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=stops[0])
        )
        self.vocab = vocab
        self.executor = llguidance.LLExecutor(num_threads=2)

    def compiler(self) -> None:
        return None

    def compile(self, compiler: Any, kind: str) -> Any:
        m = self.llg.LLMatcher
        grammar = {
            "schema": lambda: m.grammar_from_json_schema(
                SCHEMA, defaults={"whitespace_flexible": False}
            ),
            "json_object": lambda: m.grammar_from_json_schema(
                {"type": "object"}, defaults={"whitespace_flexible": False}
            ),
            "regex": lambda: m.grammar_from_regex(DATE),
            "choice": lambda: m.grammar_from_regex("|".join(_escape(c) for c in CHOICE)),
            "lark": lambda: m.grammar_from_lark(LARK),
        }[kind]()
        matcher = m(self.tok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        # The first mask is where llguidance builds its lexer: part of compiling.
        matcher.compute_bitmask()
        matcher.reset()
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def bitmask(self, rows: int) -> torch.Tensor:
        return torch.full((rows, (self.vocab + 31) // 32), -1, dtype=torch.int32)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        pairs = [(m, i) for i, m in enumerate(matchers)]
        self.executor.unsafe_compute_mask_ptr(
            pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0]
        )

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))

    def done(self, matcher: Any) -> bool:
        return bool(matcher.is_stopped())


def _escape(text: str) -> str:
    return "".join("\\" + ch if ch in r"\.^$|?*+()[]{}/" else ch for ch in text)


def _allowed(bitmask_row: torch.Tensor, vocab: int) -> list[int]:
    bits = (bitmask_row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return torch.nonzero(bits.reshape(-1)[:vocab]).flatten().tolist()


KINDS = ("schema", "json_object", "regex", "choice", "lark")


def measure(engine: Any, steps: int, rows: int = 16) -> dict[str, Any]:
    compiler = engine.compiler()
    cold: dict[str, float] = {}
    compiled: dict[str, Any] = {}
    for kind in KINDS:
        compiled[kind], cold[kind] = _timed(partial(engine.compile, compiler, kind))
    _, cached_compile = _timed(lambda: engine.compile(compiler, "schema"))
    _, per_request = _timed(lambda: [engine.matcher(compiled["schema"]) for _ in range(100)])
    kinds = [KINDS[i % len(KINDS)] for i in range(rows)]
    matchers = [engine.matcher(compiled[k]) for k in kinds]
    bitmask = engine.bitmask(rows)
    rng = random.Random(0)
    fill_s = accept_s = 0.0
    for _ in range(steps):
        _, took = _timed(lambda: engine.fill(matchers, bitmask))
        fill_s += took
        tokens = []
        for i in range(rows):
            allowed = _allowed(bitmask[i], engine.vocab)
            tokens.append(rng.choice(allowed) if allowed else 0)
        started = time.perf_counter()
        for i, matcher in enumerate(matchers):
            engine.accept(matcher, tokens[i])
        accept_s += time.perf_counter() - started
        for i, matcher in enumerate(matchers):
            if engine.done(matcher):
                matchers[i] = engine.matcher(compiled[kinds[i]])
    return {
        "tokenizer_info_s": engine.info_s,
        "compile_cold_ms": {k: round(v * 1000, 2) for k, v in cold.items()},
        "compile_cached_ms": round(cached_compile * 1000, 3),
        "matcher_per_request_us": round(per_request / 100 * 1e6, 1),
        "mask_batch16_us_per_step": round(fill_s / steps * 1e6, 1),
        "accept_batch16_us_per_step": round(accept_s / steps * 1e6, 1),
    }


def _tiny_tokenizer(family: str) -> Any:
    from transformers import AutoTokenizer

    from vlmq.workers.demo.tiny import build_tiny_model

    folder = Path(tempfile.mkdtemp()) / family
    build_tiny_model(folder, family)
    return AutoTokenizer.from_pretrained(folder)


def _file_tokenizer(path: str) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=path, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", default="qwen2_5_vl")
    parser.add_argument("--vocab", help="a tokenizer.json with a large vocabulary")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizers = {f"tiny {args.family}": _tiny_tokenizer(args.family)}
    if args.vocab:
        tokenizers["151k BPE"] = _file_tokenizer(args.vocab)
    report: dict[str, Any] = {}
    for label, tokenizer in tokenizers.items():
        vocab = max(len(tokenizer), 64)
        vocab = (vocab + 63) // 64 * 64
        stops = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
        for cls in (Xgrammar, Llguidance):
            runs = [measure(cls(tokenizer, vocab, stops), args.steps) for _ in range(args.repeats)]
            report[f"{label} / {cls.name}"] = {"vocab": vocab, "runs": runs}
            _print(label, cls.name, vocab, runs)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):g} ({min(values):g}-{max(values):g})"


def _print(label: str, engine: str, vocab: int, runs: list[dict[str, Any]]) -> None:
    print(f"\n## {label} (vocab {vocab}) / {engine}: median (min-max) of {len(runs)} runs")
    print(f"tokenizer info: {_spread([round(r['tokenizer_info_s'] * 1000, 1) for r in runs])} ms")
    for kind in KINDS:
        print(f"compile cold {kind}: {_spread([r['compile_cold_ms'][kind] for r in runs])} ms")
    for key in (
        "compile_cached_ms",
        "matcher_per_request_us",
        "mask_batch16_us_per_step",
        "accept_batch16_us_per_step",
    ):
        print(f"{key}: {_spread([r[key] for r in runs])}")


if __name__ == "__main__":
    main()
