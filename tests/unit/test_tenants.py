"""Tenants without services: ids that may form a key, callers and what they see, the key
book (lengths, one key for one tenant), loopback Host names, quota checks and settings."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
from pydantic import ValidationError

from vlmq.broker.state.tenants import Tenants
from vlmq.config.errors import ConfigError, InvalidRequest, QuotaExceeded, RetryableError
from vlmq.config.ids import check_id, valid_id
from vlmq.config.keys import Keys
from vlmq.config.schemas import Request
from vlmq.config.settings import (
    ApiSettings,
    MetricsSettings,
    Settings,
    TenantQuota,
    TenantSettings,
)
from vlmq.config.tenants import DEFAULT_TENANT, Caller, owner_of, valid_tenant
from vlmq.producers.api.app import create_app
from vlmq.producers.api.auth import KeyBook, caller_of, is_loopback_host

KEY_A = "team-a-key-0123456789"
KEY_B = "team-b-key-0123456789"
KEY_ADMIN = "admin-key-0123456789"
KEY_PLAIN = "plain-key-0123456789"
# Building the app connects nothing: a Redis nobody listens on is enough.
NOWHERE = "redis://127.0.0.1:1/0"

CRAFTED_IDS = ["J:custom_ids", "x:y", "a" * 129, "a" * 200, "", "a b", "a/b", "é", "a\nb"]
CRAFTED_IDS += [".", "..", "..."]  # a folder of the result store


# ids -----------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["a", "A-b_c.9", "x" * 128, "batch_0123", "0" * 32])
def test_plain_ids_may_form_keys(value):
    assert valid_id(value) and check_id("job id", value) == value


@pytest.mark.parametrize("value", CRAFTED_IDS)
def test_crafted_ids_never_form_keys(value):
    assert not valid_id(value)
    with pytest.raises(InvalidRequest, match=r"^job id: must be 1-128 "):
        check_id("job id", value)


@pytest.mark.parametrize("value", ["J:custom_ids", "x:y", "a" * 200])
def test_a_request_refuses_a_crafted_job_id(value):
    with pytest.raises(ValidationError):
        Request.model_validate({"messages": [{"role": "user", "content": "hi"}], "job_id": value})


def test_tenant_names_hold_no_separator():
    assert valid_tenant("team-a") and valid_tenant("T_1") and valid_tenant("x" * 64)
    for bad in ("a:b", "a.b", "", "x" * 65, "a b", "a/b"):
        assert not valid_tenant(bad)


# callers -------------------------------------------------------------------------
def test_a_caller_sees_its_own_tenant_only_and_an_admin_sees_all():
    a, admin = Caller("team-a"), Caller(DEFAULT_TENANT, admin=True)
    assert a.may_see({"tenant": "team-a"}) and not a.may_see({"tenant": "team-b"})
    assert admin.may_see({"tenant": "team-a"}) and admin.may_see({"tenant": "team-b"})
    # A record from before tenants belongs to the default tenant.
    assert owner_of({}) == owner_of({"tenant": ""}) == DEFAULT_TENANT
    assert Caller().may_see({}) and not a.may_see({})


def test_the_key_book_maps_each_key_to_its_caller():
    book = KeyBook(
        ApiSettings(
            api_keys=[KEY_PLAIN],
            tenant_keys={KEY_A: "team-a", KEY_B: "team-b"},
            admin_keys=[KEY_ADMIN],
        )
    )
    assert not book.open
    assert book.caller(f"Bearer {KEY_A}") == Caller("team-a")
    assert book.caller(f"bearer  {KEY_B} ") == Caller("team-b")
    assert book.caller(f"Bearer {KEY_PLAIN}") == Caller(DEFAULT_TENANT)
    assert book.caller(f"Bearer {KEY_ADMIN}") == Caller(DEFAULT_TENANT, admin=True)
    for refused in (None, "", "Bearer", "Bearer ", KEY_A, f"Basic {KEY_A}", f"Bearer {KEY_A}x"):
        assert book.caller(refused) is None, refused
    assert book.caller(f"Bearer {KEY_A[:-1]}") is None


def test_without_keys_the_book_is_open_and_callers_are_admins():
    assert KeyBook(ApiSettings()).open
    request = SimpleNamespace(state=SimpleNamespace())  # what the gate left: no caller
    assert caller_of(request) == Caller(DEFAULT_TENANT, admin=True)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "api",
    [
        {"api_keys": ["short-key"]},
        {"tenant_keys": {"short-key": "team-a"}},
        {"admin_keys": ["short-key"]},
        {"api_keys": [KEY_PLAIN, "x" * 15]},
    ],
)
def test_keys_shorter_than_the_minimum_are_refused_at_create_app(api):
    with pytest.raises(ConfigError, match="shorter than 16 characters"):
        create_app(Settings(redis_url=NOWHERE, api=ApiSettings(**api)))


def test_the_minimum_key_length_is_a_setting():
    create_app(Settings(redis_url=NOWHERE, api=ApiSettings(api_keys=["abcd"], min_key_length=4)))
    with pytest.raises(ValidationError):
        ApiSettings(min_key_length=0)


@pytest.mark.parametrize(
    "api",
    [
        {"api_keys": [KEY_A], "tenant_keys": {KEY_A: "team-a"}},
        {"tenant_keys": {KEY_A: "team-a"}, "admin_keys": [KEY_A]},
        {"api_keys": [KEY_A], "admin_keys": [KEY_A]},
    ],
)
def test_one_key_for_two_tenants_or_roles_is_refused(api):
    with pytest.raises(ConfigError, match="one API key is configured for two tenants or roles"):
        create_app(Settings(redis_url=NOWHERE, api=ApiSettings(**api)))


def test_a_key_listed_twice_for_the_same_caller_is_fine():
    book = KeyBook(ApiSettings(api_keys=[KEY_PLAIN, KEY_PLAIN], admin_keys=[KEY_ADMIN] * 2))
    assert book.caller(f"Bearer {KEY_PLAIN}") == Caller(DEFAULT_TENANT)


@pytest.mark.parametrize("tenant", ["a:b", "a.b", "", "x" * 65])
def test_a_tenant_name_that_cannot_form_a_key_is_refused(tenant):
    with pytest.raises(ConfigError, match="tenant names must match"):
        KeyBook(ApiSettings(tenant_keys={KEY_A: tenant}))


# Host names of a keyless server ---------------------------------------------------
@pytest.mark.parametrize(
    "host",
    [
        "localhost",
        "localhost:8000",
        "LOCALHOST:1",
        "127.0.0.1",
        "127.0.0.1:65535",
        "[::1]",
        "[::1]:8000",
        "::1",
        " localhost ",
    ],
)
def test_loopback_host_names(host):
    assert is_loopback_host(host)


@pytest.mark.parametrize(
    "host",
    [
        None,
        "",
        "evil.example",
        "evil.example:8000",
        "localhost.evil.example",
        "127.0.0.1.nip.io",
        "127.0.0.2",
        "0.0.0.0:8000",
        "[::2]:8000",
        "[::1",
        "localhost:8000:1",
        "10.0.0.1",
    ],
)
def test_other_host_names(host):
    assert not is_loopback_host(host)


# quotas ----------------------------------------------------------------------------
class _Hash:
    """The one Redis read check_quota makes (HMGET of the tenant's quota hash)."""

    def __init__(self, values: dict[str, str]) -> None:
        self.values = values
        self.asked: list[str] = []

    def hmget(self, key: str, fields: list[str]) -> list[str | None]:
        self.asked.append(key)
        return [self.values.get(f) for f in fields]


def _check(values: dict[str, str], quota: TenantQuota, tasks: int, tokens: int = 0) -> _Hash:
    redis = _Hash(values)
    _tenants(redis).check_quota("team-a", quota, tasks, tokens)
    return redis


def _tenants(redis: _Hash) -> Tenants:
    # reads only: no scripts
    return Tenants(cast(Any, redis), cast(Any, None), Keys())


def test_the_task_quota_counts_what_waits_plus_the_submission():
    quota = TenantQuota(max_queued_tasks=10)
    assert _check({"tasks": "7"}, quota, 3).asked == ["vlmq:quota:team-a"]
    with pytest.raises(QuotaExceeded) as refused:
        _check({"tasks": "7"}, quota, 4)
    assert refused.value.code == "quota_exceeded" and refused.value.retry_after_s >= 1
    assert "'team-a'" in refused.value.message and "max_queued_tasks" in refused.value.message
    assert isinstance(refused.value, RetryableError)
    _check({}, quota, 10)  # nothing queued yet
    _check({"tasks": "-3"}, quota, 10)  # a count below 0 reads as 0
    # At its quota, "may it submit at all?" (0 tasks: before a file is read) is refused.
    with pytest.raises(QuotaExceeded):
        _check({"tasks": "10"}, quota, 0)
    _check({"tasks": "9"}, quota, 0)


def test_the_token_quota_counts_the_estimate():
    quota = TenantQuota(max_queued_tokens=1000)
    _check({"tasks": "99", "tokens": "900"}, quota, 1, 100)
    with pytest.raises(QuotaExceeded, match="max_queued_tokens"):
        _check({"tasks": "1", "tokens": "900"}, quota, 1, 101)
    with pytest.raises(QuotaExceeded, match="max_queued_tokens"):
        _check({"tasks": "1", "tokens": "1000"}, quota, 0)
    _check({"tasks": "1", "tokens": "999"}, quota, 0)


def test_no_quota_reads_nothing():
    assert _check({"tasks": "10"}, TenantQuota(), 10**9, 10**9).asked == []


def test_queued_work_reads_missing_counts_as_zero():
    assert _tenants(_Hash({})).queued("t") == _tenants(_Hash({"tasks": "0"})).queued("t")
    assert _tenants(_Hash({"tasks": "3", "tokens": "40"})).queued("t").tokens == 40


def test_quota_exceeded_is_a_429_with_retry_after():
    from vlmq.producers.api.errors import _status_of

    assert _status_of(QuotaExceeded("over", 5.0)) == 429


# settings --------------------------------------------------------------------------
def test_tenant_settings_and_their_defaults():
    settings = Settings()
    assert settings.tenant == DEFAULT_TENANT
    assert settings.tenants.quota("anyone") == TenantQuota()
    tenants = TenantSettings(
        quotas={"team-a": TenantQuota(max_queued_tasks=5)},
        default_quota=TenantQuota(max_queued_tokens=7),
    )
    assert tenants.quota("team-a").max_queued_tasks == 5
    assert tenants.quota("team-b").max_queued_tokens == 7
    for bad in ("a:b", "", "x" * 65):
        with pytest.raises(ValidationError):
            Settings(tenant=bad)


def test_tenant_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("VLMQ_TENANT", "team-a")
    monkeypatch.setenv("VLMQ_API__TENANT_KEYS", f'{{"{KEY_A}": "team-a"}}')
    monkeypatch.setenv("VLMQ_API__ADMIN_KEYS", f'["{KEY_ADMIN}"]')
    monkeypatch.setenv("VLMQ_TENANTS__QUOTAS", '{"team-a": {"max_queued_tasks": 3}}')
    settings = Settings()
    assert settings.tenant == "team-a"
    assert settings.api.tenant_keys == {KEY_A: "team-a"}
    assert settings.api.admin_keys == [KEY_ADMIN]
    assert settings.tenants.quota("team-a").max_queued_tasks == 3


def test_the_worker_metrics_bind_loopback_by_default():
    assert MetricsSettings().host == "127.0.0.1"
    assert MetricsSettings(host="0.0.0.0").host == "0.0.0.0"


def test_tenant_keys_never_reach_redis_key_names():
    keys = Keys()
    assert keys.quota("team-a") == "vlmq:quota:team-a"
    assert keys.rate_bucket("t:team-a") == "vlmq:rate:t:team-a"
    assert keys.files_index() != keys.files_index("team-a")
    assert keys.batches_index() != keys.batches_index("team-a")
    assert keys.active_jobs("text", "team-a") == keys.active_tenants("text") + ":team-a"
