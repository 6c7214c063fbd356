# syntax=docker/dockerfile:1
# vlmq HTTP API and producer CLI (`vlmq serve`, `vlmq submit`, `vlmq status`, ...).
# No torch: the base dependencies plus the `api` extra only.
#
#   docker build -f docker/api.Dockerfile -t vlmq-api .
#   docker run -p 8000:8000 -e VLMQ_REDIS_URL=redis://redis:6379/0 \
#       -e 'VLMQ_API__API_KEYS=["change-me"]' vlmq-api
#
# `vlmq serve` refuses to bind anything but loopback without API keys, so
# VLMQ_API__API_KEYS (a JSON list) must be set for this image's default command.
FROM python:3.11-slim

ARG VLMQ_UID=1000

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/vlmq-src
COPY pyproject.toml README.md ./
COPY config ./config
COPY producers ./producers
COPY workers ./workers
# The one installed package: vlmq/ maps the three folders above under its name.
COPY vlmq ./vlmq
COPY examples/requests.jsonl examples/README.md ./examples/
# The build fails if anything pulled torch in.
RUN pip install ".[api]" \
    && python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)" \
    && python -c "import fastapi, uvicorn, vlmq.producers.api.app" \
    && vlmq --help > /dev/null

RUN useradd --create-home --uid "${VLMQ_UID}" --shell /usr/sbin/nologin vlmq \
    && mkdir -p /work && chown vlmq:vlmq /work
USER vlmq
WORKDIR /work

EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["vlmq", "healthcheck", "api", "--url", "http://127.0.0.1:8000/healthz"]

ENTRYPOINT ["vlmq"]
CMD ["serve", "--host", "0.0.0.0"]
