"""Each Lua file of the one dispatch names, in its opening comment, the helpers it takes from
the other files (``-- uses common.lua: a, b; tasks.lua: c``, continued on lines indented past
``-- uses``). The files share one namespace
(``vlmq/broker/scripts.py`` concatenates them), so nothing else says where a helper a command
calls is defined; this reads every file and fails on a call the header does not name, and on a
header naming what the file does not call or what is not defined there."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

import pytest

from vlmq.broker.scripts import LUA_FILES

LUA_DIR = Path(str(resources.files("vlmq.broker").joinpath("lua")))
# ``local function name(`` and ``local name = function(`` at the top level of a file.
_DEFINED = re.compile(r"^local\s+function\s+(\w+)\s*\(|^local\s+(\w+)\s*=\s*function\s*\(", re.M)
_CALL = re.compile(r"(?<![\w.:])(\w+)\s*\(")
_HEADER = re.compile(r"^--\s*uses\s+(.*)$")
_STRING = re.compile(r"'(?:\\.|[^'\\])*'|\"(?:\\.|[^\"\\])*\"")


def _code(text: str) -> str:
    """The file without its comments and string literals (names in them are not calls)."""
    lines = []
    for line in text.splitlines():
        line = _STRING.sub("''", line)
        lines.append(line.split("--", 1)[0])
    return "\n".join(lines)


def defined(text: str) -> set[str]:
    return {a or b for a, b in _DEFINED.findall(text)}


def called(text: str) -> set[str]:
    return set(_CALL.findall(_code(text)))


def header(text: str) -> dict[str, set[str]] | None:
    """The file's ``-- uses`` line (among its opening comment lines): file -> names; None
    when it has none. ``-- uses nothing from the other files`` names none."""
    lines = text.splitlines()
    for at, line in enumerate(lines):
        if not line.startswith("--"):
            break
        match = _HEADER.match(line)
        if match is None:
            continue
        listed = match.group(1)
        for more in lines[at + 1 :]:  # continued on lines indented past '-- uses'
            if not more.startswith("--     "):
                break
            listed += " " + more[2:].strip()
        named: dict[str, set[str]] = {}
        for part in listed.split(";"):
            source, sep, names = part.partition(":")
            if sep:
                named[source.strip()] = {n.strip() for n in names.split(",") if n.strip()}
        return named
    return None


def _texts() -> dict[str, str]:
    return {
        f"{name}.lua": (LUA_DIR / f"{name}.lua").read_text(encoding="utf-8") for name in LUA_FILES
    }


def taken(texts: dict[str, str]) -> dict[str, dict[str, set[str]]]:
    """For each file, the helpers it calls that another file defines: file -> source -> names."""
    owner = {name: source for source, text in texts.items() for name in defined(text)}
    uses: dict[str, dict[str, set[str]]] = {}
    for path, text in texts.items():
        own = defined(text)
        for name in called(text) - own:
            source = owner.get(name)
            if source is not None and source != path:
                uses.setdefault(path, {}).setdefault(source, set()).add(name)
    return uses


@pytest.mark.parametrize("path", [f"{name}.lua" for name in LUA_FILES])
def test_each_lua_file_names_the_helpers_it_takes_from_the_others(path: str) -> None:
    texts = _texts()
    named = header(texts[path])
    assert named is not None, f"{path} opens with no '-- uses ...' line"
    wanted = taken(texts).get(path, {})
    assert named == wanted, (
        f"{path}: its header names {sorted((s, sorted(n)) for s, n in named.items())}, "
        f"it calls {sorted((s, sorted(n)) for s, n in wanted.items())}"
    )


def test_the_check_sees_an_unnamed_helper() -> None:
    """A file calling another's helper without naming it is caught (the check can fail)."""
    texts = {
        "a.lua": "-- uses nothing from the other files\nlocal function now() return 1 end\n",
        "b.lua": "-- uses nothing from the other files\nlocal x = now() -- now() here\n",
    }
    assert taken(texts) == {"b.lua": {"a.lua": {"now"}}}
    assert header(texts["b.lua"]) == {}


def test_a_header_line_reads_as_files_and_names() -> None:
    text = "-- uses common.lua: now,\n--      stamp; tasks.lua: settle_one\n-- title\nlocal y = 1\n"
    assert header(text) == {"common.lua": {"now", "stamp"}, "tasks.lua": {"settle_one"}}
