"""The settings reference: every variable with its default and meaning, from the models.

One source: a setting's meaning is its field's ``description`` in config/settings.py, its
default the field's default, its name what pydantic-settings reads (prefix and ``__`` from
the model's config). This module walks the models into groups (one per nested model) and
renders them as an ``.env`` file or Markdown tables; ``vlmq settings`` adds the variables
read outside ``Settings`` (producers/settings_docs.py) and prints them.
"""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python
from pydantic_settings import BaseSettings

__all__ = [
    "Entry",
    "Group",
    "env_value",
    "render_env",
    "render_md",
    "settings_groups",
    "undescribed_fields",
]

_WIDTH = 92
_CHOICES = re.compile(r"^\^\(([\w|.-]+)\)\$$")
_BOUNDS = (("ge", "at least"), ("gt", "above"), ("le", "at most"), ("lt", "below"))


@dataclass(frozen=True)
class Entry:
    """One environment variable: its default (``None``: unset) and what it means."""

    name: str
    default: Any
    meaning: str
    # Shown in .env.example instead of the default (a value worth copying, e.g. a key's form).
    example: Any = None
    # Written uncommented in .env.example (compose needs a value there).
    active: bool = False


@dataclass(frozen=True)
class Group:
    title: str
    intro: str
    entries: Sequence[Entry] = field(default_factory=tuple)


def settings_groups(model: type[BaseSettings], title: str, intro: str) -> list[Group]:
    """The model's variables: its own fields first (``title``), then one group per nested
    model, depth first, in field order."""
    config = model.model_config
    prefix = str(config.get("env_prefix") or "")
    delimiter = str(config.get("env_nested_delimiter") or "__")
    return list(_groups(model, title, intro, prefix, delimiter, path=""))


def _groups(
    model: type[BaseModel], title: str, intro: str, prefix: str, delimiter: str, path: str
) -> Iterator[Group]:
    """``path``: the dotted field path of a nested model ("engine.vllm"), empty at the root."""
    entries, nested = [], []
    for name, info in model.model_fields.items():
        variable = (prefix + name).upper()
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            inner = f"{path}.{name}" if path else name
            nested.append((annotation, inner, info.description or "", variable + delimiter))
        else:
            entries.append(_entry(variable, info))
    if entries:
        yield Group(title, intro, tuple(entries))
    for inner_model, inner, text, inner_prefix in nested:
        yield from _groups(inner_model, inner, text, inner_prefix, delimiter, inner)


def _entry(variable: str, info: FieldInfo) -> Entry:
    default = info.get_default(call_default_factory=True)
    meaning = " ".join(p for p in (info.description or "", _allowed(info), _items(info)) if p)
    example = info.examples[0] if info.examples else None
    return Entry(variable, None if default is PydanticUndefined else default, meaning, example)


def _allowed(info: FieldInfo) -> str:
    """The field's constraints in words: bounds and a pattern's choices."""
    bounds, choices = [], ""
    for item in info.metadata:
        for attribute, words in _BOUNDS:
            if getattr(item, attribute, None) is not None:
                bounds.append(f"{words} {getattr(item, attribute)}")
        pattern = getattr(item, "pattern", None)
        if pattern:
            match = _CHOICES.match(pattern)
            choices = ", ".join(match.group(1).split("|")) if match else f"matches {pattern}"
    text = ", ".join([*bounds, choices] if choices else bounds)
    return f"Allowed: {text}." if text else ""


def _items(info: FieldInfo) -> str:
    """For a mapping of models (class -> policy): the fields each value takes."""
    if get_origin(info.annotation) is not dict:
        return ""
    value = get_args(info.annotation)[-1]
    if not (isinstance(value, type) and issubclass(value, BaseModel)):
        return ""
    parts = []
    for name, inner in value.model_fields.items():
        text = " ".join(p for p in (inner.description or "", _allowed(inner)) if p)
        parts.append(f"{name}: {text.rstrip('.')}")
    return f"Each value: {'; '.join(parts)}."


def undescribed_fields(model: type[BaseModel], path: str = "") -> list[str]:
    """Every field of the model and the models it nests (also inside lists, dicts and
    unions) without a description."""
    missing = []
    for name, info in model.model_fields.items():
        where = f"{path}{name}"
        if not (info.description or "").strip():
            missing.append(where)
        for inner in _models_in(info.annotation):
            missing += undescribed_fields(inner, where + ".")
    return missing


def _models_in(annotation: Any) -> Iterator[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    for argument in get_args(annotation):
        yield from _models_in(argument)


# --- rendering ---------------------------------------------------------------------------


def env_value(value: Any) -> str:
    """A value as a .env line writes it: booleans in lower case, lists and objects as
    compact JSON (single-quoted if they hold whitespace), None as nothing."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int | float):
        return str(value)
    text = json.dumps(to_jsonable_python(value), separators=(",", ":"))
    return f"'{text}'" if re.search(r"\s", text) else text


def _comment(text: str) -> list[str]:
    return textwrap.wrap(
        text,
        _WIDTH,
        initial_indent="# ",
        subsequent_indent="# ",
        break_on_hyphens=False,
        break_long_words=False,
    )


def render_env(groups: Sequence[Group], header: str) -> str:
    """An .env file: each group under a rule, each variable after its meaning, commented
    out with its default (or example) unless it is active."""
    lines = [f"# {line}".rstrip() for line in header.strip().splitlines()]
    for group in groups:
        rule = f"# --- {group.title} "
        lines += ["", "", rule + "-" * max(3, _WIDTH - len(rule))]
        lines += _comment(group.intro) if group.intro else []
        for entry in group.entries:
            shown = entry.example if entry.example is not None else entry.default
            lines += ["", *_comment(entry.meaning)]
            lines.append(f"{'' if entry.active else '# '}{entry.name}={env_value(shown)}")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;")


def _md_default(value: Any) -> str:
    if value is None:
        return "unset"
    if value == "":
        return "empty"
    return f"`{env_value(value)}`"


def anchor(title: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def render_md(groups: Sequence[Group], header: str) -> str:
    """Markdown: the header, a table of contents, then one table per group."""
    lines = [header.strip(), ""]
    lines += [f"- [{g.title}](#{anchor(g.title)})" for g in groups]
    for group in groups:
        lines += ["", f"## {group.title}", ""]
        lines += [_cell(group.intro), ""] if group.intro else []
        lines += ["| variable | default | meaning |", "| --- | --- | --- |"]
        for entry in group.entries:
            meaning = entry.meaning
            if entry.example is not None:
                meaning += f" Example: `{env_value(entry.example)}`."
            default = _md_default(entry.default)
            lines.append(f"| `{entry.name}` | {_cell(default)} | {_cell(meaning)} |")
    return "\n".join(lines) + "\n"
