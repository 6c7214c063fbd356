"""The batch engine on tiny offline checkpoints of all three families (CPU, fp32)."""

from __future__ import annotations

import pytest

from tests.support.faults.inject import Faults, injected
from tests.support.samples import data_uri, save_image, save_video
from vlmq.config.schemas import Request
from vlmq.config.settings import DecodeSettings, EngineSettings, MediaSettings

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "internvl")


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    save_image(root / "a.png", size=(64, 64), seed=1)
    save_image(root / "b.jpg", size=(96, 80), seed=2, format="JPEG")
    save_video(root / "v.mp4", n_frames=16, size=(64, 64), fps=8, seed=3)
    (root / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10)
    return root


@pytest.fixture(scope="module", params=FAMILIES)
def model_dir(request, checkpoint):
    return checkpoint(request.param)


def _engine(model_dir, media, **engine_fields):
    from vlmq.workers.engine import Engine

    settings = EngineSettings(max_new_tokens_default=8, **engine_fields)
    return Engine(str(model_dir), settings, MediaSettings(local_roots=[str(media)])).setup()


def _req(content, **kw):
    return Request.model_validate({"messages": [{"role": "user", "content": content}], **kw})


def mixed_batch(media):
    return [
        Request.model_validate(
            {
                "messages": [
                    {"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "Tell me about queues and batches."},
                ]
            }
        ),
        _req(
            [
                {"type": "image", "image": str(media / "a.png")},
                {"type": "text", "text": "What is in the picture?"},
            ]
        ),
        _req(
            [
                {"type": "text", "text": "Compare"},
                {"type": "image", "url": f"file://{media / 'a.png'}"},
                {"type": "text", "text": "with"},
                {"type": "image_url", "image_url": {"url": str(media / "b.jpg")}},
            ]
        ),
        _req(
            [
                {"type": "video", "video": str(media / "v.mp4"), "fps": 4, "max_frames": 8},
                {"type": "text", "text": "What happens?"},
            ],
            max_new_tokens=6,
        ),
        Request.model_validate(
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "image": str(media / "b.jpg")},
                            {"type": "text", "text": "Describe it."},
                        ],
                    },
                    {"role": "assistant", "content": "A picture of shapes."},
                    {"role": "user", "content": "Which colours?"},
                ],
                "max_new_tokens": 10,
            }
        ),
    ]


def test_padded_batch_gives_each_request_its_solo_tokens(model_dir, media):
    # One padded micro-batch of five (in flight, micro-batches are an eighth of the slots).
    engine = _engine(model_dir, media, decode=DecodeSettings(inflight=False))
    batch = mixed_batch(media)
    together = engine.run_outcomes(batch)
    assert [o.error for o in together] == [None] * len(batch)
    assert {o.completion.batch_size for o in together} == {len(batch)}
    for request, outcome in zip(batch, together, strict=True):
        alone = engine.run_outcomes([request])[0]
        assert alone.completion.batch_size == 1
        assert outcome.completion.token_ids == alone.completion.token_ids, request.modality
        limit = request.generation.max_new_tokens or 8
        assert 1 <= len(outcome.completion.token_ids) <= limit
    # The comparison can fail: different prompts give different outputs.
    assert len({tuple(o.completion.token_ids) for o in together}) > 1
    assert all(0 < o.completion.padding_ratio < 1 for o in together)


def test_collation_pads_on_the_left(model_dir, media):
    engine = _engine(model_dir, media)
    prepared = [engine.prepare(r) for r in mixed_batch(media)]
    inputs = engine.collate(prepared).inputs
    mask = inputs["attention_mask"]
    assert engine.loaded.tokenizer.padding_side == "left"
    assert bool(mask[:, -1].all())  # every row ends at the last position
    assert not bool(mask[:, 0].all())  # shorter rows start with padding
    for row in mask.tolist():  # padding is one block on the left
        first = row.index(1)
        assert all(row[first:])
    # The estimate used for batching is exact for the text and close for media.
    for item, real in zip(prepared, mask.sum(dim=1).tolist(), strict=True):
        assert abs(item.prompt_tokens - real) <= max(4, real * 0.1), (item.prompt_tokens, real)


@pytest.mark.parametrize("family", ["qwen2_5_vl"])
def test_bad_media_fails_only_its_request(family, media, checkpoint):
    model = checkpoint(family)
    engine = _engine(model, media)
    batch = [
        _req("fine"),
        _req([{"type": "image", "image": str(media / "missing.png")}]),
        _req([{"type": "image", "image": str(media / "broken.png")}]),
        _req([{"type": "image", "image": "/etc/passwd"}]),
        _req([{"type": "image_url", "image_url": {"url": data_uri(media / "a.png")}}]),
        _req([{"type": "image", "image": "data:image/png;base64,!!!notbase64"}]),
        _req([{"type": "image", "image": str(media / "a.png")}] * 20),
    ]
    results = engine.run(batch)
    codes = [r.error["code"] if r.error else None for r in results]
    assert codes[0] is None and codes[4] is None
    assert codes[1] == "media_fetch_failed"
    assert codes[2] == "media_decode_failed"
    assert codes[3] == "media_forbidden"
    assert codes[5] in ("media_decode_failed", "invalid_request")
    assert codes[6] == "too_many_media"
    for result in results:
        if result.error:
            assert "Traceback" not in result.error["message"]
            assert "object at 0x" not in result.error["message"]


@pytest.fixture(scope="module")
def qwen(checkpoint):
    return checkpoint("qwen2_5_vl")


def _texts(n):
    return [_req(f"request number {i} " + "word " * (i % 5)) for i in range(n)]


def test_injected_oom_halves_and_completes(qwen, media):
    engine = _engine(qwen, media)
    batch = _texts(8)
    with injected(Faults(oom_above_batch=2)):
        results = engine.run(batch)
    assert [r.status for r in results] == ["succeeded"] * 8
    assert max(r.batch_size for r in results) <= 2
    assert engine.stats.oom_splits >= 2
    clean = _engine(qwen, media).run(batch)
    assert [r.output for r in results] == [r.output for r in clean]


def test_oom_at_batch_of_one_fails_that_request(qwen, media):
    with injected(Faults(oom_above_batch=0)):
        results = _engine(qwen, media).run(_texts(2))
    assert {r.error["code"] for r in results} == {"out_of_memory"}


def test_bisection_isolates_a_poison_request(qwen, media):
    engine = _engine(qwen, media, decode=DecodeSettings(admit_rows=8))  # one micro-batch of 8
    batch = _texts(8)
    batch[5] = _req("this one is POISON")
    with injected(Faults(poison_marker="POISON")):
        results = engine.run(batch)
    assert [r.status for r in results].count("succeeded") == 7
    assert results[5].error["code"] == "generation_failed"
    assert engine.stats.bisections >= 3


def test_token_budget_splits_batches(qwen, media):
    engine = _engine(qwen, media, token_budget=120)
    results = engine.run(_texts(8))
    assert all(r.status == "succeeded" for r in results)
    assert engine.stats.micro_batches > 1
    assert max(r.batch_size for r in results) < 8


def test_different_max_new_tokens_share_a_batch(qwen, media):
    engine = _engine(qwen, media, fixed_output_length=False)
    batch = [_req("same prompt here", max_new_tokens=n) for n in (1, 3, 5, 9)]
    together = engine.run_outcomes(batch)
    assert {o.completion.batch_size for o in together} == {4}
    for request, outcome in zip(batch, together, strict=True):
        ids = outcome.completion.token_ids
        assert len(ids) <= request.generation.max_new_tokens
        alone = engine.run_outcomes([request])[0].completion.token_ids
        assert ids == alone
        if len(ids) == request.generation.max_new_tokens:
            assert outcome.completion.finish_reason.value in ("length", "stop")


def test_stop_strings_end_a_row(qwen, media):
    engine = _engine(qwen, media)
    free = engine.run([_req("tell me a story", max_new_tokens=12)])[0]
    assert len(free.output) >= 4
    stop = free.output[2:4]
    stopped = engine.run(
        [
            _req("tell me a story", max_new_tokens=12, stop=[stop]),
            _req("another prompt entirely", max_new_tokens=12),
        ]
    )[0]
    assert stopped.output == free.output[: free.output.index(stop)]
    assert stopped.finish_reason.value == "stop"


def test_seeded_sampling_does_not_depend_on_batch_mates(qwen, media):
    engine = _engine(qwen, media)
    sampled = _req("sample something", temperature=1.0, seed=11, max_new_tokens=8)
    alone = engine.run([sampled])[0]
    together = engine.run([sampled, *_texts(3)])
    assert together[0].output == alone.output
    other_seed = engine.run([_req("sample something", temperature=1.0, seed=12, max_new_tokens=8)])[
        0
    ]
    greedy = engine.run([_req("sample something", max_new_tokens=8)])[0]
    assert alone.output != greedy.output or other_seed.output != greedy.output


def test_prompt_too_long_fails_before_the_model(qwen, media):
    engine = _engine(qwen, media, max_new_tokens_cap=10**6)
    context = engine.loaded.context_length
    results = engine.run([_req("short", max_new_tokens=context), _req("fine")])
    assert results[0].error["code"] == "prompt_too_long"
    assert results[1].status == "succeeded"


def test_max_new_tokens_over_the_cap_is_rejected(qwen, media):
    engine = _engine(qwen, media, max_new_tokens_cap=16)
    results = engine.run([_req("x", max_new_tokens=17)])
    assert results[0].error["code"] == "invalid_request"
    assert "max_new_tokens" in results[0].error["message"]


def test_transient_fetch_errors_are_retried_then_reported(qwen, media):
    from vlmq.config.errors import MediaFetchTransient

    engine = _engine(qwen, media)
    engine.media_settings.fetch_retry_backoff_s = 0.0
    real = engine.loader.load_image
    calls = {"flaky": 0, "down": 0}

    def load_image(source, *rest):
        if "flaky" in source:
            calls["flaky"] += 1
            if calls["flaky"] < 3:
                raise MediaFetchTransient("the media server answered 503")
            return real(str(media / "a.png"), *rest)
        if "down" in source:
            calls["down"] += 1
            raise MediaFetchTransient("the media server answered 503")
        return real(source, *rest)

    engine.loader.load_image = load_image
    results = engine.run(
        [
            _req([{"type": "image", "image": "https://media.example/flaky.png"}]),
            _req([{"type": "image", "image": "https://media.example/down.png"}]),
        ]
    )
    assert results[0].status == "succeeded" and calls["flaky"] == 3
    assert results[1].error == {
        "code": "media_fetch_failed",
        "retryable": True,
        "message": "the media server answered 503",
    }
    assert calls["down"] == 1 + engine.media_settings.fetch_retries
