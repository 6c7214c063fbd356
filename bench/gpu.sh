#!/usr/bin/env bash
# GPU run: real-dimension random-weight Qwen2.5-VL-3B / Qwen3-VL-2B / InternVL3-2B-hf checkpoints,
# bf16, transformers' generate beside the decode loop (CUDA graphs) per family, modality and
# batch size (text 1/8/32/64, image and video 1/8/32), with tok/s, ms per step, GPU busy, the
# memory roofline's share and the prefill's FLOP rate. Writes bench/GPU.md by default (--write
# FILE, or --write '' for none) and, with $OUT set (a device call), progress lines to
# $OUT/gpu-progress.log as they happen. Needs nothing from the network; fits in 7 minutes on one
# H200 (--time-budget-s, default 400, plus a hard stop at VLMQ_GPU_HARD_TIMEOUT_S, default 430).
#
#   bash bench/gpu.sh                 # on a CUDA machine
#   bash bench/gpu.sh --cpu-smoke     # same code path on CPU: tiny dims, fp32, < 60 s
#   VLMQ_GPU_BENCH_CPU_SMOKE=1 bash bench/gpu.sh
#   bash bench/gpu.sh --engines       # HF vs vLLM (bench.engines --size real), where vllm imports
#   bash bench/gpu.sh --media         # media on the GPU and the prepare tier (bench.gpu_media)
#   bash bench/gpu.sh --media --cpu-smoke
#   bash bench/gpu.sh --media --nvdec-only   # NVDEC vs the cores only; carry .whl-nvdec/
#
# Every mode runs on the GPU machine's image as it is: `make gpu-wheels` (here) puts the wheels
# it lacks (pydantic, pydantic-settings, av, zstandard, xxhash, llguidance, nvidia-ml-py) in
# .whl/, which travels; when the Python here cannot import them, they are installed into a
# temporary target ($VLMQ_GPU_SITE, default /tmp/vlmq-site) put first on PYTHONPATH.
# PYTHON=... picks the Python.
#
# Other options: python -m bench.gpu_bench --help, python -m bench.gpu_media --help
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ -n "${PYTHON:-}" ]]; then
    :
elif [[ -x .venv/bin/python ]]; then
    PYTHON=.venv/bin/python
else
    PYTHON=python3
fi

if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi || true
fi

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"

# The GPU machine's image lacks pydantic, PyAV, llguidance, pynvml...: install the wheels that
# `make gpu-wheels` put in .whl/ into a temporary target, first on PYTHONPATH.
# The NVDEC call (--media --nvdec-only) carries .whl-nvdec/ (`make gpu-wheels-nvdec`:
# pynvvideocodec with the base set) instead: both sets do not fit in one call's 64 MiB.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
wheel_dir=.whl
needed='pydantic, pydantic_settings, av, zstandard, xxhash, llguidance, pynvml, prometheus_client'
if [[ " $* " == *" --nvdec-only "* ]]; then
    wheel_dir=.whl-nvdec
    needed='pydantic, pydantic_settings, av, pynvml, prometheus_client, PyNvVideoCodec'
fi
if ! "$PYTHON" -c "import $needed" 2>/dev/null; then
    wheels=("$wheel_dir"/*.whl)
    if [[ ! -e "${wheels[0]}" ]]; then
        echo "gpu.sh: $PYTHON lacks one of $needed and $wheel_dir/ has no wheels: run 'make gpu-wheels' (or 'make gpu-wheels-nvdec') where pip works" >&2
        exit 2
    fi
    site="${VLMQ_GPU_SITE:-/tmp/vlmq-site}"
    echo "[$(date +%H:%M:%S)] installing ${#wheels[@]} wheels from $wheel_dir/ into $site"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${wheels[@]}"
    export PYTHONPATH="$site:$PYTHONPATH"
fi

# Progress lines go straight to a file under $OUT (the device tool's output folder) as they
# happen: a pipe through grep buffers, and a run cut at its limit would leave nothing.
progress=()
if [[ -n "${OUT:-}" ]]; then
    progress=(--progress "$OUT/gpu-progress.log")
fi

if [[ "${1:-}" == "--engines" ]]; then
    shift
    # Same requests through the HF engine and vLLM (continuous batching), real dimensions, bf16;
    # the vLLM side is skipped, and says why, where vllm does not import.
    echo "[$(date +%H:%M:%S)] $PYTHON -m bench.engines --size real --vllm-python $PYTHON $*"
    exec timeout --kill-after=15 "${VLMQ_GPU_HARD_TIMEOUT_S:-470}" \
        "$PYTHON" -m bench.engines --size real --vllm-python "$PYTHON" "$@"
fi

if [[ "${1:-}" == "--media" ]]; then
    shift
    echo "[$(date +%H:%M:%S)] PYTHONPATH=$PYTHONPATH $PYTHON -m bench.gpu_media ${progress[*]} $*"
    exec timeout --kill-after=15 "${VLMQ_GPU_HARD_TIMEOUT_S:-405}" \
        "$PYTHON" -m bench.gpu_media "${progress[@]}" "$@"
fi

echo "[$(date +%H:%M:%S)] $PYTHON -m bench.gpu_bench ${progress[*]} $*"
exec timeout --kill-after=15 "${VLMQ_GPU_HARD_TIMEOUT_S:-430}" \
    "$PYTHON" -m bench.gpu_bench "${progress[@]}" "$@"
