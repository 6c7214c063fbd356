"""Constraints, n, logprobs and penalties per row in one padded batch, on the tiny random-weight
checkpoints of all three families (CPU, fp32).

Random weights make unconstrained output gibberish, so a constrained row that parses and
validates is a strong test; an unconstrained row must give exactly the tokens it gives alone.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.samples import save_image
from tests.support.structured import check_record, mixed_lines
from vlmq.config.schemas import Request
from vlmq.config.settings import EngineSettings, MediaSettings

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "internvl")


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    save_image(root / "a.png", size=(64, 64), seed=1)
    return root


@pytest.fixture(scope="module", params=FAMILIES)
def engine(request, checkpoint, media):
    from vlmq.workers.engine import Engine

    folder = checkpoint(request.param)
    settings = EngineSettings(max_new_tokens_default=12)
    engine = Engine(str(folder), settings, MediaSettings(local_roots=[str(media)])).setup()
    yield engine
    engine.close()


def _req(text: str, image: str | None = None, **generation: Any) -> Request:
    content: list[dict] = [{"type": "text", "text": text}]
    if image:
        content.insert(0, {"type": "image", "image": image})
    return Request.model_validate(
        {"messages": [{"role": "user", "content": content}], **generation}
    )


def mixed_batch(media: Path) -> dict[str, Request]:
    return {
        line["custom_id"]: Request.model_validate(line)
        for line in mixed_lines(str(media / "a.png"))
    }


def test_one_padded_batch_honours_every_row(engine, media):
    batch = mixed_batch(media)
    outcomes = dict(zip(batch, engine.run_outcomes(list(batch.values())), strict=True))
    assert all(o.error is None for o in outcomes.values()), {
        k: o.error for k, o in outcomes.items()
    }
    for key, outcome in outcomes.items():
        check_record(key, engine.to_result(outcome).model_dump(mode="json"))
    n3 = outcomes["n3"].completion
    assert n3.completion_tokens == sum(len(c.token_ids) for c in n3.choices)
    assert engine.to_result(outcomes["choice"]).parsed is None  # not a JSON constraint

    # Unconstrained rows: exactly the tokens they give alone.
    for key in ("plain_text", "plain_image"):
        alone = engine.run_outcomes([batch[key]])[0].completion
        assert outcomes[key].completion.token_ids == alone.token_ids, key


def test_logprobs_are_the_models_log_softmax(engine, media):
    request = mixed_batch(media)["logprobs"]
    others = [
        _req("padding partner with a much longer prompt than the other one", n=2, temperature=1.0)
    ]
    outcome = engine.run_outcomes([request, *others])[0]
    result = engine.to_result(outcome)
    content = result.choices[0].logprobs["content"]
    ids = outcome.completion.token_ids
    assert len(content) == len(ids)

    # Recompute: the prompt alone (no padding) plus the generated tokens, one forward pass.
    runner = engine._runner
    inputs = runner.collate([outcome.prepared], engine.processors.primary).inputs
    prompt = inputs["input_ids"]
    full = torch.cat([prompt, torch.tensor([ids])], dim=1)
    mask = torch.ones_like(full)
    with torch.inference_mode():
        logits = engine.loaded.model(input_ids=full, attention_mask=mask).logits[0]
    start = prompt.shape[1] - 1
    expected = torch.log_softmax(logits[start : start + len(ids)].float(), dim=-1)
    for step, (token, entry) in enumerate(zip(ids, content, strict=True)):
        assert entry["logprob"] == pytest.approx(float(expected[step, token]), abs=1e-3)
        assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]
        tops = entry["top_logprobs"]
        assert len(tops) == 3
        assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert tops[0]["logprob"] == pytest.approx(entry["logprob"], abs=1e-5)


def test_seeded_completions_do_not_depend_on_batch_mates(engine):
    seeded = _req("Seeded ideas.", n=3, temperature=1.0, seed=11, max_new_tokens=10)
    alone = engine.run_outcomes([seeded])[0].completion
    crowd = [
        _req("a much longer prompt that pads the seeded request on the left", temperature=0.7),
        seeded,
        _req("Short.", n=2, temperature=1.0),
    ]
    together = engine.run_outcomes(crowd)[1].completion
    assert [c.token_ids for c in together.choices] == [c.token_ids for c in alone.choices]
    single = engine.run_outcomes(
        [_req("Seeded ideas.", temperature=1.0, seed=11, max_new_tokens=10)]
    )
    assert (
        single[0].completion.token_ids == alone.choices[0].token_ids
    )  # n=1 keeps the seed's meaning


def test_greedy_n_is_one_row_copied(engine):
    outcome = engine.run_outcomes([_req("Greedy.", n=4)])[0]
    assert outcome.prepared.rows == 1
    texts = [c.text for c in outcome.completion.choices]
    assert len(texts) == 4 and len(set(texts)) == 1


def test_penalties_change_only_their_row(engine):
    plain = _req("Repeat after me: the the the the", max_new_tokens=24)
    penalised = _req(
        "Repeat after me: the the the the",
        max_new_tokens=24,
        frequency_penalty=2.0,
        presence_penalty=2.0,
        repetition_penalty=2.0,
    )
    out_plain, out_pen = engine.run_outcomes([plain, penalised])
    ids = out_pen.completion.token_ids
    assert len(ids) == len(set(ids))  # +2 presence on near-uniform logits: never twice
    assert out_plain.completion.token_ids == engine.run_outcomes([plain])[0].completion.token_ids


def test_constraint_the_tokenizer_refuses_fails_alone(engine):
    bad = _req("Go.", grammar='start: "x" <|no_such_token|>')
    good = _req("Go.", choice=["a", "b"])
    bad_result, good_result = engine.run([bad, good])
    assert bad_result.status == "failed"
    assert bad_result.error["code"] == "invalid_request"
    assert bad_result.error["message"].startswith("grammar:")
    assert good_result.status == "succeeded" and good_result.output in ("a", "b")


def test_compiled_constraints_are_cached(engine):
    before = engine._runner.grammars.stats.compiled
    requests = [_req(f"Q{i}", regex="[a-c]{3}") for i in range(4)]
    results = engine.run(requests)
    assert all(re.fullmatch("[a-c]{3}", r.output) for r in results)
    assert engine._runner.grammars.stats.compiled - before <= 1


def test_overlapped_masks_give_the_same_tokens(engine, media):
    """The GPU path (masks for step t+1 made during its forward pass), run on the CPU."""
    batch = mixed_batch(media)
    keys = ["schema", "regex", "choice", "n3", "plain_text"]
    requests = [batch[k] for k in keys]
    in_line = engine.run_outcomes(requests)
    engine._runner.overlap_masks = True
    try:
        overlapped = engine.run_outcomes(requests)
    finally:
        engine._runner.overlap_masks = False
    for key, a, b in zip(keys, in_line, overlapped, strict=True):
        assert [c.token_ids for c in a.completion.choices] == [
            c.token_ids for c in b.completion.choices
        ], key
