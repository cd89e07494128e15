#!/usr/bin/env bash
# The torch venv for the peer references (golden files, benchmark baselines): ./.torchvenv.
# k31jax itself never imports torch. Do NOT add flash-linear-attention (fla), causal-conv1d,
# kernels or triton: transformers would swap its torch fallbacks for GPU-only kernels.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${K31JAX_TORCH_VENV:-.torchvenv}"
PY="$(command -v python3.11 || command -v python3)"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0 transformers safetensors numpy
echo "$VENV/bin/python"
