"""The docs name only what exists: every ``vlmq`` command and option, every ``make`` target,
every ``VLMQ_*`` variable, every ``python -m`` module, every repository path and ``vlmq.*``
module in code, and every link between the files.

Commands, options and targets are read from code (inline spans and fenced blocks), variables
from the whole text; what exists comes from the click command group, the Makefile, the
``Settings`` model (its env prefix and nested delimiter), the CLI's own environment variables
and docker-compose.yml's interpolated variables."""

from __future__ import annotations

import fnmatch
import re
import types
import typing
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import click
import pytest
from pydantic import BaseModel

from vlmq.config.settings import Settings
from vlmq.producers.cli import cli

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
# Checked for links only: they link into the docs (anchors included).
LINKED = [*DOCS, ROOT / "bench" / "README.md", ROOT / "examples" / "README.md"]

# Written by other parts of the same change (the settings reference and `vlmq settings`, the
# Celery and OpenAI guides, the operations page): remove each name once its work is merged.
PENDING_COMMANDS = {"settings"}
PENDING_FILES = {"docs/settings.md", "docs/celery.md", "docs/openai.md", "docs/operations.md"}

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE = re.compile(r"`([^`\n]+)`")
COMMAND_END = {"|", "||", "&&", ";", "#", "&", ")"}
NOT_A_COMMAND_BEFORE = {"from", "import", "install"}
NAME = re.compile(r"^[a-z][a-z0-9-]*$")
OPTION = re.compile(r"^\[?(--?[A-Za-z][A-Za-z0-9-]*)")
VARIABLE = re.compile(r"\bVLMQ_[A-Z0-9_]*[A-Z0-9]")
DOC_PATH = re.compile(r"\bdocs/[a-z0-9_-]+\.md\b")
MODULE = re.compile(r"python3? -m ((?:bench|tests|vlmq)(?:\.[a-z_0-9]+)*)")
# A repository path in code (vlmq/broker/feeding.py, workers/demo/tiny/NOTES.md, tests/faults/),
# and a module of the package (tests.support.faults; queue names such as vlmq.image are
# not modules).
REPO_PATH = re.compile(
    r"(?<![\w./-])((?:config|producers|workers|tests|bench|docker|examples|docs|vlmq|\.ci)/[\w./-]*\w)"
)
PACKAGE_MODULE = re.compile(r"\bvlmq\.(?:config|producers|workers)(?:\.\w+)*")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# --- reading the docs ----------------------------------------------------------------------


def code_snippets(text: str) -> Iterator[str]:
    """Every fenced block's commands (a line continued with a backslash joined to the next; a
    run of 3+ spaces ends a command, as before a comment) and every inline code span outside
    the fences. ```text blocks (pictures, trees) hold no commands."""
    fence: str | None = None
    prose, command = [], ""
    for line in text.splitlines():
        if FENCE.match(line):
            fence = None if fence is not None else line.strip()[3:].strip()
        elif fence == "text":
            continue
        elif fence is not None and line.rstrip().endswith("\\"):
            command += line.rstrip()[:-1] + " "
        elif fence is not None:
            yield from re.split(r" {3,}", command + line)
            command = ""
        else:
            prose.append(line)
    yield from INLINE.findall("\n".join(prose))


def words(snippet: str) -> list[str]:
    return snippet.replace("(", " ( ").split()


def vlmq_invocations(snippet: str) -> Iterator[list[str]]:
    """Each ``vlmq ...`` in a snippet, as its words up to the end of that command."""
    tokens = words(snippet)
    for at, token in enumerate(tokens):
        if token != "vlmq" or (at and tokens[at - 1] in NOT_A_COMMAND_BEFORE):
            continue
        rest = []
        for word in tokens[at + 1 :]:
            if word in COMMAND_END or word.startswith("#"):
                break
            rest.append(word)
        yield rest


def make_invocations(snippet: str) -> Iterator[str]:
    tokens = words(snippet)
    for at, token in enumerate(tokens):
        if token != "make":
            continue
        for word in tokens[at + 1 :]:
            if "=" in word:
                continue
            if not NAME.match(word):
                break
            yield word


@cache
def doc_texts() -> dict[str, str]:
    return {rel(path): path.read_text(encoding="utf-8") for path in DOCS}


# --- what exists ---------------------------------------------------------------------------


def resolve(words_: list[str]) -> tuple[list[click.Command], list[str], str | None]:
    """The commands a ``vlmq`` invocation names (the group first), its options, and the first
    name that is no command (None when every one exists)."""
    ctx = click.Context(cli)
    chain: list[click.Command] = [cli]
    options: list[str] = []
    naming = True  # still reading command names
    for at, word in enumerate(words_):
        option = OPTION.match(word)
        if option:
            options.append(option.group(1))
        elif naming and at and takes_value(chain[-1], words_[at - 1]):
            continue  # an option's value: --log-format json, --modality image
        elif naming and isinstance(chain[-1], click.Group) and NAME.match(word):
            command = chain[-1].get_command(ctx, word)
            if command is None:
                return chain, options, word
            chain.append(command)
        else:
            naming = False  # an argument, or a placeholder such as <command>
    return chain, options, None


def takes_value(command: click.Command, word: str) -> bool:
    option = OPTION.match(word)
    valued = {
        name
        for param in command.params
        if isinstance(param, click.Option) and not param.is_flag
        for name in param.opts
    }
    return bool(option and option.group(1) in valued)


def option_names(command: click.Command) -> set[str]:
    names = {"--help"}
    for param in command.params:
        if isinstance(param, click.Option):
            names |= set(param.opts) | set(param.secondary_opts)
    return names


@cache
def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][a-z0-9-]*)\s*:(?!=)", text, re.M))


def setting_names(model: type[BaseModel], prefix: str, delimiter: str) -> set[str]:
    """Every environment name a settings model reads: each field, and each nested model's own
    name (pydantic-settings takes a whole nested model as JSON too)."""
    names: set[str] = set()
    for field_name, field in model.model_fields.items():
        name = prefix + field_name.upper()
        names.add(name)
        annotation = field.annotation
        nested = _model_in(annotation)
        if nested is not None:
            names |= setting_names(nested, name + delimiter, delimiter)
        elif typing.get_origin(annotation) is dict:
            # A dict of models (VLMQ_BATCH): its default keys are names too.
            value_model = _model_in(typing.get_args(annotation)[1])
            keys = field.get_default(call_default_factory=True) if value_model else {}
            for key in keys:
                key_name = name + delimiter + str(key).upper()
                names.add(key_name)
                if value_model is not None:
                    names |= setting_names(value_model, key_name + delimiter, delimiter)
    return names


def _model_in(annotation: object) -> type[BaseModel] | None:
    """The model a field holds: itself, or inside an Optional (never a dict's values)."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    for candidate in [annotation, *(typing.get_args(annotation) if union else ())]:
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def cli_variables(command: click.Command) -> set[str]:
    names = set()
    for param in command.params:
        envvar = getattr(param, "envvar", None)
        names |= {envvar} if isinstance(envvar, str) else set(envvar or ())
    if isinstance(command, click.Group):
        ctx = click.Context(command)
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            names |= cli_variables(sub) if sub is not None else set()
    return names


@cache
def known_variables() -> set[str]:
    config = Settings.model_config
    prefix = config["env_prefix"]
    delimiter = config["env_nested_delimiter"]
    assert prefix and delimiter
    compose = (ROOT / "docker-compose.yml").read_text()
    # The test suite's hook into a worker process: documented for contributors, no setting.
    hook = set(
        re.findall(r'TEST_HOOK_ENV = "(VLMQ_[A-Z_]+)"', (ROOT / "workers/cli.py").read_text())
    )
    assert hook, "workers/cli.py names its test hook's variable in TEST_HOOK_ENV"
    return (
        setting_names(Settings, prefix, delimiter)
        | cli_variables(cli)
        | set(re.findall(r"\$\{(VLMQ_[A-Z0-9_]+)", compose))
        | hook
        | tool_variables()
    )


def tool_variables() -> set[str]:
    """Variables the benches and tests read themselves (``os.environ``, ``${...}`` in a
    script): documented for contributors, no setting."""
    read = re.compile(r"""environ(?:\.get\(|\[)\s*["'](VLMQ_[A-Z0-9_]+)|\$\{(VLMQ_[A-Z0-9_]+)""")
    found = set()
    for path in [*(ROOT / "bench").glob("*.py"), *(ROOT / "bench").glob("*.sh")]:
        found |= {a or b for a, b in read.findall(path.read_text())}
    for path in (ROOT / "tests").rglob("*.py"):
        found |= {a or b for a, b in read.findall(path.read_text())}
    return found


# --- the checks ----------------------------------------------------------------------------


def test_every_vlmq_command_and_option_named_exists() -> None:
    wrong, seen = [], set()
    for name, text in doc_texts().items():
        for snippet in code_snippets(text):
            for invocation in vlmq_invocations(snippet):
                chain, options, missing = resolve(invocation)
                if missing is not None:
                    if missing not in PENDING_COMMANDS:
                        wrong.append(
                            f"{name}: `vlmq {' '.join(invocation)}`: no command {missing!r}"
                        )
                    continue
                seen.add(" ".join(c.name or "" for c in chain[1:]))
                allowed = option_names(cli) | option_names(chain[-1])
                wrong += [
                    f"{name}: `vlmq {' '.join(invocation)}`: no option {option}"
                    for option in options
                    if option not in allowed
                ]
    assert not wrong, "\n".join(wrong)
    # The walk itself finds commands, nested ones included.
    assert {"submit", "worker", "serve", "healthcheck worker"} <= seen


def test_every_vlmq_command_is_in_the_readme_table() -> None:
    readme = doc_texts()["README.md"]
    table = {m for m in re.findall(r"^\|\s*`vlmq ([a-z-]+)", readme, re.M)}
    commands = set(cli.list_commands(click.Context(cli))) | PENDING_COMMANDS
    assert table == commands


def test_every_make_target_named_exists() -> None:
    wrong, seen = [], set()
    for name, text in doc_texts().items():
        for snippet in code_snippets(text):
            for target in make_invocations(snippet):
                seen.add(target)
                if target not in make_targets():
                    wrong.append(f"{name}: make {target}")
    assert not wrong, "\n".join(wrong)
    assert {"demo", "test"} <= seen


def test_every_vlmq_variable_named_is_a_setting() -> None:
    known = known_variables()
    # The walk itself reaches nested models, dict-valued settings and the CLI's own variables.
    assert {"VLMQ_ENGINE__VLLM__MAX_NUM_SEQS", "VLMQ_BATCH", "VLMQ_LOG_FORMAT"} <= known
    assert "VLMQ_BATCH__IMAGE__MAX_BATCH_SIZE" in known
    wrong = [
        f"{name}: {variable}"
        for name, text in doc_texts().items()
        for variable in sorted(set(VARIABLE.findall(text)))
        if variable not in known
    ]
    assert not wrong, "\n".join(wrong)


def test_every_module_run_with_python_m_exists() -> None:
    wrong = []
    for name, text in doc_texts().items():
        for module in set(MODULE.findall(text)):
            path = ROOT.joinpath(*module.split("."))
            if not (path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()):
                wrong.append(f"{name}: python -m {module}")
    assert not wrong, "\n".join(wrong)


def generated(path: str) -> bool:
    """Whether a path is made at run time (ignored by git: examples/media/, .vlmq/)."""
    patterns = (ROOT / ".gitignore").read_text().split()
    return any(
        fnmatch.fnmatch(path, p.rstrip("/")) or path.startswith(p.rstrip("/") + "/")
        for p in patterns
    )


def module_exists(dotted: str) -> bool:
    """A module or package of the checkout, or an attribute of one (…connection.create_redis)."""
    parts = dotted.split(".")
    for size in (len(parts), len(parts) - 1):
        path = ROOT.joinpath(*parts[:size])
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            return True
    return False


def test_every_path_and_module_named_exists() -> None:
    wrong, seen = [], 0
    for name, text in doc_texts().items():
        for snippet in code_snippets(text):
            for path in REPO_PATH.findall(snippet):
                seen += 1
                if not (ROOT / path).exists() and not generated(path) and path not in PENDING_FILES:
                    wrong.append(f"{name}: {path}")
            for module in PACKAGE_MODULE.findall(snippet):
                seen += 1
                if not module_exists(module):
                    wrong.append(f"{name}: {module}")
    assert not wrong, "\n".join(wrong)
    assert seen > 50


def github_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings, plus explicit <a id=...>."""
    anchors = set(re.findall(r'<a id="([^"]+)"', text))
    counts: dict[str, int] = {}
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        heading = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        n = counts.get(slug, 0)
        counts[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


@pytest.mark.parametrize("path", LINKED, ids=rel)
def test_links_between_the_docs_resolve(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    wrong = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto: not ours to check
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        name = rel(linked) if linked.is_relative_to(ROOT) else str(linked)
        if name in PENDING_FILES:
            continue
        if not linked.exists():
            wrong.append(f"{target}: no file {name}")
        elif anchor and linked.suffix == ".md" and anchor not in github_anchors(linked.read_text()):
            wrong.append(f"{target}: no heading #{anchor} in {name}")
    # Pages named in the text, not linked: docs/<page>.md from the repository root.
    for mention in set(DOC_PATH.findall(text)):
        if mention not in PENDING_FILES and not (ROOT / mention).exists():
            wrong.append(f"{mention}: no such page")
    assert not wrong, "\n".join(wrong)
