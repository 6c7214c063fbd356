"""Hostile input through the real media guard and the real engine (a tiny
Qwen2.5-VL checkpoint on CPU): no worker crash, one result per request, a
clear error for every failure, and zero SSRF canary hits.

The corpus and the strategies live in ``tests/support/faults/corpus.py``;
``python -m bench.bad_input`` runs the same checks on ~2,000 generated inputs.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.support.faults.corpus import (
    ALLOWLISTED_HOSTS,
    REJECTED,
    S3_BUCKET,
    Canary,
    FaultEnv,
    OutboundSpy,
    Verdict,
    build_corpus,
    conversations,
    decode_verdicts,
    engine_settings,
    evaluate,
    items_from_cases,
    items_from_raw,
    make_env,
    make_loader,
    media_bytes,
    media_settings,
    message_problems,
    valid_mates,
)
from vlmq.config.errors import InvalidRequest
from vlmq.config.schemas import Request
from vlmq.config.settings import MediaSettings
from vlmq.workers.media.fetch import MediaFetcher

pytestmark = pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")

FUZZ = settings(
    deadline=None,
    database=None,  # write nothing into the checkout
    # No explain phase: its line tracing during generation makes every torch
    # call ~50x slower (0.8 s instead of 15 ms for a tiny batch).
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)


@pytest.fixture(scope="module")
def canary() -> Iterator[Canary]:
    with Canary() as listener:
        yield listener


@pytest.fixture(scope="module")
def spy() -> Iterator[OutboundSpy]:
    with OutboundSpy() as recorder:
        yield recorder


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, canary: Canary) -> FaultEnv:
    return make_env(tmp_path_factory.mktemp("hostile"), canary.port)


@pytest.fixture(scope="module")
def engine(checkpoint: Any, env: FaultEnv) -> Iterator[Any]:
    from vlmq.workers.engine import Engine

    model = checkpoint("qwen2_5_vl")
    media = media_settings(env)
    engine = Engine(str(model), engine_settings(), media, make_loader(media)).setup()
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def decode_pool() -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode-fuzz")
    yield pool
    pool.shutdown(wait=False, cancel_futures=True)


def describe(verdicts: list[Verdict]) -> list[str]:
    """One line per verdict that is not right (empty when all are)."""
    return [
        f"{v.category} / {v.name!r}: {v.outcome} {v.message[:80]!r} {v.problems + v.mismatch}"
        for v in verdicts
        if not v.ok
    ]


def assert_no_ssrf(canary: Canary, spy: OutboundSpy) -> None:
    assert canary.hits == 0, "a fetch reached the loopback canary"
    assert spy.attempts == [], f"outbound connections attempted: {spy.attempts}"


def test_the_message_check_catches_leaks() -> None:
    leaks = [
        "Traceback (most recent call last):",
        "cannot identify image file <_io.BytesIO object at 0x7f3a2c1b9e50>",
        "UnidentifiedImageError: cannot identify image file",
        "[Errno 2] No such file or directory",
        "could not open /work/main/.venv/lib/python3.11/site-packages/PIL/Image.py",
        "x" * 301,
        "",
    ]
    for message in leaks:
        assert message_problems(message, sent=""), message
    assert message_problems("media file not found", sent="") == []
    assert message_problems("media URL must look like s3://bucket/key", sent="") == []
    # What the client sent may be echoed back (a type name, its own path).
    assert message_problems("unknown content part type 'ValueError'", "ValueError") == []
    assert message_problems("not found: /data/in/a.png", "/data/in/a.png") == []


def test_loopback_is_allowlisted_but_private_addresses_are_not() -> None:
    settings = media_settings(FaultEnv(Path("/nonexistent"), Path("/nonexistent"), 1))
    assert not settings.allow_private_addresses
    assert {"localhost", "127.0.0.1"} <= set(settings.allowed_hosts)
    assert set(ALLOWLISTED_HOSTS) == set(settings.allowed_hosts)


def test_corpus_fails_clearly_and_batch_mates_succeed(
    engine: Any, env: FaultEnv, canary: Canary, spy: OutboundSpy
) -> None:
    corpus = build_corpus(env)
    mates = valid_mates(env)
    verdicts = evaluate(engine, items_from_cases(corpus), mates)
    assert len(verdicts) == len(corpus) + len(mates)
    assert describe(verdicts) == []
    assert not any(v.crashed for v in verdicts)
    assert_no_ssrf(canary, spy)
    assert engine.stats.bisections == 0  # no bad input reached generate
    categories = {case.category for case in corpus}
    assert len(categories) >= 12 and sum(c.category == "ssrf" for c in corpus) >= 20
    # Unknown content parts never reach a worker: refused with the field named.
    unknown = [v for v in verdicts if v.category == "unknown content part"]
    assert unknown and all(v.outcome == REJECTED and "content" in v.message for v in unknown)


def test_an_unexpected_error_while_preparing_fails_only_its_request(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The safety net behind the specific checks: a processor surprise (say a
    ValueError from its patch arithmetic) must not take the batch down."""
    preparer = engine._preparer
    real = preparer._estimate

    def estimate(conversation: list[dict[str, Any]], *sizes: Any) -> int:
        if any(part.get("text") == "boom" for m in conversation for part in m["content"]):
            raise ValueError("absolute aspect ratio must be smaller than 200, got 1e5")
        return int(real(conversation, *sizes))

    monkeypatch.setattr(preparer, "_estimate", estimate)
    requests = [Request.model_validate({"messages": [{"role": "user", "content": t}]})
                for t in ("boom", "fine")]  # fmt: skip
    failed, fine = engine.run(requests)
    assert failed.error == {
        "code": "internal_error",
        "message": "could not prepare this request",
        "retryable": False,
    }
    assert fine.status == "succeeded"


def test_fetcher_refuses_names_that_cannot_be_encoded(env: FaultEnv) -> None:
    """Pydantic already refuses a lone surrogate in a source; the fetcher, a
    public API of its own, must not crash on one either (os.open, botocore)."""
    fetcher = MediaFetcher(
        MediaSettings(local_roots=[str(env.media)], allowed_buckets=[S3_BUCKET]),
        s3_client_factory=lambda: pytest.fail("the client must not be built"),
    )
    for source in (f"{env.media}/\ud800.png", f"s3://{S3_BUCKET}/a\ud800.png"):
        with pytest.raises(InvalidRequest):
            fetcher.fetch(source, "image")


@settings(FUZZ, max_examples=150)
@given(data=st.data())
def test_random_conversations_are_refused_or_answered_clearly(
    engine: Any, env: FaultEnv, canary: Canary, spy: OutboundSpy, data: st.DataObject
) -> None:
    raw = data.draw(conversations(env), label="request")
    verdicts = evaluate(engine, items_from_raw([raw], "generated"), valid_mates(env)[:1])
    assert len(verdicts) in (1, 2)  # the request, and its batch-mate if it ran
    assert describe(verdicts) == []
    assert_no_ssrf(canary, spy)


@settings(FUZZ, max_examples=400)
@given(data=st.data())
def test_decoders_raise_only_media_errors_in_bounded_time(
    env: FaultEnv, decode_pool: ThreadPoolExecutor, data: st.DataObject
) -> None:
    blob = data.draw(media_bytes(env.seeds), label="bytes")
    verdicts = decode_verdicts("fuzz", blob, MediaSettings(), decode_pool)
    assert describe(verdicts) == []
