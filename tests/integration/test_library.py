"""vlmq's Lua as a Redis function library (vlmq/broker/scripts.py): loaded by the first call
that finds it missing, registered twice (the plain function refused whole by a full Redis, the
allow-oom one run), and versions nobody loaded for a week deleted when another loads."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from vlmq.broker.scripts import LIBRARY_PREFIX, STALE_LIBRARY_S, Scripts, library
from vlmq.config.keys import Keys
from vlmq.config.wire import encode_message
from vlmq.producers.client import Client

KEYS = Keys()


def _libraries(client: Any) -> dict[str, dict[str, list[str]]]:
    """Library name -> function name -> its flags."""
    found = {}
    for entry in client.function_list():
        fields = dict(zip(entry[::2], entry[1::2], strict=True))
        functions = {}
        for function in fields["functions"]:
            described = dict(zip(function[::2], function[1::2], strict=True))
            functions[described["name"]] = list(described["flags"])
        found[fields["library_name"]] = functions
    return found


def _fake(client: Any, name: str) -> None:
    """A library named as a vlmq version's (another version, for the pruning)."""
    client.function_load(
        f"#!lua name={name}\nredis.register_function('{name}', function() return 1 end)"
    )


@pytest.mark.private_redis
def test_the_first_call_loads_the_library_with_its_two_functions(redis_server):
    client = redis_server.connect()
    scripts = Scripts(client, KEYS)
    assert _libraries(client) == {}
    assert scripts("reap", KEYS.bookkeeping(), [10]) == 0
    name, _ = library()
    assert scripts.name == name and name.startswith(LIBRARY_PREFIX)
    assert _libraries(client) == {name: {name: [], f"{name}_oom": ["allow-oom"]}}
    # In use: recorded with Redis's time (once an hour per process, and at its first call).
    assert set(client.hgetall(KEYS.libraries())) == {name}
    assert int(client.hget(KEYS.libraries(), name)) >= int(client.time()[0]) - 5
    # Loaded once: the next calls find it.
    client.config_resetstat()
    assert scripts("reap", KEYS.bookkeeping(), [10]) == 0
    stats = client.info("commandstats")
    assert "cmdstat_function|load" not in stats and stats["cmdstat_fcall"]["calls"] == 1


@pytest.mark.private_redis
def test_a_full_redis_refuses_a_pull_whole_and_runs_what_frees_memory(redis_server, settings):
    client = Client(settings)
    client.redis.lpush(
        KEYS.queue("text"), encode_message({"messages": []}, "t1", KEYS.queue("text"))
    )
    client.state.leases.renew({"warm-up": 1}, 30)  # (the library loaded)
    client.redis.config_set("maxmemory", 1)
    try:
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            client.state.intake("text").pull(8, 30)
        assert client.redis.llen(KEYS.queue("text")) == 1  # nothing popped, nothing lost
        assert client.state.scripts("reap", KEYS.bookkeeping(), [10]) == 0  # allow-oom
    finally:
        client.redis.config_set("maxmemory", 0)
    assert [d.task_id for d in client.state.intake("text").pull(8, 30).deliveries] == ["t1"]


@pytest.mark.private_redis
def test_versions_nobody_loaded_for_a_week_are_deleted(redis_server):
    client = redis_server.connect()
    now = int(client.time()[0])
    for name in ("vlmq_old", "vlmq_recent", "vlmq_unrecorded"):
        _fake(client, name)
    _fake(client, "other_library")  # not vlmq's: never touched
    client.hset(
        KEYS.libraries(),
        mapping={
            "vlmq_old": now - STALE_LIBRARY_S - 60,
            "vlmq_recent": now - STALE_LIBRARY_S + 3600,
            "vlmq_gone": now - 60,  # deleted by hand: its record goes too
        },
    )
    scripts = Scripts(client, KEYS)
    assert scripts("reap", KEYS.bookkeeping(), [10]) == 0
    assert set(_libraries(client)) == {
        scripts.name,
        "vlmq_recent",
        "vlmq_unrecorded",
        "other_library",
    }
    recorded = {name: int(seen) for name, seen in client.hgetall(KEYS.libraries()).items()}
    assert set(recorded) == {scripts.name, "vlmq_recent", "vlmq_unrecorded"}
    assert recorded["vlmq_unrecorded"] >= now and recorded["vlmq_recent"] < now
    # A running version whose library was deleted loads it again at its next call.
    client.function_delete(scripts.name)
    assert scripts("reap", KEYS.bookkeeping(), [10]) == 0
    assert scripts.name in _libraries(client)
