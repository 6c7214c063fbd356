"""VLMQ_REDIS_URL: plain Redis URLs unchanged, Sentinel URLs parsed into what redis-py and kombu
each need (no server: the Sentinel client connects on first use)."""

from __future__ import annotations

import pytest
import redis
from redis.sentinel import SentinelConnectionPool, SentinelManagedConnection

from vlmq.broker.connection import (
    CONNECTION_RETRIES,
    SentinelAddress,
    celery_broker,
    create_redis,
    parse_sentinel_url,
)
from vlmq.config.errors import ConfigError
from vlmq.config.settings import Settings


@pytest.mark.parametrize(
    "url",
    ["redis://127.0.0.1:6379/0", "rediss://:pw@cache.example.com:6380/2", "unix:///tmp/r.sock"],
)
def test_plain_urls_are_not_sentinel_urls(url):
    assert parse_sentinel_url(url) is None
    assert celery_broker(Settings(redis_url=url)) == (url, {})


def test_plain_url_keeps_the_shared_options():
    client = create_redis(Settings(redis_url="redis://127.0.0.1:6399/3"), timeout_s=1.5)
    kwargs = client.connection_pool.connection_kwargs
    assert (kwargs["port"], kwargs["db"]) == (6399, 3)
    assert kwargs["decode_responses"] is True and kwargs["encoding_errors"] == "replace"
    assert kwargs["socket_timeout"] == 1.5 and kwargs["retry"]._retries == CONNECTION_RETRIES


def test_sentinel_url_with_everything():
    url = "redis+sentinel://app:p%40ss@s1:26380,s2,[::1]:26381/my-master/3"
    assert parse_sentinel_url(url) == SentinelAddress(
        sentinels=(("s1", 26380), ("s2", 26379), ("::1", 26381)),
        service="my-master",
        db=3,
        username="app",
        password="p@ss",
    )


def test_sentinel_url_minimal():
    address = parse_sentinel_url("redis+sentinel://10.0.0.5/vlmq")
    assert address == SentinelAddress((("10.0.0.5", 26379),), "vlmq", 0, None, None)
    assert parse_sentinel_url("redis+sentinel://:secret@h:1/s").password == "secret"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "url",
    [
        "redis+sentinel://h1:26379",  # no service
        "redis+sentinel://h1:26379/",  # no service
        "redis+sentinel:///vlmq",  # no sentinel
        "redis+sentinel://h1:port/vlmq",  # port not a number
        "redis+sentinel://h1:70000/vlmq",  # port out of range
        "redis+sentinel://h1/vlmq/zero",  # db not a number
        "redis+sentinel://h1/vlmq/0/extra",
        "redis+sentinel://h1/vlmq?sentinel_password=x",  # no query
        "redis+sentinel://[::1/vlmq",
    ],
)
def test_malformed_sentinel_urls_are_refused(url):
    with pytest.raises(ConfigError):
        parse_sentinel_url(url)


def test_errors_do_not_show_the_password():
    with pytest.raises(ConfigError) as caught:
        parse_sentinel_url("redis+sentinel://user:hunter2@h1/vlmq/x")
    assert "hunter2" not in str(caught.value) and "user:***@" in str(caught.value)


def test_create_redis_resolves_the_master_through_the_sentinels():
    settings = Settings(
        redis_url="redis+sentinel://:pw@s1:26379,s2:26380/vlmq/2",
        redis_sentinel_password="sentinel-secret",
        redis_sentinel_timeout_s=0.5,
    )
    client = create_redis(settings, timeout_s=4.0)
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool) and pool.is_master
    assert pool.service_name == "vlmq"
    assert issubclass(pool.connection_class, SentinelManagedConnection)
    kwargs = pool.connection_kwargs
    assert (kwargs["db"], kwargs["password"]) == (2, "pw")
    assert kwargs["decode_responses"] is True and kwargs["encoding_errors"] == "replace"
    assert kwargs["socket_timeout"] == 4.0 and kwargs["health_check_interval"] == 10
    assert kwargs["retry"]._supported_errors == (redis.ConnectionError,)
    sentinels = pool.sentinel_manager.sentinels
    assert [
        (s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
        for s in sentinels
    ] == [("s1", 26379), ("s2", 26380)]
    sentinel_kwargs = sentinels[0].connection_pool.connection_kwargs
    assert sentinel_kwargs["password"] == "sentinel-secret"
    assert sentinel_kwargs["socket_timeout"] == 0.5  # the shorter of the two


def test_celery_gets_kombus_sentinel_transport():
    settings = Settings(
        redis_url="redis+sentinel://:p%3Bw@s1:26379,[::1]:26380/vlmq/4",
        redis_sentinel_password="sp",
    )
    broker, options = celery_broker(settings)
    assert broker == "sentinel://:p%3Bw@s1:26379/4;sentinel://:p%3Bw@[::1]:26380/4"
    assert options == {
        "master_name": "vlmq",
        "sentinel_kwargs": {"socket_timeout": 1.0, "password": "sp"},
    }


def test_the_celery_app_uses_it():
    from vlmq.workers.fleet.celery_app import make_app

    app = make_app(Settings(redis_url="redis+sentinel://s1:26379,s2:26379/vlmq/0"))
    assert app.conf.broker_url.startswith("sentinel://s1:26379/0;sentinel://s2:26379/0")
    options = app.conf.broker_transport_options
    assert options["master_name"] == "vlmq" and options["visibility_timeout"] == 3600
    plain = make_app(Settings(redis_url="redis://127.0.0.1:6379/0"))
    assert plain.conf.broker_url == "redis://127.0.0.1:6379/0"
    assert plain.conf.broker_transport_options == {"visibility_timeout": 3600}
