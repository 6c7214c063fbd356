"""A job's own keys are spelled in one place (config/keys.py JOB_SUFFIXES): the Keys methods
build them from it, and the Lua, which learns a task's job while it runs, gets the same
suffixes from the table the library is built with, never its own copy."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

from vlmq.broker.scripts import LUA_FILES, job_keys, source
from vlmq.config.keys import JOB_SUFFIXES, Keys

LUA_DIR = Path(str(resources.files("vlmq.broker").joinpath("lua")))


def test_each_job_key_is_the_jobs_name_plus_its_suffix():
    keys = Keys("p")
    built = {
        "tasks": keys.job_tasks("J"),
        "claims": keys.job_custom_ids("J"),
        "finished": keys.job_finished("J"),
        "errors": keys.job_errors("J"),
        "usage": keys.job_usage("J"),
    }
    assert set(built) == set(JOB_SUFFIXES)
    for name, key in built.items():
        assert key == keys.job("J") + JOB_SUFFIXES[name]


def test_the_library_opens_with_the_suffixes_as_a_lua_table():
    table = job_keys()
    assert source().startswith(table)
    entries = dict(re.findall(r"(\w+) = '([^']*)'", table.split("JOB_KEYS = ", 1)[1]))
    assert entries == JOB_SUFFIXES


def test_no_lua_file_spells_a_job_suffix_itself():
    for name in LUA_FILES:
        text = (LUA_DIR / f"{name}.lua").read_text(encoding="utf-8")
        for suffix in JOB_SUFFIXES.values():
            assert f"'{suffix}'" not in text and f'"{suffix}"' not in text, (name, suffix)
