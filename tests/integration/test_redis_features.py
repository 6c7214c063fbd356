"""bench.redis_features can still take each feature out of the scripts as they are.

Its edits are texts of vlmq/broker/lua: a change of the scripts that moves one must move the
edit with it, or the bench would stop (or measure a copy that does not load).
"""

from __future__ import annotations

import pytest

from bench.redis_features import FEATURES, copy_without
from vlmq.broker.scripts import LUA_FILES, library, source


@pytest.fixture
def redis(redis_server):
    connection = redis_server.connect()
    yield connection
    connection.close()


@pytest.mark.parametrize("feature", FEATURES, ids=lambda f: f.name)
def test_each_feature_comes_out_and_the_scripts_still_load(redis, feature, tmp_path):
    lua = copy_without(feature, tmp_path) / "vlmq" / "broker" / "lua"
    text = "\n".join((lua / f"{name}.lua").read_text() for name in LUA_FILES)
    assert text != source()
    for edit in feature.edits:
        assert edit.new in text
        assert edit.old not in text or edit.old in edit.new
    name, code = library(text)
    assert redis.execute_command("FUNCTION LOAD", code) == name
