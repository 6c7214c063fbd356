"""``--engine vllm`` against the HF engine on the small checkpoints of all three families (fp32,
greedy): the same tokens through ``vlmq run`` and through a fleet worker; bad media and a
request vLLM refuses fail alone; kill -9 of a vLLM worker mid-run, and the death of its engine
process, lose nothing.

Starting vLLM (~30-45 s on 2 cores) is the tier's cost, so each family starts it once: one
process (``tests/vllm/driver.py``) runs the mixed lines through ``vlmq run``'s loop, then serves
the family's own Redis database as a fleet worker for the family's other checks; the last check
of two families kills it (kill -9 of the worker; the death of its engine process)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Fleet, fleet_environment, vlmq
from tests.e2e.test_fleet import _client, _in_engine, _job_finished, _pointed, _policy, _ready
from tests.support.samples import save_image, save_video
from tests.support.services import wait_until
from tests.support.structured import check_record
from tests.support.structured import mixed_lines as structured_lines
from tests.vllm.conftest import vllm_python

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "internvl")
# 10 s leases (the e2e tier's are 3 s): a vLLM worker on a loaded 2-core host renews late,
# and a lapse while it runs is a redelivery this tier does not test (issue 38).
ONE_BATCH = {
    "VLMQ_BATCH": json.dumps({m: _policy(16, 0.5) for m in ("text", "image", "video")}),
    "VLMQ_FLEET__LEASE_S": "10",
}


def _user(*parts: dict[str, Any] | str) -> list[dict[str, Any]]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return [{"role": "user", "content": content}]


def mixed_lines(media: Path) -> list[dict[str, Any]]:
    a, b = (
        {"type": "image", "image": str(media / "a.png")},
        {"type": "image", "image": str(media / "b.png")},
    )
    video = {"type": "video", "video": str(media / "v.mp4"), "fps": 2}
    lines: list[dict[str, Any]] = [
        {
            "custom_id": "text",
            "messages": [
                {"role": "system", "content": "Be terse."},
                *_user("Tell me about queues."),
            ],
        },
        {"custom_id": "image", "messages": _user(a, "What is it?")},
        {"custom_id": "two_images", "messages": _user(a, b, "Compare them.")},
        {"custom_id": "video", "messages": _user(video, "What happens?")},
        {"custom_id": "interleaved", "messages": _user("First", a, "then", b, "now?")},
        {
            "custom_id": "bad_media",
            "messages": _user({"type": "image", "image": str(media / "missing.png")}, "?"),
        },
        # The producer-side check (no tokenizer) passes it; the worker refuses it, naming the
        # field, on both engines (it compiles it against the model's tokenizer).
        {
            "custom_id": "bad_grammar",
            "messages": _user("Say x."),
            "grammar": 'start: "x" <|no_such_token|>',
        },
        # vlmq takes temperatures up to 5; vLLM refuses more than 2: that request fails alone.
        {"custom_id": "refused", "messages": _user("Hot."), "temperature": 3.0, "seed": 1},
    ]
    lines = [{**line, "max_new_tokens": 12} for line in lines]
    # Issue 13's surface where vLLM has it: a JSON schema, json_object, regex, choice, n=3,
    # logprobs, two plain rows.
    return lines + structured_lines(str(media / "a.png"))


# Sampled rows: vLLM's sampler is not the HF engine's, so they are checked, not compared.
SAMPLED = {"n3", "json_object"}
STRUCTURED = {line["custom_id"] for line in structured_lines("x.png")}


EXPECTED_FAILURES = {"bad_media": "media_fetch_failed", "bad_grammar": "invalid_request"}
# What vLLM refuses and the HF engine runs: custom_id -> the refusal's code.
REFUSED_BY_VLLM = {"refused": "invalid_request"}


@pytest.fixture(scope="session")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("media")
    save_image(root / "a.png", size=(64, 64), seed=1)
    save_image(root / "b.png", size=(96, 80), seed=2)
    save_video(root / "v.mp4", n_frames=16, size=(64, 64), fps=8, seed=3)
    return root


def _run(
    runner: Any, model: Path, source: Path, out: Path, media: Path, *extra: str
) -> list[dict[str, Any]]:
    proc = runner(
        "run",
        str(source),
        "-o",
        str(out),
        "--model",
        str(model),
        *extra,
        env={"VLMQ_MEDIA__LOCAL_ROOTS": json.dumps([str(media)])},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log[-3000:]
    return _records(out)


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@dataclass
class Driver:
    """A family's one vLLM process (tests/vllm/driver.py): set up at the tier's start, then,
    once told to go, its ``vlmq run`` output and a fleet worker on the family's own Redis
    database."""

    name: str
    model: Path
    env: dict[str, str]
    root: Path
    process: subprocess.Popen[bytes]

    @property
    def source(self) -> Path:
        return self.root / "in.jsonl"

    @property
    def run_output(self) -> Path:
        return self.root / "vllm.jsonl"

    @property
    def log(self) -> Path:
        return self.root / "driver.log"

    def go(self) -> None:
        (self.root / "go").touch()


def _start_driver(
    name: str, root: Path, model: Path, media: Path, redis_url: str, moto: Any
) -> Driver:
    root.mkdir(parents=True, exist_ok=True)
    bucket = f"vllm-{name}".replace("_", "-")
    env = {**fleet_environment(redis_url, moto, bucket, media), **ONE_BATCH}
    env["VLMQ_MODEL"] = str(model)
    (root / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in mixed_lines(media)))
    with (root / "driver.log").open("wb") as out:
        process = vllm_python(
            "-m",
            "tests.vllm.driver",
            "--run",
            str(root / "in.jsonl"),
            str(root / "vllm.jsonl"),
            "--go",
            str(root / "go"),
            "--name",
            f"vllm-{name}",
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: kill -9 reaches vLLM's engine processes too
        )
    return Driver(name, model, env, root, process)


def _families_selected(session: pytest.Session) -> list[str]:
    chosen = {
        item.callspec.params["family"]
        for item in session.items
        if hasattr(item, "callspec") and "family" in item.callspec.params
    }
    return [name for name in FAMILIES if name in chosen]


class Drivers:
    """The families' vLLM processes, one each, in the order their tests run. Starting vLLM
    is the tier's cost, and two engines starting side by side on two cores measured slower
    than one after the other, so the next family's starts while this one's fleet checks run
    (``start_next``)."""

    def __init__(self, root: Path, order: list[str], start: Any) -> None:
        self.root = root
        self.order = order
        self._start = start
        self.started: dict[str, Driver] = {}

    def get(self, name: str) -> Driver:
        if name not in self.started:
            self.started[name] = self._start(name, self.root / name)
        return self.started[name]

    def start_next(self, name: str) -> None:
        later = self.order[self.order.index(name) + 1 :] if name in self.order else []
        if later:
            self.get(later[0])


@pytest.fixture(scope="session")
def drivers(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    media: Path,
    checkpoint: Any,
    shared_redis: Any,
    moto_server: Any,
) -> Iterator[Drivers]:
    def start(name: str, root: Path) -> Driver:
        model = checkpoint(name, "small")
        # The family's own Redis database: its own queues.
        return _start_driver(name, root, model, media, shared_redis.database().url, moto_server)

    started = Drivers(tmp_path_factory.mktemp("vllm"), _families_selected(request.session), start)
    yield started
    for driver in started.started.values():
        _kill_group(driver.process)


@dataclass
class Family:
    """A family's small checkpoint, the mixed lines, the HF engine's records for them, and
    the family's vLLM process."""

    driver: Driver
    media: Path
    hf: dict[str, dict[str, Any]]

    @property
    def name(self) -> str:
        return self.driver.name

    @property
    def model(self) -> Path:
        return self.driver.model

    @property
    def env(self) -> dict[str, str]:
        return self.driver.env

    @property
    def worker(self) -> str:
        return f"vllm-{self.name}"

    def client(self) -> Any:
        return _client(self.env)

    def run_records(self) -> list[dict[str, Any]]:
        """The driver's ``vlmq run`` output, once it is complete."""
        out, process = self.driver.run_output, self.driver.process
        wait_until(
            lambda: out.exists() or process.poll() is not None,
            timeout=420,
            what=f"the vLLM run of {self.name}",
        )
        assert out.exists(), self._exited()
        return _records(out)

    def serving(self) -> None:
        """Its fleet worker is registered (it has run its ``vlmq run`` lines first)."""
        self.run_records()
        wait_until(
            lambda: _ready(self.client(), 1) or self.driver.process.poll() is not None,
            timeout=120,
            what=f"the vLLM worker of {self.name}",
        )
        assert self.driver.process.poll() is None, self._exited()

    def _exited(self) -> str:
        log = self.driver.log.read_text(errors="replace")[-3000:]
        return f"the vLLM driver exited ({self.driver.process.returncode}): {log}"


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, drivers: Drivers, media: Path) -> Iterator[Family]:
    driver = drivers.get(request.param)
    driver.go()
    try:
        # The HF engine's records while vLLM starts and runs the same lines.
        hf = _run(vlmq, driver.model, driver.source, driver.root / "hf.jsonl", media)
        family = Family(driver, media, {r["custom_id"]: r for r in hf})
        family.run_records()
        drivers.start_next(request.param)
        yield family
    finally:
        _kill_group(driver.process)


def _same_as_hf(hf: dict[str, dict[str, Any]], records: dict[str, dict[str, Any]]) -> None:
    assert sorted(records) == sorted(hf)
    for custom_id, expected in hf.items():
        got = records[custom_id]
        if custom_id in REFUSED_BY_VLLM:
            assert expected["status"] == "succeeded", (custom_id, expected)
            assert got["status"] == "failed", (custom_id, got)
            assert got["error"]["code"] == REFUSED_BY_VLLM[custom_id]
            assert "refused by vLLM" in got["error"]["message"]
            continue
        if custom_id in EXPECTED_FAILURES:
            assert expected["status"] == got["status"] == "failed", (custom_id, got)
            assert got["error"]["code"] == expected["error"]["code"] == EXPECTED_FAILURES[custom_id]
            continue
        assert got["status"] == "succeeded", (custom_id, got.get("error"))
        if custom_id == "json_object":
            # A random model closes a JSON string by chance: constrained, it is JSON so far.
            assert got["output"].startswith("{")
            if got["finish_reason"] == "stop":
                assert isinstance(json.loads(got["output"]), dict)
            continue
        if custom_id in STRUCTURED:
            check_record(custom_id, got)
        if custom_id in SAMPLED:
            continue
        if custom_id == "logprobs":
            _same_logprobs(expected, got)
        assert got["output"] == expected["output"], custom_id
        assert got["usage"] == expected["usage"], custom_id  # prompt tokens incl. visual ones
        assert got["finish_reason"] == expected["finish_reason"], custom_id


def _same_logprobs(expected: dict[str, Any], got: dict[str, Any]) -> None:
    """The model's own log-probabilities on both engines (raw logits, log-softmax)."""
    hf = expected["choices"][0]["logprobs"]["content"]
    vllm = got["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in vllm] == [e["token"] for e in hf]
    for a, b in zip(hf, vllm, strict=True):
        assert b["logprob"] == pytest.approx(a["logprob"], abs=1e-4)
        assert [t["token"] for t in b["top_logprobs"]] == [t["token"] for t in a["top_logprobs"]]


def test_vlmq_run_gives_the_hf_engines_tokens(family: Family) -> None:
    records = family.run_records()
    _same_as_hf(family.hf, {r["custom_id"]: r for r in records})
    # One line each, in input order (the refused one too).
    assert [r["custom_id"] for r in records] == [x["custom_id"] for x in mixed_lines(family.media)]


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


def test_a_fleet_worker_gives_the_hf_engines_tokens(family: Family) -> None:
    family.serving()
    client = family.client()
    job = client.submit_many(mixed_lines(family.media), name=f"vllm-{family.name}")
    wait_until(lambda: _job_finished(client, job), timeout=420, what="the job on a vLLM worker")
    records = {r["custom_id"]: r for r in (client.result(t) for t in client.job_task_ids(job))}
    _same_as_hf(family.hf, records)
    assert all(
        r["worker"].startswith(family.worker)
        for r in records.values()
        if r["status"] == "succeeded"
    )


def _text_job(client: Any, count: int, tokens: int) -> tuple[str, list[dict[str, Any]]]:
    """A job of ``count`` text requests of ``tokens`` new tokens each: its id and its lines."""
    items = [
        {"custom_id": f"c{i}", "messages": _user(f"task {i}"), "max_new_tokens": tokens}
        for i in range(count)
    ]
    return client.submit_many(items), items


def _finish_on_hf(family: Family, client: Any, job: str) -> dict[str, int]:
    """Start an HF worker for the rest (and what a lost vLLM worker held: its leases lapse and
    are redelivered); the job's counts once it finished."""
    fleet = Fleet(family.env)
    try:
        fleet.start("--modality", "text", "--name", "hf-after")
        wait_until(lambda: _job_finished(client, job), timeout=300, what="the job on an HF worker")
        return dict(client.status(job)["counts"])
    finally:
        fleet.stop()


# The last check of its family: it kills the family's vLLM worker.
@pytest.mark.parametrize("family", ["qwen2_5_vl"], indirect=True)
def test_kill9_of_a_vllm_worker_mid_run_loses_nothing(family: Family) -> None:
    family.serving()
    client = family.client()
    job, items = _text_job(client, 48, 48)
    ids = list(client.job_task_ids(job))
    try:
        wait_until(
            lambda: _in_engine(client, ids, family.worker), timeout=420, what="requests inside vLLM"
        )
    finally:
        _kill_group(family.driver.process)
    counts = _finish_on_hf(family, client, job)
    assert counts["succeeded"] == 48 and counts["failed"] == 0, counts
    attempts = [int(s["attempts"]) for s in client.state.tasks.many(ids)]
    assert max(attempts) >= 2  # what was inside the killed engine ran again
    assert sorted(client.store.keys(job)) == sorted(_pointed(client, ids))  # one object each
    results = [client.result(t) for t in ids]
    assert sorted(str(r["custom_id"]) for r in results) == sorted(
        str(i["custom_id"]) for i in items
    )


def _engine_core_pids(worker: subprocess.Popen) -> list[int]:
    """vLLM's engine-core processes under a worker (same process group; setproctitle names
    them VLLM::EngineCore)."""
    found = subprocess.run(
        ["pgrep", "-g", str(worker.pid), "-f", "EngineCore"], capture_output=True, text=True
    )
    return [int(pid) for pid in found.stdout.split()]


# The last check of its family: it kills the engine process under the family's vLLM worker.
@pytest.mark.parametrize("family", ["qwen3_vl"], indirect=True)
def test_a_dead_engine_makes_the_worker_exit_and_its_work_is_redelivered(family: Family) -> None:
    family.serving()
    client = family.client()
    job, _ = _text_job(client, 32, 64)
    ids = list(client.job_task_ids(job))
    worker = family.driver.process
    try:
        wait_until(
            lambda: _in_engine(client, ids, family.worker), timeout=420, what="requests inside"
        )
        cores = _engine_core_pids(worker)
        assert cores, "no vLLM engine-core process found"
        for pid in cores:
            os.kill(pid, signal.SIGKILL)  # the engine dies; the worker process does not
        # It notices, and exits on its own (so its leases lapse), instead of failing the work.
        assert worker.wait(120) != 0
    finally:
        _kill_group(worker)
    counts = _finish_on_hf(family, client, job)
    assert counts["succeeded"] == 32 and counts["failed"] == 0, counts
