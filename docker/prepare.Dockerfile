# syntax=docker/dockerfile:1
# A vlmq prepare worker (`vlmq worker --role prepare`): fetches, decodes, samples and resizes
# the media of image and video tasks into the frame store for the GPU workers. No torch, no
# CUDA, no model weights (only the model's config files, from the Hugging Face cache): the
# base dependencies plus the `prepare` extra.
#
#   docker build -f docker/prepare.Dockerfile -t vlmq-prepare .
FROM python:3.11-slim

ARG VLMQ_UID=1000

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/hf-cache

WORKDIR /opt/vlmq-src
COPY pyproject.toml README.md ./
COPY config ./config
COPY producers ./producers
COPY workers ./workers
# The one installed package: vlmq/ maps the three folders above under its name.
COPY vlmq ./vlmq
COPY examples/requests.jsonl examples/README.md ./examples/
# The build fails if anything pulled torch in.
RUN pip install ".[prepare]" \
    && python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)" \
    && python -c "import av, PIL, xxhash, zstandard, vlmq.workers.fleet.prepare_tier" \
    && vlmq worker --help > /dev/null

RUN useradd --create-home --uid "${VLMQ_UID}" --shell /usr/sbin/nologin vlmq \
    && mkdir -p /work /hf-cache && chown vlmq:vlmq /work /hf-cache
USER vlmq
WORKDIR /work

HEALTHCHECK --interval=30s --timeout=15s --start-period=60s --retries=3 \
    CMD ["vlmq", "healthcheck", "worker"]

ENTRYPOINT ["vlmq"]
CMD ["worker", "--role", "prepare"]
