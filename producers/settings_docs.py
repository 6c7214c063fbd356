"""``vlmq settings``: every variable vlmq and its compose file read, with default and meaning.

The settings come from the ``Settings`` model (config/settings_reference.py walks it); the
few variables read elsewhere are listed here: the ``vlmq`` command's own options (read from
its click group, so they cannot drift) and docker-compose.yml's variables (its ``${VAR}``s;
tests/unit/test_settings_reference.py checks them against the compose file).
``.env.example`` and docs/settings.md are this command's output (``make settings-docs``).
"""

from __future__ import annotations

import click

from vlmq.config.settings import Settings
from vlmq.config.settings_reference import Entry, Group, render_env, render_md, settings_groups

__all__ = ["COMPOSE", "document", "groups", "settings"]

SETTINGS_INTRO = (
    "Redis, the results store, the model, the per-class batch policy and the tenant of this "
    "process's own submissions."
)


def _image(variable: str, service: str, default: str) -> Entry:
    return Entry(variable, default, f"Image of the {service} service.")


COMPOSE = Group(
    "docker compose",
    "Read by docker-compose.yml only: images, ports, volumes, GPUs and the services' own "
    "credentials. Ports of the UIs are bound to 127.0.0.1.",
    (
        Entry(
            "VLMQ_WORKER_IMAGE",
            "vlmq-worker:latest",
            "Tag docker compose gives the worker image it builds (docker/worker.Dockerfile); "
            "point it at your registry to run a prebuilt image.",
        ),
        Entry(
            "VLMQ_API_IMAGE",
            "vlmq-api:latest",
            "Tag of the API image (docker/api.Dockerfile), likewise.",
        ),
        Entry(
            "VLMQ_PREPARE_IMAGE",
            "vlmq-prepare:latest",
            "Tag of the prepare-tier image (docker/prepare.Dockerfile: no torch), likewise.",
        ),
        Entry(
            "VLMQ_VLLM_IMAGE",
            "vlmq-vllm:latest",
            "Tag of the vLLM worker image (docker/vllm.Dockerfile: vLLM's CUDA build and the "
            "torch it pins), likewise; built only with the vllm profile.",
        ),
        Entry(
            "PREPARE_REPLICAS",
            "2",
            "Prepare workers (the prepare tier, CPU only) docker compose starts; scale on "
            "vlmq_prepare_backlog (docs/prepare-tier.md).",
        ),
        Entry(
            "FLASH_ATTN",
            "1",
            "Worker image build: 1 installs flash-attn (the gpu extra), 0 builds without it "
            "(the engine then uses SDPA).",
        ),
        Entry(
            "FLASH_ATTN_WHEEL",
            "",
            "URL of a prebuilt flash-attn wheel matching the image's torch, CUDA and Python, "
            "for when no prebuilt release wheel exists (docker/worker.Dockerfile).",
        ),
        Entry(
            "HF_CACHE",
            "hf-cache",
            "Hugging Face cache mounted into every worker at /hf-cache (HF_HOME): a host path "
            "(readable by uid 1000) or a named volume. Weights are never baked into the image.",
        ),
        Entry(
            "HF_HUB_OFFLINE",
            "0",
            "1: never download at start-up (the cache must already hold the model).",
        ),
        *(
            Entry(
                f"VLMQ_MODEL_{cls.upper()}",
                None,
                f"The {cls} worker's model; unset: VLMQ_MODEL, else Qwen/Qwen2.5-VL-3B-Instruct.",
            )
            for cls in ("text", "image", "video")
        ),
        *(
            Entry(
                f"WORKER_{cls.upper()}_GPU",
                "0",
                f"GPU index (as nvidia-smi numbers them) of the {cls} worker. Docker hands a "
                "`count: 1` reservation the first GPU every time, so each worker names its own.",
            )
            for cls in ("text", "image", "video")
        ),
        Entry(
            "VLMQ_MODEL_VLLM",
            None,
            "The vLLM worker's model (`docker compose --profile vllm`); unset: VLMQ_MODEL, "
            "else Qwen/Qwen2.5-VL-3B-Instruct.",
        ),
        Entry(
            "WORKER_VLLM_MODALITIES",
            "image",
            "Classes the vLLM worker serves (comma-separated: text,image,video); stop the HF "
            "workers of those classes, or give them other GPUs.",
        ),
        Entry(
            "WORKER_VLLM_GPU",
            "0",
            "GPU index of the vLLM worker: a GPU of its own (vLLM takes "
            "VLMQ_ENGINE__VLLM__GPU_MEMORY_UTILIZATION of it at start).",
        ),
        Entry(
            "WORKER_VLLM_SHM_SIZE",
            "16gb",
            "Shared memory of the vLLM worker's container (vLLM's engine processes exchange "
            "tensors through /dev/shm; Docker's default 64 MB is too small).",
        ),
        Entry("API_PORT", "8000", "Host port of the HTTP API (the container listens on 8000)."),
        Entry(
            "PROMETHEUS_API_KEY",
            "",
            "Bearer key Prometheus sends to the API's /metrics: one of VLMQ_API__API_KEYS.",
        ),
        Entry("PROMETHEUS_RETENTION", "15d", "How long Prometheus keeps samples."),
        Entry("PROMETHEUS_PORT", "9090", "Host port of the Prometheus UI."),
        Entry("GRAFANA_PORT", "3000", "Host port of Grafana (the vlmq dashboard is its home)."),
        Entry(
            "GRAFANA_ADMIN_PASSWORD",
            "admin",
            "Password of Grafana's admin user (who may edit dashboards). Grafana asks for a "
            "new one at the first login while it is the default.",
            example="change-this-grafana-password",
            active=True,
        ),
        Entry(
            "GRAFANA_ANONYMOUS",
            "true",
            "true: anyone who reaches the port sees the dashboards as a viewer, without "
            "logging in; false: everyone logs in.",
        ),
        Entry("FLOWER_PORT", "5555", "Host port of Flower."),
        Entry("FLOWER_BASIC_AUTH", None, 'Flower\'s basic auth ("user:password"); unset: none.'),
        Entry(
            "MINIO_ROOT_USER",
            "vlmq",
            "MinIO (the S3-compatible results store of the stack): its user, also given to "
            "the workers and the API as AWS_ACCESS_KEY_ID.",
            active=True,
        ),
        Entry(
            "MINIO_ROOT_PASSWORD",
            "vlmq-secret",
            "MinIO's password (8 characters or more), also given to the workers and the API "
            "as AWS_SECRET_ACCESS_KEY: set a real one.",
            example="change-this-minio-password",
            active=True,
        ),
        Entry(
            "RESULTS_BUCKET",
            "vlmq-results",
            "Bucket minio-init creates; results land under s3://$RESULTS_BUCKET/results.",
        ),
        Entry("MINIO_CONSOLE_PORT", "9001", "Host port of the MinIO console."),
        Entry(
            "REDIS_MAXMEMORY",
            "4gb",
            "Redis memory cap. With maxmemory-policy noeviction, writes fail once it is "
            "reached instead of silently dropping queued tasks (sizing: docs/deploy.md).",
        ),
        _image("REDIS_IMAGE", "redis", "redis:7.4"),
        _image("MINIO_IMAGE", "minio", "minio/minio:latest"),
        _image("MC_IMAGE", "minio-init", "minio/mc:latest"),
        _image("FLOWER_IMAGE", "flower", "mher/flower:2.0"),
        _image("REDIS_EXPORTER_IMAGE", "redis-exporter", "oliver006/redis_exporter:v1.69.0"),
        _image("PROMETHEUS_IMAGE", "prometheus", "prom/prometheus:v3.5.0"),
        _image("GRAFANA_IMAGE", "grafana", "grafana/grafana:12.2.1"),
    ),
)

ENV_HEADER = """\
vlmq environment: copy to .env and edit.

  cp .env.example .env

Generated by `vlmq settings --format env` (make settings-docs) from the settings'
descriptions in config/settings.py: edit those, not this file. The same reference as
tables: docs/settings.md.

Two readers use .env:
- docker compose: it substitutes the ${VARS} of docker-compose.yml from this
  file, and passes the whole file to the workers and the API (env_file), so
  any VLMQ_* setting below that you uncomment reaches them.
- every vlmq process started from the repository root (pydantic-settings
  reads ./.env). Uncommenting VLMQ_MODEL here therefore also changes what
  `make demo` or a local `vlmq worker` loads: keep local experiments in the
  shell environment, which always wins over .env.

Values: plain text, no quotes needed. Lists and objects are JSON; wrap JSON
that contains spaces in single quotes ('{"a": 1}'). Lines starting with #
show the default (or an example), for reference: uncomment to change.
Settings nest with "__": VLMQ_ENGINE__MAX_BATCH_SIZE is Settings.engine.max_batch_size."""

MD_HEADER = """\
# Settings reference

Every variable vlmq reads, with its default and meaning. Generated by
`vlmq settings --format md` (`make settings-docs`) from the field descriptions of
`vlmq.Settings` (config/settings.py), like [`.env.example`](../.env.example); a unit test
fails when either drifts from the model.

Every vlmq process reads its settings once at start from `VLMQ_*` environment variables and
an optional `./.env` (the environment wins), nested with `__`:
`VLMQ_ENGINE__MAX_BATCH_SIZE` is `Settings.engine.max_batch_size`. Lists and objects are
JSON. The compose variables are read by docker-compose.yml alone."""


def command_entries() -> list[Entry]:
    """The ``vlmq`` command's own options that read an environment variable."""
    from vlmq.producers.cli import cli  # the CLI imports this module's command lazily

    entries = []
    for param in cli.params:
        if isinstance(param, click.Option) and isinstance(param.envvar, str):
            meaning = (param.help or "").replace(f" [{param.envvar}]", "")
            if isinstance(param.type, click.Choice):
                meaning += f" Allowed: {', '.join(map(str, param.type.choices))}."
            entries.append(Entry(param.envvar, param.default, meaning))
    return entries


def groups() -> list[Group]:
    """Everything ``vlmq settings`` prints, in order."""
    command = Group(
        "vlmq command",
        "Options of the `vlmq` command itself, for every subcommand (the flag wins).",
        tuple(command_entries()),
    )
    return [COMPOSE, command, *settings_groups(Settings, "general", SETTINGS_INTRO)]


def document(fmt: str) -> str:
    """The reference as an .env file (``env``) or Markdown (``md``)."""
    if fmt == "env":
        return render_env(groups(), ENV_HEADER)
    return render_md(groups(), MD_HEADER)


@click.command("settings")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["md", "env"]),
    default="env",
    show_default=True,
    help="env: an .env file (.env.example); md: Markdown tables (docs/settings.md).",
)
def settings(fmt: str) -> None:
    """Print every setting with its default and meaning."""
    click.echo(document(fmt), nl=False)
