# syntax=docker/dockerfile:1
# vlmq GPU worker: one process, one GPU, one model loaded once at start-up.
#
#   docker build -f docker/worker.Dockerfile -t vlmq-worker .
#   docker run --gpus '"device=0"' -v ~/.cache/huggingface:/hf-cache \
#       -e VLMQ_REDIS_URL=redis://redis:6379/0 -e VLMQ_MODEL=Qwen/Qwen2.5-VL-3B-Instruct \
#       vlmq-worker worker --modality image
#
# Model weights are never baked into the image: they come from a Hugging Face
# cache mounted at /hf-cache (HF_HOME). Set HF_HUB_OFFLINE=1 to forbid any
# download at start-up once the cache holds the model.
#
# CUDA: torch==2.14.1 from PyPI is the CUDA 13.0 build (it pulls its own CUDA
# runtime, cuDNN, cuBLAS and NCCL as nvidia-*-cu13 wheels; this is what the
# project's own venv resolves to). The base image therefore only has to carry
# a CUDA 13.0 user space that matches; the host needs an NVIDIA driver that
# supports CUDA 13.0 (R580 or newer) and the NVIDIA container toolkit. For an
# older driver, build with another PyTorch index, e.g.
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126
#   --build-arg CUDA_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu22.04
# (whether torch 2.14.1 / torchvision 0.29.1 are published for that CUDA
# version is not verified here; the pins below stay exactly as in pyproject).
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu22.04
FROM ${CUDA_IMAGE}

# Pinned exactly as pyproject.toml's `worker` extra (tests/unit/test_deploy.py checks).
ARG TORCH_VERSION=2.14.1
ARG TORCHVISION_VERSION=0.29.1
# Empty: PyPI. Set to a PyTorch wheel index for another CUDA build (see above).
ARG TORCH_INDEX_URL=
# flash-attn: 1 installs `.[gpu]` (flash-attn >= 2.7, used as flash_attention_2);
# 0 installs `.[worker]` only and the engine uses SDPA.
ARG FLASH_ATTN=1
# flash-attn is a compiled extension built for one torch / CUDA / Python /
# C++ ABI combination, so it must match the torch above. `pip install
# --no-build-isolation flash-attn` runs its setup.py against the torch
# installed here, which downloads the matching prebuilt wheel from the
# flash-attention releases (FLASH_ATTENTION_SKIP_CUDA_BUILD keeps setup.py
# from probing nvcc, which this runtime base does not have). When no prebuilt
# wheel exists for the combination (torch 2.14 + CUDA 13 may not have one),
# the result would lack its CUDA extension: the check below then fails the
# build loudly. In that case pass the URL of a wheel built for exactly
# torch 2.14 / CUDA 13.0 / cp311 / cxx11abi (built once in a
# nvidia/cuda:13.0.1-devel image with `pip wheel --no-build-isolation
# flash-attn`) as FLASH_ATTN_WHEEL, or build with FLASH_ATTN=0.
ARG FLASH_ATTN_WHEEL=
ARG VLMQ_UID=1000

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HOME=/hf-cache

# Python 3.11 (Ubuntu 22.04 ships 3.10; deadsnakes has current 3.11 builds).
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates gpg-agent software-properties-common \
    && add-apt-repository -y ppa:deadsnakes/ppa \
    && apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv \
    && apt-get purge -y --auto-remove software-properties-common gpg-agent \
    && rm -rf /var/lib/apt/lists/* \
    && python3.11 -m venv /opt/venv \
    && pip install --upgrade pip setuptools wheel

# torch first, on its own layer (multi-GB), pinned; the constraints file keeps
# every later install from moving it.
RUN printf 'torch==%s\ntorchvision==%s\n' "$TORCH_VERSION" "$TORCHVISION_VERSION" > /opt/pins.txt \
    && pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} \
        "torch==${TORCH_VERSION}" "torchvision==${TORCHVISION_VERSION}" \
    && python -c "import torch, torchvision; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
ENV PIP_CONSTRAINT=/opt/pins.txt

# flash-attn needs torch importable at build time: no build isolation.
RUN if [ "$FLASH_ATTN" = "1" ]; then \
        pip install packaging psutil ninja einops \
        && if [ -n "$FLASH_ATTN_WHEEL" ]; then \
            pip install --no-deps "$FLASH_ATTN_WHEEL"; \
        else \
            FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE pip install --no-build-isolation "flash-attn>=2.7"; \
        fi \
        && python -c "import importlib.util as u, sys; sys.exit(u.find_spec('flash_attn_2_cuda') is None)" \
        && python -c "import importlib.metadata as m; print('flash-attn', m.version('flash-attn'))"; \
    fi

WORKDIR /opt/vlmq-src
COPY pyproject.toml README.md ./
COPY config ./config
COPY producers ./producers
COPY workers ./workers
# The one installed package: vlmq/ maps the three folders above under its name.
COPY vlmq ./vlmq
COPY examples/requests.jsonl examples/README.md ./examples/
# The project itself: `.[gpu]` (= worker extra + flash-attn, already present),
# or `.[worker]` without flash-attn. transformers, tokenizers, pillow, av and
# numpy come from the worker extra.
RUN if [ "$FLASH_ATTN" = "1" ]; then EXTRA=gpu; else EXTRA=worker; fi \
    && pip install ".[${EXTRA}]" \
    && python -c "import torch; assert torch.__version__.split('+')[0] == '${TORCH_VERSION}', torch.__version__" \
    && python -c "import transformers, PIL, av, vlmq.workers.engine; print('transformers', transformers.__version__)" \
    && vlmq --help > /dev/null

RUN useradd --create-home --uid "${VLMQ_UID}" --shell /usr/sbin/nologin vlmq \
    && mkdir -p /hf-cache /work \
    && chown vlmq:vlmq /hf-cache /work
USER vlmq
WORKDIR /work
# A named volume mounted here starts owned by vlmq; a bind-mounted host cache
# must be readable (and writable, if models may be downloaded) by VLMQ_UID.
VOLUME ["/hf-cache"]

# Worker metrics (Prometheus) listen on VLMQ_METRICS__PORT, 9100 by default.
EXPOSE 9100

# Healthy while a worker of this container (name "...@<hostname>:<pid>") keeps
# its heartbeat in the Redis hash vlmq:workers fresh: the model loaded, the
# batch loop started, and the process still renews its leases. Loading a large
# model takes minutes, hence the long start period.
HEALTHCHECK --interval=30s --timeout=15s --start-period=10m --retries=3 \
    CMD ["vlmq", "healthcheck", "worker"]

# SIGTERM: the running batch finishes and is stored, pulled-but-unstarted
# messages go back to the queue (give it VLMQ_FLEET__BATCH_TIME_LIMIT_S + 60 s).
STOPSIGNAL SIGTERM
ENTRYPOINT ["vlmq"]
CMD ["worker", "--modality", "text"]
