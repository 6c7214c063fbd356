"""The fleet-wide switch between task layouts (vlmq/broker/layouts.py, lua/layouts.lua): two
versions' libraries in one Redis, as during a rolling update. "The next version" is this one
with its layout constants raised, so its library's text (and name) is its own."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from vlmq.broker import layouts
from vlmq.broker.scripts import Wait
from vlmq.config.errors import ConfigError, LayoutUnreadable
from vlmq.config.keys import Keys
from vlmq.producers.client import Client
from vlmq.producers.layout import layout as layout_command

KEYS = Keys()
TEXT = [{"role": "user", "content": "hi"}]


@pytest.fixture
def next_version(monkeypatch):
    """Makes the clients created inside it those of a version that reads layouts 1 and 2."""

    def make(settings):
        newest = layouts.NEWEST + 1
        with monkeypatch.context() as patch:
            patch.setattr(layouts, "NEWEST", newest)
            patch.setattr(layouts, "READS", (*layouts.READS, newest))
            return Client(settings), newest

    return make


def _keys(client):
    return sorted(client.redis.scan_iter("*"))


def test_a_library_refuses_every_call_while_a_newer_layout_is_in_force(settings):
    client = Client(settings)
    first = client.submit(TEXT)
    client.redis.set(KEYS.layout(), layouts.NEWEST + 1)
    before = _keys(client)
    with pytest.raises(LayoutUnreadable, match=f"layout {layouts.NEWEST + 1} is in force"):
        client.submit(TEXT)  # a call not safe to repeat (it carries a call id)
    with pytest.raises(LayoutUnreadable):
        client.state.workers.retire("w1")  # an allow-oom function
    with pytest.raises(LayoutUnreadable):
        client.state.scripts(
            "retire", [KEYS.workers(), KEYS.workers_heard()], ["w1"], wait=Wait(1, 10)
        )  # FCALL then WAIT, pipelined
    with pytest.raises(LayoutUnreadable, match="update this process"):
        client.state.layouts.check()
    assert _keys(client) == before  # refused whole: no task, no kept reply
    assert client.state.layouts.in_force() == layouts.NEWEST + 1  # a plain read still works
    with pytest.raises(LayoutUnreadable):  # and a plain read of a task is refused too
        client.status(first)
    client.redis.delete(KEYS.layout())
    client.state.layouts.check()
    assert client.status(client.submit(TEXT))["state"] == "queued"


def test_a_layout_is_raised_once_every_live_worker_reads_it(settings, next_version):
    old = Client(settings)
    old.state.workers.announce("before-the-switch", {"at": 1}, 60)
    old.state.workers.announce("this-version", {"at": 1, "layouts": list(layouts.READS)}, 60)
    new, newest = next_version(settings)
    assert new.state.scripts.name != old.state.scripts.name
    new.state.workers.announce("next-version", {"at": 1, "layouts": [1, newest]}, 60)
    assert new.state.layouts.raise_to(newest) == (1, ["before-the-switch", "this-version"])
    assert old.submit(TEXT)  # nothing was raised: both versions run
    old.state.workers.retire("before-the-switch")
    assert new.state.layouts.raise_to(newest) == (1, ["this-version"])
    old.state.workers.retire("this-version")
    assert new.state.layouts.raise_to(newest) == (newest, [])
    assert new.state.layouts.raise_to(newest) == (newest, [])  # safe to repeat
    with pytest.raises(LayoutUnreadable):  # the old version stops; the new one goes on
        old.submit(TEXT)
    with pytest.raises(LayoutUnreadable):
        old.state.workers.announce("this-version", {"at": 2, "layouts": [1]}, 60)
    assert new.status(new.submit(TEXT))["state"] == "queued"
    assert new.state.layouts.raise_to(1) == (newest, [])  # never lowered


def test_a_layout_key_that_holds_no_layout_refuses_everything_and_says_so(settings):
    client = Client(settings)
    client.redis.set(KEYS.layout(), "two")
    with pytest.raises(LayoutUnreadable, match="layout two is in force"):
        client.submit(TEXT)
    with pytest.raises(LayoutUnreadable, match="layout two is in force"):
        client.state.layouts.check()
    with pytest.raises(ConfigError, match="holds 'two', not a layout"):
        client.state.layouts.in_force()


def test_a_version_raises_only_a_layout_it_reads(settings):
    client = Client(settings)
    with pytest.raises(ConfigError, match="reads layouts"):
        client.state.layouts.raise_to(layouts.NEWEST + 1)
    keys = [KEYS.layout(), KEYS.workers()]
    with pytest.raises(Exception, match="does not know layout"):  # the library says so too
        client.state.scripts("raise_layout", keys, [layouts.NEWEST + 1])
    assert client.redis.get(KEYS.layout()) is None


def test_vlmq_layout_shows_the_switch_and_who_holds_it_back(settings, monkeypatch, next_version):
    monkeypatch.setenv("VLMQ_REDIS_URL", settings.redis_url)
    client = Client(settings)
    client.state.workers.announce("w1", {"at": 1, "layouts": [1]}, 60)
    runner = CliRunner()
    shown = runner.invoke(layout_command, ["--json"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output) == {
        "in_force": 1,
        "this_version_reads": list(layouts.READS),
        "workers": {"w1": [1]},
        "behind": [],
    }
    raised = runner.invoke(layout_command, ["--raise", "1"])
    assert raised.exit_code == 0 and "layout in force: 1" in raised.output
    with monkeypatch.context() as patch:
        patch.setattr(layouts, "NEWEST", 2)
        patch.setattr(layouts, "READS", (1, 2))
        refused = runner.invoke(layout_command, ["--raise", "2"])
    assert refused.exit_code == 1
    assert "not raised: 1 live worker(s) do not read layout 2 (w1)" in refused.output
    assert client.state.layouts.in_force() == 1
    client.redis.set(KEYS.layout(), 2)  # raised by a newer version
    shown = runner.invoke(layout_command, [])
    assert shown.exit_code == 0
    assert "layout in force: 2" in shown.output
    assert "this version does not read layout 2: update it" in shown.output
