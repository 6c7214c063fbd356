"""The per-row logits processors on their own: penalties against transformers' reference
processor and OpenAI's definition, min_tokens, constraint masks, logprob bookkeeping, seeds."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from vlmq.workers.engine.constraints import apply_bitmask
from vlmq.workers.engine.controls import (
    RowMinTokens,
    RowPenalties,
    RowPenalty,
    RowStopper,
    completion_seed,
)
from vlmq.workers.engine.logprobs import LogprobRecorder

VOCAB = 50


def test_repetition_penalty_matches_transformers_for_its_row_only():
    torch.manual_seed(0)
    prompt = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])  # row 0 left padded by two
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    generated = torch.tensor([[9], [9]])
    ids = torch.cat([prompt, generated], dim=1)
    scores = torch.randn(2, VOCAB)
    penalties: Any = RowPenalties([None, RowPenalty(repetition=1.7)], prompt, mask)
    penalties(prompt, scores.clone())  # step 0: nothing generated yet
    out = penalties(ids, scores.clone())
    expected = RepetitionPenaltyLogitsProcessor(1.7)(ids[1:], scores[1:].clone())
    assert torch.allclose(out[1], expected[0])
    assert torch.equal(out[0], scores[0])  # no penalty asked: untouched


def test_padding_is_not_a_prompt_token():
    prompt = torch.tensor([[0, 0, 5]])
    mask = torch.tensor([[0, 0, 1]])
    scores = torch.ones(1, VOCAB)
    penalise: Any = RowPenalties([RowPenalty(repetition=2.0)], prompt, mask)
    out = penalise(prompt, scores.clone())
    assert out[0, 0] == 1.0 and out[0, 5] == 0.5


def test_presence_and_frequency_follow_openai():
    prompt = torch.tensor([[1, 2]])
    mask = torch.ones_like(prompt)
    penalties: Any = RowPenalties([RowPenalty(presence=0.5, frequency=0.25)], prompt, mask)
    scores = torch.zeros(1, VOCAB)
    penalties(prompt, scores.clone())
    ids = prompt
    for token in (7, 7, 8):  # three generated tokens: 7 twice, 8 once
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        out = penalties(ids, scores.clone())
    # logit - count * frequency - (count > 0) * presence; prompt tokens are not counted.
    assert out[0, 7] == pytest.approx(-(2 * 0.25) - 0.5)
    assert out[0, 8] == pytest.approx(-0.25 - 0.5)
    assert out[0, 1] == 0.0


def test_min_tokens_holds_back_eos_for_its_rows_only():
    processor: Any = RowMinTokens([2, 0], eos_ids=[3, 4])
    for step in range(3):
        out = processor(torch.zeros(2, step + 1, dtype=torch.long), torch.zeros(2, VOCAB))
        held = bool(torch.isinf(out[0, 3])) and bool(torch.isinf(out[0, 4]))
        assert held == (step < 2)
        assert not torch.isinf(out[1]).any()


def test_stop_strings_do_not_count_before_min_tokens():
    stopper: Any = RowStopper(1, [10], [["ab"]], lambda ids: "ab" * len(ids), min_tokens=[3])
    ids = torch.zeros(1, 1, dtype=torch.long)
    ended = []
    for _ in range(4):
        ids = torch.cat([ids, torch.zeros(1, 1, dtype=torch.long)], dim=1)
        ended.append(bool(stopper(ids, None)[0]))
    assert ended == [False, False, False, True]


def test_bitmask_keeps_exactly_the_allowed_tokens_of_its_rows():
    scores = torch.zeros(3, 70)
    bitmask = torch.zeros(1, 3, dtype=torch.int32)
    for token in (0, 31, 33, 69):
        word, bit = divmod(token, 32)
        bitmask[0, word] |= torch.tensor(1 << bit, dtype=torch.int64).to(torch.int32)
    apply_bitmask(scores, torch.tensor([1]), bitmask)
    allowed = torch.nonzero(~torch.isinf(scores[1])).flatten().tolist()
    assert allowed == [0, 31, 33, 69]
    assert not torch.isinf(scores[0]).any() and not torch.isinf(scores[2]).any()


def test_logprob_recorder_takes_each_steps_chosen_token():
    recorder: Any = LogprobRecorder([None, 2])
    step_scores = [torch.randn(2, VOCAB) for _ in range(3)]
    chosen = torch.tensor([[4, 5, 6], [7, 8, 9]])
    ids = torch.zeros(2, 1, dtype=torch.long)
    for step, scores in enumerate(step_scores):
        recorder(ids, scores.clone())
        ids = torch.cat([ids, chosen[:, step : step + 1]], dim=1)
    recorded = recorder.finish(chosen)
    assert list(recorded) == [1]
    for step, entry in enumerate(recorded[1]):
        expected = torch.log_softmax(step_scores[step][1], dim=-1)
        assert entry["logprob"] == pytest.approx(float(expected[chosen[1, step]]), abs=1e-6)
        top = torch.topk(expected, 2)
        assert [i for i, _ in entry["top"]] == top.indices.tolist()


def test_completion_seeds():
    assert completion_seed(42, 0) == 42
    seeds = {completion_seed(42, i) for i in range(16)}
    assert len(seeds) == 16 and all(0 <= s < 2**63 for s in seeds)
    assert completion_seed(42, 3) == completion_seed(42, 3)
