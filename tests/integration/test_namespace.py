"""The installed distribution is one package, ``vlmq``: a web app with its own ``config.py``,
``producers.py`` and ``workers.py`` still gets vlmq's modules (a real bug before)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from vlmq.config.keys import Keys

ROOT = Path(__file__).resolve().parents[2]
_CACHES = shutil.ignore_patterns("__pycache__")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy: setuptools writes build/ into the tree it builds.
    tree = out / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    for name in ("vlmq", "config", "producers", "workers"):
        shutil.copytree(ROOT / name, tree / name, symlinks=True, ignore=_CACHES)
    (tree / "examples").mkdir()
    for name in ("requests.jsonl", "README.md"):
        shutil.copy(ROOT / "examples" / name, tree / "examples" / name)
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run(
        [*pip, "-w", str(out), str(tree)],
        check=True,
        timeout=300,
        capture_output=True,
    )
    (built,) = out.glob("vlmq-*.whl")
    return built


def test_the_wheel_installs_one_top_level_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"vlmq"}
    top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["vlmq"]
    # Every module of the three folders made it in, and the demo's request template too.
    for folder in ("config", "producers", "workers"):
        for module in (ROOT / folder).rglob("*.py"):
            assert f"vlmq/{module.relative_to(ROOT)}" in names, module
    assert "vlmq/examples/requests.jsonl" in names


# What only tests and drills use: the checkout's tests/support, and by name any fault, drill,
# proxy or Sentinel module wherever it would hide.
_TEST_ONLY = re.compile(r"(^|/)(tests?|testing|support)/|fault|drill|proxy|sentinel|inject")


def test_the_wheel_holds_no_test_or_drill_code(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    modules = [n for n in names if n.startswith("vlmq/")]
    assert not [n for n in modules if _TEST_ONLY.search(n)]
    # No copy of a tests/support module under another name either.
    with zipfile.ZipFile(wheel) as built:
        shipped = {built.read(n) for n in modules if n.endswith(".py")}
    for module in (ROOT / "tests" / "support").rglob("*.py"):
        assert module.name == "__init__.py" or module.read_bytes() not in shipped, module
    # What the product runs itself is in: the demo's checkpoints, media and the no-op engine.
    for name in ("workers/demo/tiny/builder.py", "workers/demo/media.py", "workers/engine/noop.py"):
        assert f"vlmq/{name}" in names
    assert "vlmq/workers/demo/tiny/corpus.txt" in names


def _app_dir(tmp_path: Path) -> Path:
    """A web app's folder: modules named like vlmq's old top-level packages."""
    app = tmp_path / "webapp"
    app.mkdir()
    (app / "config.py").write_text("DEBUG = True  # the app's own settings\n")
    (app / "producers.py").write_text("KAFKA = 'the app has producers of its own'\n")
    (app / "workers.py").write_text("POOL = 4\n")
    return app


def test_an_app_with_its_own_config_module_enqueues(
    wheel: Path, tmp_path: Path, redis_server: Any
) -> None:
    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(site),
            str(wheel),
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )
    code = (
        "import config, producers, workers, json\n"
        "from vlmq import Client, Request, Result, Settings, VlmqError, __version__\n"
        "assert config.DEBUG and producers.KAFKA and workers.POOL  # the app's own\n"
        "client = Client(Settings(redis_url=REDIS))\n"
        "task = client.submit([{'role': 'user', 'content': 'hi'}], max_new_tokens=4)\n"
        "from vlmq.producers.examples import request_template\n"
        "assert 'EXAMPLES_DIR' in request_template()\n"
        "print(json.dumps({'task': task, 'version': __version__,\n"
        "                  'client': Client.__module__, 'file': __import__('vlmq').__file__}))\n"
    ).replace("REDIS", repr(redis_server.url))
    # The app's folder first on the path (as `python manage.py` has it), then the wheel's
    # install, then this environment's dependencies (redis, pydantic, ...); no site hooks, so
    # the checkout's editable install plays no part.
    deps = [p for p in sys.path if p.endswith("site-packages")]
    path = ["", str(site), *deps]
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", f"import sys; sys.path[:0] = {path!r}\n{code}"],
        cwd=_app_dir(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout)
    assert reply["file"].startswith(str(site))  # the installed wheel, not the checkout
    assert reply["client"] == "vlmq.producers.client"
    import vlmq

    assert reply["version"] == vlmq.__version__
    queued = redis_server.connect().hget(Keys().task(reply["task"]), "state")
    assert queued == "queued"
