"""The reply-dropping proxy (tests/support/replydrop.py) against a real redis-server: RESP
framing both ways, matching replies to their commands, and what a lost reply does to a
client that retries (vlmq's ``create_redis``)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from tests.support.replydrop import FrameScanner, ReplyDropProxy, Rule, parse_command
from vlmq.broker.connection import create_redis
from vlmq.config.settings import Settings


@pytest.fixture
def proxy(redis_server: Any) -> Iterator[ReplyDropProxy]:
    with ReplyDropProxy(redis_server.port) as running:
        yield running


def _through(proxy: ReplyDropProxy, redis_server: Any) -> redis.Redis:
    """A client as every vlmq process opens one, through the proxy."""
    return create_redis(Settings(redis_url=proxy.url_for(redis_server.url)))


def _frames(data: bytes, step: int) -> list[bytes]:
    """``data`` cut into frames by a scanner fed ``step`` bytes at a time."""
    scanner, buf, out = FrameScanner(), bytearray(), []
    for at in range(0, len(data), step):
        buf += data[at : at + step]
        while (end := scanner.frame_end(buf)) is not None:
            out.append(bytes(buf[:end]))
            del buf[:end]
            scanner.reset()
    assert not buf
    return out


def test_frames_are_found_whatever_the_reads() -> None:
    replies = [
        b"+OK\r\n",
        b"-ERR wrong\r\n",
        b":42\r\n",
        b"$-1\r\n",
        b"$0\r\n\r\n",
        b"$5\r\na\r\nbc\r\n",  # CRLF inside a bulk string
        b"*-1\r\n",
        b"*0\r\n",
        b"*3\r\n:1\r\n*2\r\n$1\r\nx\r\n*0\r\n$2\r\nyz\r\n",
        b"%2\r\n+a\r\n:1\r\n+b\r\n*1\r\n_\r\n",  # RESP3 map
        b"~2\r\n,1.5\r\n#t\r\n",  # set, double, boolean
        b"|1\r\n+ttl\r\n:3\r\n$2\r\nhi\r\n",  # an attribute, then its reply
        b"=8\r\ntxt:abcd\r\n",
        b">2\r\n$7\r\nmessage\r\n$1\r\nx\r\n",
    ]
    data = b"".join(replies)
    for step in (1, 2, 3, 7, len(data)):
        assert _frames(data, step) == replies


def test_commands_are_parsed_from_arrays_and_inline() -> None:
    frame = b"*3\r\n$7\r\nEVALSHA\r\n$3\r\nabc\r\n$1\r\n0\r\n"
    assert parse_command(frame) == [b"EVALSHA", b"abc", b"0"]
    assert parse_command(b"PING hello\r\n") == [b"PING", b"hello"]
    scanner = FrameScanner(inline=True)
    assert scanner.frame_end(b"PING\r\n*1\r\n") == 6


def test_a_dropped_incr_reply_makes_the_client_apply_it_twice(
    redis_server: Any, proxy: ReplyDropProxy
) -> None:
    """The mechanism behind issue 23: redis-py retries a command whose reply a reset lost
    (create_redis: Retry(retries=2) on ConnectionError), and INCR is not idempotent."""
    client = _through(proxy, redis_server)
    incr = proxy.add(Rule(name="INCR", matches=lambda a: a[0].upper() in (b"INCR", b"INCRBY")))
    assert client.incr("counter") == 2  # one call, applied twice
    assert redis_server.connect().get("counter") == "2"
    assert (incr.matched, incr.dropped) == (2, 1)
    assert proxy.dropped() == {"INCR": 1}
    assert proxy.connections == 2  # the retry reconnected


def test_a_dropped_exec_reply_applies_the_transaction_twice(
    redis_server: Any, proxy: ReplyDropProxy
) -> None:
    client = _through(proxy, redis_server)
    proxy.add(Rule.command("EXEC"))
    pipe = client.pipeline(transaction=True)
    pipe.incr("a")
    pipe.rpush("list", "x")
    assert pipe.execute() == [2, 2]
    direct = redis_server.connect()
    assert direct.get("a") == "2" and direct.lrange("list", 0, -1) == ["x", "x"]


def test_a_transaction_rule_picks_the_exec_of_its_block(
    redis_server: Any, proxy: ReplyDropProxy
) -> None:
    client = _through(proxy, redis_server)
    rule = proxy.add(Rule.transaction("pushes", lambda a: a[0].upper() == b"LPUSH"))
    other = client.pipeline(transaction=True)
    other.incr("n")
    assert other.execute() == [1]  # an EXEC without LPUSH: untouched
    pipe = client.pipeline(transaction=True)
    pipe.lpush("l", "x")
    pipe.incr("n")
    assert pipe.execute() == [2, 3]  # lost, applied twice
    assert (rule.matched, rule.dropped) == (2, 1)


def test_replies_are_matched_to_their_commands_in_a_pipeline(
    redis_server: Any, proxy: ReplyDropProxy
) -> None:
    """In a pipeline of 200 commands, the rule fires on the reply of the one it names (the
    101st ECHO), not on another's: the replies before it reached the client, and the whole
    pipeline is sent again."""
    client = _through(proxy, redis_server)
    rule = proxy.add(Rule("echo 100", matches=lambda a: a[:2] == [b"ECHO", b"100"]))
    pipe = client.pipeline(transaction=False)
    for i in range(200):
        pipe.echo(str(i))
    assert pipe.execute() == [str(i) for i in range(200)]
    assert (rule.matched, rule.dropped) == (2, 1)
    # the first sending up to where its connection was cut, then all 200 again
    assert 301 <= proxy.command_counts["ECHO"] <= 400


def test_large_values_cross_both_ways_intact(redis_server: Any, proxy: ReplyDropProxy) -> None:
    client = redis.Redis(port=proxy.port, db=getattr(redis_server, "db", 0))
    blob = os.urandom(6 * 2**20)
    client.set("blob", blob)
    assert client.get("blob") == blob
    client.rpush("many", *range(50_000))
    assert client.lrange("many", 0, -1) == [str(i).encode() for i in range(50_000)]
    # a reply after the big ones is still matched to its own command
    rule = proxy.add(Rule.command("STRLEN"))
    assert client.strlen("blob") == len(blob)
    assert rule.dropped == 1


def test_resp3_replies_are_framed(redis_server: Any, proxy: ReplyDropProxy) -> None:
    client = redis.Redis(port=proxy.port, db=getattr(redis_server, "db", 0), protocol=3)
    client.hset("h", mapping={"a": 1, "b": 2})
    client.sadd("s", "x", "y")
    client.zadd("z", {"m": 1.5})
    assert client.hgetall("h") == {b"a": b"1", b"b": b"2"}
    assert client.smembers("s") == {b"x", b"y"}
    assert client.zscore("z", "m") == 1.5


def test_traffic_no_rule_matches_passes_untouched(redis_server: Any, proxy: ReplyDropProxy) -> None:
    rule = proxy.add(Rule.command("FLUSHALL"))
    client = _through(proxy, redis_server)
    direct = redis_server.connect()
    client.hset("h", mapping={"k": "v"})
    client.rpush("l", "a", "b")
    pipe = client.pipeline(transaction=True)
    pipe.incr("n")
    pipe.lrange("l", 0, -1)
    assert pipe.execute() == [1, ["a", "b"]]
    assert client.hgetall("h") == direct.hgetall("h") == {"k": "v"}
    assert client.eval("return {1, {2, 'x'}, {}}", 0) == [1, [2, "x"], []]
    assert (rule.matched, rule.dropped, proxy.connections) == (0, 0, 1)


def test_script_rules_name_argv1_and_skip_noscript(
    redis_server: Any, proxy: ReplyDropProxy
) -> None:
    """A script rule matches EVALSHA/EVAL by ARGV[1] (how vlmq's Scripts name a command);
    the NOSCRIPT error before redis-py loads a new script is not a match."""
    client = _through(proxy, redis_server)
    source = f"-- {os.urandom(8).hex()}\nreturn redis.call('INCR', KEYS[1])"
    script = client.register_script(source)
    rule = proxy.add(Rule.script("bump"))
    assert script(keys=["n"], args=["bump"]) == 2  # NOSCRIPT, load, run (dropped), run
    assert script(keys=["n"], args=["other"]) == 3
    assert (rule.matched, rule.dropped) == (2, 1)
    assert proxy.script_counts["bump"] == 3  # the NOSCRIPT one, the dropped one, the retry


def test_script_rules_match_fcall(redis_server: Any, proxy: ReplyDropProxy) -> None:
    """vlmq calls its library's functions with FCALL (vlmq/broker/scripts.py): a script rule
    matches those by ARGV[1] too."""
    client = _through(proxy, redis_server)
    name = f"t{os.urandom(6).hex()}"
    body = "function(keys, args) return redis.call('INCR', keys[1]) end"
    client.execute_command(
        "FUNCTION LOAD", f"#!lua name={name}\nredis.register_function('{name}', {body})"
    )
    rule = proxy.add(Rule.script("bump"))
    assert client.execute_command("FCALL", name, 1, "m", "bump") == 2  # dropped, then run again
    assert client.execute_command("FCALL", name, 1, "m", "other") == 3
    assert (rule.matched, rule.dropped) == (2, 1)
    assert proxy.script_counts["bump"] == 2


def test_dropping_by_chance_is_reproducible(redis_server: Any, proxy: ReplyDropProxy) -> None:
    def run(label: str, seed: int) -> tuple[int, list[int]]:
        rule = proxy.add(Rule.command("INCRBY", nth=None, probability=0.3, seed=seed, limit=4))
        client = _through(proxy, redis_server)
        values = [int(client.incr(f"{label}:{i}")) for i in range(30)]
        proxy.remove(rule)
        return rule.dropped, values

    first, again = run("first", 7), run("again", 7)
    assert first[0] == 4 and sum(first[1]) == 30 + 4  # each lost reply applied once more
    assert first == again


def test_a_held_reply_waits_for_its_release(redis_server: Any, proxy: ReplyDropProxy) -> None:
    client = _through(proxy, redis_server)
    client.set("k", "v")
    rule = proxy.add(Rule.command("GET", hold=True))
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.append(client.get("k")))
    reader.start()
    rule.wait_dropped(1, timeout=10)
    reader.join(0.3)
    assert reader.is_alive() and not got  # the command ran; its reply is held
    rule.release()
    reader.join(10)
    assert got == ["v"]
