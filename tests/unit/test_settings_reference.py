"""Settings from one source: every field described, and .env.example and docs/settings.md
exactly what `vlmq settings` generates from the model (regenerate: `make settings-docs`)."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from vlmq.config.settings import Settings
from vlmq.config.settings_reference import (
    env_value,
    render_env,
    render_md,
    settings_groups,
    undescribed_fields,
)
from vlmq.producers.cli import cli
from vlmq.producers.settings_docs import COMPOSE, document, groups

ROOT = Path(__file__).resolve().parents[2]
GENERATED = {"env": ROOT / ".env.example", "md": ROOT / "docs" / "settings.md"}
# Where the product names environment variables: its packages and the compose file.
PRODUCT = [*(ROOT / d for d in ("config", "producers", "workers")), ROOT / "docker-compose.yml"]


def test_every_field_of_every_settings_model_has_a_description():
    assert undescribed_fields(Settings) == []


@pytest.mark.parametrize("fmt", sorted(GENERATED))
def test_the_generated_file_matches_the_model(fmt):
    path = GENERATED[fmt]
    expected, actual = document(fmt), path.read_text()
    if expected != actual:
        diff = difflib.unified_diff(
            actual.splitlines(), expected.splitlines(), str(path), "generated", lineterm=""
        )
        shown = "\n".join(list(diff)[:40])
        pytest.fail(f"{path.name} drifted from the settings: run `make settings-docs`\n{shown}")


@pytest.mark.parametrize("fmt", ["env", "md"])
def test_vlmq_settings_prints_the_reference(fmt):
    done = CliRunner().invoke(cli, ["settings", "--format", fmt])
    assert done.exit_code == 0, done.output
    assert done.output == document(fmt)


def test_env_is_the_default_format():
    assert CliRunner().invoke(cli, ["settings"]).output == document("env")


def reference_names() -> set[str]:
    return {entry.name for group in groups() for entry in group.entries}


def product_files() -> list[Path]:
    files = []
    for place in PRODUCT:
        files += sorted(place.rglob("*.py")) if place.is_dir() else [place]
    return files


# Named by the product but no setting: the test suite's hook into a worker process
# (workers/cli.py run_test_hook; tests/support/faults/inject.py).
TEST_ONLY = {"VLMQ_TEST_HOOK"}


def test_every_variable_the_product_names_is_in_the_reference():
    names = reference_names() | TEST_ONLY
    unknown = set()
    for path in product_files():
        for name in re.findall(r"\bVLMQ_[A-Z0-9_]*[A-Z0-9]_?", path.read_text()):
            # "VLMQ_MEDIA__MAX_" in prose stands for a family of settings.
            if name not in names and not any(n.startswith(name) for n in names if name[-1] == "_"):
                unknown.add(f"{name} ({path.relative_to(ROOT)})")
    assert not unknown, f"describe in Settings or producers/settings_docs.py: {sorted(unknown)}"
    # The walk reaches what is read outside Settings, and the nested models.
    assert {"VLMQ_LOG_LEVEL", "VLMQ_LOG_FORMAT", "VLMQ_WORKER_IMAGE"} <= names
    assert "VLMQ_ENGINE__VLLM__MAX_NUM_SEQS" in names
    assert "VLMQ_TENANTS__DEFAULT_QUOTA__MAX_QUEUED_TASKS" in names


def compose_defaults() -> dict[str, str | None]:
    """Each ${NAME} of docker-compose.yml with its :- default (None: none or nested)."""
    text = (ROOT / "docker-compose.yml").read_text()
    found: dict[str, str | None] = {}
    for name, default in re.findall(r"(?<!\$)\$\{([A-Za-z_]\w*)(?::-([^}$]*))?", text):
        found.setdefault(name, default or None)
    return found


def test_the_compose_entries_are_the_compose_files_variables_with_its_defaults():
    defaults = compose_defaults()
    documented = {entry.name: entry for entry in COMPOSE.entries}
    passed_through = {"FLOWER_BASIC_AUTH"}  # environment entries without a value
    missing = set(defaults) - reference_names()
    assert not missing, f"describe in producers/settings_docs.py COMPOSE: {sorted(missing)}"
    stale = set(documented) - set(defaults) - passed_through
    assert not stale, f"no longer in docker-compose.yml: {sorted(stale)}"
    for name, entry in documented.items():
        if defaults.get(name) is not None:
            assert env_value(entry.default) == defaults[name], name


# --- the generator is generic: a new field or group needs no change here -----------------


class _Policy(BaseModel):
    size: int = Field(ge=1, description="Rows.")


class _Inner(BaseModel):
    depth: int = Field(3, ge=1, le=9, description="How deep.")
    keys: list[str] = Field(default_factory=list, examples=[["a b"]], description="Keys.")


class _Toy(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOY_", env_nested_delimiter="__")

    mode: str = Field("x", pattern="^(x|y)$", description="Mode.")
    policies: dict[str, _Policy] = Field(
        default_factory=lambda: {"a": _Policy(size=2)}, description="Policies."
    )
    inner: _Inner = Field(default_factory=_Inner, description="Inner things.")
    missing: int | None = None


def test_groups_follow_the_models_nesting_with_bounds_choices_and_examples():
    toy = settings_groups(_Toy, "general", "Toy.")
    assert [(g.title, [e.name for e in g.entries]) for g in toy] == [
        ("general", ["TOY_MODE", "TOY_POLICIES", "TOY_MISSING"]),
        ("inner", ["TOY_INNER__DEPTH", "TOY_INNER__KEYS"]),
    ]
    env = render_env(toy, "Header.")
    assert "# Mode. Allowed: x, y.\n# TOY_MODE=x\n" in env
    assert "Each value: size: Rows. Allowed: at least 1." in env
    assert '# TOY_POLICIES={"a":{"size":2}}\n' in env
    assert "# How deep. Allowed: at least 1, at most 9.\n# TOY_INNER__DEPTH=3\n" in env
    assert "# TOY_INNER__KEYS='[\"a b\"]'\n" in env  # the example, quoted for its space
    assert "# TOY_MISSING=\n" in env
    md = render_md(toy, "# Toy")
    assert "- [inner](#inner)" in md
    assert "| `TOY_INNER__KEYS` | `[]` | Keys. Example: `'[\"a b\"]'`. |" in md
    assert "| `TOY_MISSING` | unset |  |" in md
    assert undescribed_fields(_Toy) == ["missing"]


def test_a_nested_undescribed_field_is_found():
    class Bare(BaseModel):
        size: int = 1

    class Holder(BaseModel):
        items: dict[str, Bare] = Field(default_factory=dict, description="Items.")
        maybe: Bare | None = Field(None, description="Maybe.")

    assert undescribed_fields(Holder) == ["items.size", "maybe.size"]
