"""The deployment files agree with the code: docker-compose.yml, the Dockerfiles,
docker/prometheus.yml, Grafana's provisioning (docker/grafana/) and .env.example.

Nothing here needs a Docker engine. `docker compose config` runs when a compose
client is installed; everything else parses the files with PyYAML and checks
them against the CLI (`python -m vlmq CMD --help`), the settings models
and pyproject.toml.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import click
import pytest
import yaml
from pydantic import BaseModel

from vlmq.config.settings import Settings
from vlmq.producers.cli import _COMMANDS, cli
from vlmq.producers.healthcheck import fresh_worker, worker_beats

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
WORKER_DOCKERFILE = ROOT / "docker" / "worker.Dockerfile"
API_DOCKERFILE = ROOT / "docker" / "api.Dockerfile"
PROMETHEUS = ROOT / "docker" / "prometheus.yml"
GRAFANA_DASHBOARDS = "/etc/grafana/dashboards"
# Images whose ENTRYPOINT is `vlmq`: a service's command is vlmq's argv.
VLMQ_DOCKERFILES = {
    "docker/worker.Dockerfile",
    "docker/api.Dockerfile",
    "docker/prepare.Dockerfile",
    "docker/vllm.Dockerfile",
}
PREPARE_DOCKERFILE = ROOT / "docker" / "prepare.Dockerfile"
VLLM_DOCKERFILE = ROOT / "docker" / "vllm.Dockerfile"
VLLM_CPU_SETUP = ROOT / ".ci" / "setup-vllm-cpu.sh"
WORKERS = ("worker-text", "worker-image", "worker-video")
REQUIRED_SERVICES = {
    "redis",
    "minio",
    "minio-init",
    *WORKERS,
    "worker-prepare",
    "api",
    "flower",
    "redis-exporter",
    "prometheus",
    "grafana",
}


@cache
def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())  # resolves <<: merges
    return data


def services() -> dict[str, Any]:
    result: dict[str, Any] = compose()["services"]
    return result


def documented() -> set[str]:
    """Variable names .env.example documents, set (NAME=...) or commented (# NAME=...)."""
    return set(re.findall(r"^#?\s*([A-Za-z_][A-Za-z0-9_]*)=", ENV_EXAMPLE.read_text(), re.M))


def seconds(duration: str) -> float:
    """A compose duration such as 17m, 1h30m, 90s."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


def as_argv(command: Any) -> list[str]:
    if isinstance(command, str):
        return command.split()
    return [str(part) for part in command]


# --- services --------------------------------------------------------------------


def test_the_required_services_are_present():
    assert set(services()) >= REQUIRED_SERVICES


def test_redis_keeps_every_write_and_never_evicts():
    redis = services()["redis"]
    argv = as_argv(redis["command"])
    text = " ".join(argv)
    assert argv[0] == "redis-server"
    assert "--appendonly yes" in text
    assert "--appendfsync everysec" in text
    assert "--maxmemory-policy noeviction" in text
    assert any(str(v).endswith(":/data") for v in redis["volumes"])
    assert "redis-cli" in redis["healthcheck"]["test"]


def test_minio_init_creates_the_results_bucket_once():
    init = services()["minio-init"]
    script = " ".join(as_argv(init["command"]))
    assert "mc mb --ignore-existing" in script
    assert init["depends_on"]["minio"]["condition"] == "service_healthy"
    for name in (*WORKERS, "api"):
        depends = services()[name]["depends_on"]
        assert depends["minio-init"]["condition"] == "service_completed_successfully"
        assert depends["redis"]["condition"] == "service_healthy"


@pytest.mark.parametrize("name", WORKERS)
def test_workers_hold_a_gpu_the_hf_cache_and_a_long_grace_period(name):
    worker = services()[name]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert len(devices) == 1
    device = devices[0]
    assert device["driver"] == "nvidia"
    assert device["capabilities"] == ["gpu"]
    # One GPU each: `count: 1` or exactly one named device.
    assert device.get("count") == 1 or len(device.get("device_ids", [])) == 1
    assert any(re.search(r":/hf-cache(:r[ow])?$", str(v)) for v in worker["volumes"])
    assert worker["build"]["dockerfile"] == "docker/worker.Dockerfile"
    env = worker["environment"]
    assert "VLMQ_MODEL" in env and "VLMQ_BATCH" in env
    assert env["VLMQ_REDIS_URL"] == "redis://redis:6379/0"
    # SIGTERM lets the running batch finish (up to the batch time limit) and its
    # uploads drain (60 s) before Docker kills the container.
    limit = Settings().fleet.batch_time_limit_s
    assert seconds(worker["stop_grace_period"]) >= limit + 60
    assert worker["restart"] in {"unless-stopped", "always", "on-failure"}
    assert as_argv(worker["healthcheck"]["test"])[:4] == ["CMD", "vlmq", "healthcheck", "worker"]
    modality = name.removeprefix("worker-")
    assert as_argv(worker["command"]) == ["worker", "--modality", modality]


def test_the_prepare_tier_runs_without_a_gpu_or_torch_and_scales_by_replicas():
    prepare = services()["worker-prepare"]
    assert "resources" not in prepare.get("deploy", {})  # no GPU reservation
    assert str(prepare["deploy"]["replicas"]).isdigit() or "PREPARE_REPLICAS" in COMPOSE.read_text()
    assert prepare["build"]["dockerfile"] == "docker/prepare.Dockerfile"
    assert as_argv(prepare["command"])[:3] == ["worker", "--role", "prepare"]
    assert "VLMQ_MODEL" in prepare["environment"]  # its config files give the resize targets
    assert any(re.search(r":/hf-cache(:r[ow])?$", str(v)) for v in prepare["volumes"])
    assert as_argv(prepare["healthcheck"]["test"])[:4] == ["CMD", "vlmq", "healthcheck", "worker"]
    depends = prepare["depends_on"]
    assert depends["redis"]["condition"] == "service_healthy"
    dockerfile = PREPARE_DOCKERFILE.read_text()
    assert '".[prepare]"' in dockerfile and "find_spec('torch') is not None" in dockerfile
    assert "worker-prepare" in PROMETHEUS.read_text()


def test_the_vllm_worker_is_off_by_default_and_holds_a_gpu_of_its_own():
    vllm = services()["worker-vllm"]
    assert vllm["profiles"] == ["vllm"]
    # Only it: `docker compose up` starts every other service as before.
    assert [name for name, s in services().items() if "profiles" in s] == ["worker-vllm"]
    assert vllm["build"]["dockerfile"] == "docker/vllm.Dockerfile"
    assert "args" not in vllm["build"]  # not the HF image's flash-attn build arguments
    argv = as_argv(vllm["command"])
    assert argv[:3] == ["worker", "--engine", "vllm"] and argv[3] == "--modality"
    (device,) = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert device["device_ids"] == ["${WORKER_VLLM_GPU:-0}"]
    assert any(re.search(r":/hf-cache(:r[ow])?$", str(v)) for v in vllm["volumes"])
    # vLLM's engine processes share tensors through /dev/shm (Docker's default is 64 MB).
    assert "shm_size" in vllm or vllm.get("ipc") == "host"
    assert seconds(vllm["stop_grace_period"]) >= Settings().fleet.batch_time_limit_s + 60
    assert as_argv(vllm["healthcheck"]["test"])[:4] == ["CMD", "vlmq", "healthcheck", "worker"]
    assert seconds(vllm["healthcheck"]["start_period"]) >= 600
    env = vllm["environment"]
    assert env["VLMQ_REDIS_URL"] == "redis://redis:6379/0" and "VLMQ_MODEL" in env
    depends = vllm["depends_on"]
    assert depends["redis"]["condition"] == "service_healthy"
    assert depends["minio-init"]["condition"] == "service_completed_successfully"
    assert "worker-vllm" in PROMETHEUS.read_text()


def test_the_api_serves_on_all_interfaces_with_keys_from_the_environment():
    api = services()["api"]
    argv = as_argv(api["command"])
    assert argv[0] == "serve" and "0.0.0.0" in argv
    assert "VLMQ_API__API_KEYS" in api["environment"]
    assert any(str(p).endswith(":8000") for p in api["ports"])
    assert "/healthz" in " ".join(as_argv(api["healthcheck"]["test"]))
    assert api["build"]["dockerfile"] == "docker/api.Dockerfile"


def test_flower_watches_the_broker():
    flower = services()["flower"]
    argv = as_argv(flower["command"])
    assert argv[0] == "celery" and "flower" in argv
    assert "--broker=redis://redis:6379/0" in argv


# --- every vlmq command in the compose file exists, with its options ----------------


def vlmq_invocations() -> Iterator[tuple[str, list[str]]]:
    """(where, vlmq argv) for every command and healthcheck that runs vlmq."""
    for name, service in services().items():
        build = service.get("build")
        dockerfile = build.get("dockerfile") if isinstance(build, dict) else None
        runs_vlmq = dockerfile in VLMQ_DOCKERFILES and "entrypoint" not in service
        if "command" in service:
            argv = as_argv(service["command"])
            if runs_vlmq:
                # The entrypoint is already vlmq: "vlmq vlmq worker" would fail.
                assert argv[0] != "vlmq", f"{name}: command repeats the vlmq entrypoint"
                yield f"{name}.command", argv
            elif argv and argv[0] == "vlmq":
                yield f"{name}.command", argv[1:]
        test = as_argv(service.get("healthcheck", {}).get("test", []))
        if test[:2] == ["CMD", "vlmq"]:
            yield f"{name}.healthcheck", test[2:]


def command_path(argv: list[str]) -> list[str]:
    """The (sub)command names at the head of argv: ["healthcheck", "worker"]."""
    ctx = click.Context(cli)
    command: click.Command = cli
    path: list[str] = []
    for token in argv:
        if token.startswith("-") or not isinstance(command, click.Group):
            break
        sub = command.get_command(ctx, token)
        assert sub is not None, f"{' '.join([*path, token])}: no such vlmq command"
        path.append(token)
        command = sub
    return path


@cache
def help_text(path: tuple[str, ...]) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "vlmq", *path, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_every_vlmq_command_in_compose_exists_with_its_options():
    seen = list(vlmq_invocations())
    where = {w for w, _ in seen}
    assert {f"{w}.command" for w in (*WORKERS, "api")} <= where
    assert {f"{w}.healthcheck" for w in (*WORKERS, "api")} <= where
    for place, argv in seen:
        assert argv and argv[0] in _COMMANDS, f"{place}: {argv[:1]} is not a vlmq command"
        assert argv[0] in cli.list_commands(click.Context(cli))
        path = command_path(argv)
        text = help_text(tuple(path))
        for token in argv[len(path) :]:
            if token.startswith("--"):
                option = token.split("=", 1)[0]
                assert re.search(rf"(^|[\s,/]){re.escape(option)}\b", text, re.M), (
                    f"{place}: `vlmq {' '.join(path)}` has no option {option}"
                )


# --- variables ---------------------------------------------------------------------


def compose_variables() -> set[str]:
    text = COMPOSE.read_text()
    # ${NAME...} but not $${NAME} (an escaped $ for the container's shell).
    names = set(re.findall(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)", text))
    # Environment entries without a value are passed through from .env / the shell.
    for service in services().values():
        env = service.get("environment") or {}
        if isinstance(env, dict):
            names |= {key for key, value in env.items() if value is None}
        else:
            names |= {entry for entry in env if "=" not in entry}
    return names


def test_every_compose_variable_is_documented_in_env_example():
    missing = compose_variables() - documented()
    assert not missing, f"document in .env.example: {sorted(missing)}"


def settings_variables(model: type[BaseModel] = Settings, prefix: str = "VLMQ_") -> set[str]:
    """Every environment variable the settings models read (nested with __)."""
    names = set()
    for field_name, field in model.model_fields.items():
        name = prefix + field_name.upper()
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            names |= settings_variables(annotation, name + "__")
        else:
            names.add(name)
    return names


def test_every_setting_is_documented_in_env_example():
    names = settings_variables()
    # The walk itself reaches nested models.
    assert {"VLMQ_ENGINE__MAX_BATCH_SIZE", "VLMQ_FLEET__LEASE_S", "VLMQ_BATCH"} <= names
    assert not any("FAULTS" in name for name in names)  # a test hook, not a setting
    missing = names - documented()
    assert not missing, f"document in .env.example: {sorted(missing)}"


def test_env_example_values_parse_as_settings(monkeypatch):
    """Every VLMQ_* line of .env.example, uncommented, is a valid value."""
    for line in ENV_EXAMPLE.read_text().splitlines():
        match = re.match(r"^#?\s*(VLMQ_[A-Z0-9_]+)=(.*)$", line)
        if not match or not match.group(2):
            continue
        name, value = match.groups()
        if value.startswith("'") and value.endswith("'"):
            value = value[1:-1]
        monkeypatch.setenv(name, value)
    Settings(_env_file=None)


# --- images -------------------------------------------------------------------------


def pyproject() -> dict[str, Any]:
    data: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return data


def requirement_name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def extra_requirements(*extras: str) -> list[str]:
    """Base dependencies plus the extras, following self-references like vlmq[worker]."""
    project = pyproject()["project"]
    optional = project["optional-dependencies"]
    todo, done, found = list(extras), set(), list(project["dependencies"])
    while todo:
        extra = todo.pop()
        if extra in done:
            continue
        done.add(extra)
        assert extra in optional, f"pyproject.toml has no extra {extra!r}"
        for requirement in optional[extra]:
            if requirement_name(requirement) == project["name"]:
                inner = re.search(r"\[(.*)\]", requirement)
                todo += [e.strip() for e in inner.group(1).split(",")] if inner else []
            else:
                found.append(requirement)
    return found


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines, current = [], ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def instruction(path: Path, name: str) -> list[str]:
    return [args for kind, args in dockerfile_instructions(path) if kind == name]


def build_args(path: Path) -> dict[str, str]:
    """A Dockerfile's ARGs with their defaults."""
    return dict(a.split("=", 1) for a in instruction(path, "ARG") if "=" in a)


def test_the_api_image_installs_no_torch():
    runs = " ".join(instruction(API_DOCKERFILE, "RUN"))
    assert instruction(API_DOCKERFILE, "FROM")[0].startswith("python:3.11-slim")
    assert re.search(r"""pip install ["']?\.\[api\]""", runs)
    assert not re.search(r"\.\[[^\]]*\b(worker|gpu)\b", runs)
    assert "torch" not in re.sub(r"find_spec\('torch'\)", "", runs)
    requirements = {requirement_name(r) for r in extra_requirements("api")}
    assert not requirements & {"torch", "torchvision", "flash-attn", "transformers"}
    assert {"fastapi", "uvicorn", "python-multipart"} <= requirements


def test_the_api_image_runs_vlmq_serve_as_a_user():
    assert json.loads(instruction(API_DOCKERFILE, "ENTRYPOINT")[-1]) == ["vlmq"]
    cmd = json.loads(instruction(API_DOCKERFILE, "CMD")[-1])
    assert cmd[:1] == ["serve"] and "0.0.0.0" in cmd
    user = instruction(API_DOCKERFILE, "USER")
    assert user and user[-1] not in {"root", "0"}
    assert "/healthz" in instruction(API_DOCKERFILE, "HEALTHCHECK")[-1]


def test_the_worker_image_pins_torch_as_pyproject_does():
    pins = {}
    for requirement in extra_requirements("worker"):
        match = re.fullmatch(r"(torch|torchvision)==(\S+)", requirement)
        if match:
            pins[match.group(1)] = match.group(2)
    assert pins == {"torch": "2.14.1", "torchvision": "0.29.1"}
    args = build_args(WORKER_DOCKERFILE)
    assert args["TORCH_VERSION"] == pins["torch"]
    assert args["TORCHVISION_VERSION"] == pins["torchvision"]
    runs = " ".join(instruction(WORKER_DOCKERFILE, "RUN"))
    assert '"torch==${TORCH_VERSION}"' in runs and '"torchvision==${TORCHVISION_VERSION}"' in runs
    assert "--no-build-isolation" in runs and "flash-attn" in runs
    assert "EXTRA=gpu" in runs and 'pip install ".[${EXTRA}]"' in runs
    assert "flash-attn" in {requirement_name(r) for r in extra_requirements("gpu")}


def test_the_worker_image_runs_a_worker_as_a_user_with_a_mounted_hf_cache():
    assert any(
        e.startswith("CUDA_IMAGE=nvidia/cuda:") for e in instruction(WORKER_DOCKERFILE, "ARG")
    )
    env = " ".join(instruction(WORKER_DOCKERFILE, "ENV"))
    assert "HF_HOME=/hf-cache" in env
    assert json.loads(instruction(WORKER_DOCKERFILE, "ENTRYPOINT")[-1]) == ["vlmq"]
    assert json.loads(instruction(WORKER_DOCKERFILE, "CMD")[-1]) == [
        "worker",
        "--modality",
        "text",
    ]
    user = instruction(WORKER_DOCKERFILE, "USER")
    assert user and user[-1] not in {"root", "0"}
    assert "healthcheck" in instruction(WORKER_DOCKERFILE, "HEALTHCHECK")[-1]
    # Weights come from the mounted cache, never from the build.
    copied = " ".join(instruction(WORKER_DOCKERFILE, "COPY"))
    assert "hf-cache" not in copied and "models" not in copied


def _vllm_cpu_version() -> str:
    match = re.search(r'"vllm-cpu==([0-9][^"]*)"', VLLM_CPU_SETUP.read_text())
    assert match, "the CPU build's vllm-cpu pin"
    return match.group(1)


def test_the_vllm_image_is_an_environment_of_its_own():
    """vllm pins its own torch: the image installs vllm (the version the CPU tier tests)
    first, pins what it brought, and never the HF worker's extras and their torch pin."""
    assert build_args(VLLM_DOCKERFILE)["VLLM_VERSION"] == _vllm_cpu_version()
    runs = instruction(VLLM_DOCKERFILE, "RUN")
    text = " ".join(runs)
    first = next(i for i, run in enumerate(runs) if '"vllm==${VLLM_VERSION}"' in run)
    own = next(i for i, run in enumerate(runs) if 'pip install ".[vllm]"' in run)
    assert first < own
    assert "> /opt/pins.txt" in runs[first]
    assert "PIP_CONSTRAINT=/opt/pins.txt" in " ".join(instruction(VLLM_DOCKERFILE, "ENV"))
    assert not re.search(r"\.\[[^\]]*\b(worker|gpu)\b", text)
    assert "torch==" not in text and "flash-attn" not in text
    assert "pip check" in runs[own] and "vlmq.workers.engine.vllm_engine" in runs[own]
    # The extra itself leaves torch, torchvision and transformers to vllm.
    extra = {requirement_name(r) for r in pyproject()["project"]["optional-dependencies"]["vllm"]}
    assert "vllm" in extra and not extra & {"torch", "torchvision", "transformers", "flash-attn"}
    # One CUDA user space for both GPU images: vllm's torch and the HF worker's are CUDA 13.
    cuda = {
        path.name: build_args(path)["CUDA_IMAGE"] for path in (VLLM_DOCKERFILE, WORKER_DOCKERFILE)
    }
    assert all(image.startswith("nvidia/cuda:13.") for image in cuda.values()), cuda


def test_the_vllm_image_runs_a_vllm_worker_as_a_user_with_a_mounted_hf_cache():
    env = " ".join(instruction(VLLM_DOCKERFILE, "ENV"))
    assert "HF_HOME=/hf-cache" in env and "VLMQ_ENGINE__BACKEND=vllm" in env
    assert json.loads(instruction(VLLM_DOCKERFILE, "ENTRYPOINT")[-1]) == ["vlmq"]
    assert json.loads(instruction(VLLM_DOCKERFILE, "CMD")[-1])[:3] == ["worker", "--engine", "vllm"]
    user = instruction(VLLM_DOCKERFILE, "USER")
    assert user and user[-1] not in {"root", "0"}
    assert "healthcheck" in instruction(VLLM_DOCKERFILE, "HEALTHCHECK")[-1]
    copied = " ".join(instruction(VLLM_DOCKERFILE, "COPY"))
    assert "hf-cache" not in copied and "models" not in copied


def test_dockerignore_keeps_the_context_small_but_complete():
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    ignored = {line.strip() for line in lines if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", ".vlmq", ".env"} <= ignored
    assert not {"pyproject.toml", "README.md", "config", "producers", "workers", "vlmq"} & ignored
    assert not {"examples", "examples/requests.jsonl"} & ignored  # package data


# --- monitoring ----------------------------------------------------------------------


def test_prometheus_scrapes_the_workers_and_the_api():
    config = yaml.safe_load(PROMETHEUS.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    workers = jobs["vlmq-workers"]
    names = {n for sd in workers.get("dns_sd_configs", []) for n in sd["names"]}
    static = {t for sc in workers.get("static_configs", []) for t in sc["targets"]}
    assert set(WORKERS) <= names | {t.split(":")[0] for t in static}
    assert all(sd["port"] == 9100 for sd in workers.get("dns_sd_configs", []))
    api = jobs["vlmq-api"]
    assert api.get("metrics_path", "/metrics") == "/metrics"
    assert [t for sc in api["static_configs"] for t in sc["targets"]] == ["api:8000"]
    mounted = " ".join(services()["prometheus"]["volumes"])
    assert "./docker/prometheus.yml:/etc/prometheus/prometheus.yml" in mounted


def test_prometheus_scrapes_redis_through_a_pinned_exporter_of_the_compose_redis():
    exporter = services()["redis-exporter"]
    image = re.fullmatch(r"\$\{REDIS_EXPORTER_IMAGE:-(.+)\}", exporter["image"])
    # pinned: the dashboard's Redis row reads series (main-thread CPU) older ones lack
    assert image and re.fullmatch(r"oliver006/redis_exporter:v\d+\.\d+\.\d+", image.group(1))
    assert exporter["environment"]["REDIS_ADDR"] == "redis://redis:6379"
    assert exporter["depends_on"]["redis"]["condition"] == "service_healthy"
    assert "ports" not in exporter  # Prometheus reaches it on the compose network
    jobs = {
        job["job_name"]: job for job in yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]
    }
    targets = [t for sc in jobs["redis"]["static_configs"] for t in sc["targets"]]
    assert targets == ["redis-exporter:9121"]


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> host path (or volume name) of a service's volumes."""
    found = {}
    for volume in service.get("volumes", []):
        source, target = str(volume).split(":")[:2]
        found[target] = source
    return found


def test_grafana_reads_prometheus_and_opens_on_the_vlmq_dashboard():
    grafana = services()["grafana"]
    image = re.fullmatch(r"\$\{GRAFANA_IMAGE:-(.+)\}", grafana["image"])
    assert image and re.fullmatch(r"grafana/grafana:\d+\.\d+\.\d+", image.group(1))  # pinned
    assert grafana["depends_on"]["prometheus"]["condition"] == "service_started"
    assert any(re.fullmatch(r"127\.0\.0\.1:\S+:3000", str(p)) for p in grafana["ports"])
    env = grafana["environment"]
    assert env["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD")
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    mounted = mounts(grafana)
    assert mounted["/var/lib/grafana"] in compose()["volumes"]
    provisioning = ROOT / mounted["/etc/grafana/provisioning"]
    sources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    assert [(s["type"], s["url"]) for s in sources["datasources"]] == [
        ("prometheus", "http://prometheus:9090")
    ]
    assert any(str(p).endswith(":9090") for p in services()["prometheus"]["ports"])
    providers = yaml.safe_load((provisioning / "dashboards" / "vlmq.yml").read_text())
    assert [p["options"]["path"] for p in providers["providers"]] == [GRAFANA_DASHBOARDS]
    home = Path(env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert home.parent == Path(GRAFANA_DASHBOARDS)
    dashboard = ROOT / mounted[GRAFANA_DASHBOARDS] / home.name
    assert json.loads(dashboard.read_text())["uid"] == "vlmq"


# --- docker compose itself, where a client is installed ----------------------------


def compose_client() -> list[str] | None:
    for argv in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(argv[0]) is None:
            continue
        try:
            done = subprocess.run([*argv, "version"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            continue
        # Compose v2 or later (v1, the Python docker-compose, lacks the spec's newer keys).
        if done.returncode == 0 and re.search(r"version v?([2-9]|\d{2,})\.\d+", done.stdout):
            return argv
    return None


def _compose(argv: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*argv, "-f", str(COMPOSE), *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_docker_compose_config_accepts_the_file():
    argv = compose_client()
    if argv is None:
        pytest.skip("no Docker Compose v2+ client installed")
    done = _compose(argv, "config", "--quiet")
    assert done.returncode == 0, done.stderr
    # The vllm profile's service is valid too, and only that profile starts it.
    done = _compose(argv, "--profile", "vllm", "config", "--quiet")
    assert done.returncode == 0, done.stderr
    default = _compose(argv, "config", "--services").stdout.split()
    with_vllm = _compose(argv, "--profile", "vllm", "config", "--services").stdout.split()
    assert "worker-vllm" not in default and "worker-text" in default
    assert set(with_vllm) == {*default, "worker-vllm"}


# --- the healthcheck's decision ------------------------------------------------------


def test_the_worker_healthcheck_takes_the_freshest_beat_of_this_host():
    now = time.time()
    entries = {
        "text@box:1": json.dumps({"at": now - 500}),
        "text@box:2": json.dumps({"at": now - 5}),
        "text@boxer:3": json.dumps({"at": now}),
        "image@box:4": "not json",
    }
    beats = worker_beats(entries)
    assert {b.name for b in beats} == {"text@box:1", "text@box:2", "text@boxer:3"}
    beat, reason = fresh_worker(beats, "box", 90, now)
    assert beat is not None and beat.name == "text@box:2" and reason.startswith("ok")
    beat, reason = fresh_worker(beats, "box", 1, now)
    assert beat is None and "last beat 5s ago" in reason
    assert fresh_worker(beats, "nobox", 90, now)[0] is None
    assert fresh_worker(beats, "box", 90, now, name="text@boxer:3")[0] is not None


def test_the_healthcheck_imports_no_torch():
    code = (
        "import sys, vlmq.producers.healthcheck, vlmq.producers.cli; "
        "sys.exit('torch' in sys.modules or 'vlmq.workers' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60).returncode == 0
